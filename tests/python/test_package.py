"""The installable package: a wheel built from this checkout with pip (scikit-build-core over
CMake), installed into a fresh virtual environment, gives the `reshard` console script and
`import reshard` / `import reshard.integrations.megatron_deepspeed` from any directory, with the
model presets inside the package.

The wheel is built in build/ when scripts/setup.sh made it (pip's editable install, so only the
packaging runs); RESHARD_TEST_WHEEL_FRESH=1 builds it from scratch in a temporary folder instead
(about 7 min on 2 cores). The fresh environment gets torch (the version of this one, pinned) and the
wheel's other dependencies from pip."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=kw.pop("timeout", 1200), **kw)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    import torch
    tmp = tmp_path_factory.mktemp("pkg")
    wheels = tmp / "wheels"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", wheels, REPO]
    cache = os.path.join(REPO, "build", "CMakeCache.txt")
    if os.environ.get("RESHARD_TEST_WHEEL_FRESH") != "1" and os.path.isfile(cache) and "SKBUILD" in open(cache).read():
        cmd += ["-Cbuild-dir=" + os.path.join(REPO, "build"), "-Ccmake.define.RESHARD_BUILD_TESTS=ON",
                "-Ccmake.define.RESHARD_BUILD_BENCHMARKS=ON"]
    _run(cmd, cwd=tmp, timeout=1800)
    built = sorted(wheels.glob("reshard-*.whl"))
    assert len(built) == 1, built
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv])
    pin = tmp / "constraints.txt"
    pin.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", pin, built[0]], cwd=tmp)
    return venv, tmp


def test_wheel_installs_the_console_script_and_the_package(fresh_venv):
    venv, tmp = fresh_venv
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RESHARD_HOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # The console script is the venv's, and it runs the binary installed inside the package.
    assert os.path.isfile(venv / "bin" / "reshard")
    r = _run(["reshard", "--help"], cwd=work, env=env)
    assert "Usage: reshard" in r.stdout and "convert" in r.stdout
    r = _run(["reshard", "--version"], cwd=work, env=env)
    assert r.stdout.startswith("reshard 0."), r.stdout
    r = _run([venv / "bin" / "python", "-c",
              "import reshard, reshard.integrations.megatron_deepspeed as m, os; "
              "print(reshard.__version__, os.path.dirname(reshard.__file__), m.load_checkpoint.__name__)"],
             cwd=work, env=env)
    version, where, fn = r.stdout.split()
    assert where == str(venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "reshard")
    assert fn == "load_checkpoint" and version.startswith("0.")
    # A preset model name resolves inside the installed package (no checkout around), and a tp
    # change through the installed CLI reads back equal to its source.
    _run(["reshard", "synth", "--model", "tiny-gpt", "--layout", "tp=2,pp=2,dp=1,zero=1", "--out-step", "3", "src"],
         cwd=work, env=env)
    _run(["reshard", "convert", "src", "--target", "tp=1,pp=1,dp=2,zero=1", "out"], cwd=work, env=env)
    r = subprocess.run(["reshard", "diff", "src", "out"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "208 equal (208 bitwise), 0 differ" in r.stdout, r.stdout + r.stderr
    r = _run([venv / "bin" / "python", "-c",
              "import reshard; print(reshard.open_checkpoint('out').layout.topology)"], cwd=work, env=env)
    assert "tp=1,pp=1" in r.stdout and "dp=2" in r.stdout, r.stdout
