"""reshard diff: finds differences between checkpoints of any layouts, prints per tensor the max
absolute difference, honours --atol and --state, and reads a single-file safetensors state dict."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
MODEL = ROOT / "configs" / "models" / "tiny-gpt.yaml"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} not built (run scripts/setup.sh)")


def run(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


def synth(out, layout, seed):
    r = run("synth", out, "--model", MODEL, "--layout", layout, "--seed", seed)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    return {
        "s1": synth(d / "s1", "tp=2,pp=2,dp=1,zero=1", 1),
        "s2": synth(d / "s2", "tp=1,pp=1,dp=2,zero=2", 2),
        "s1_tp1": synth(d / "s1_tp1", "tp=1,pp=1,dp=1,zero=0", 1),
        "dir": d,
    }


def test_different_seeds_differ_with_per_tensor_max_diff(ckpts):
    r = run("diff", ckpts["s1"], ckpts["s2"])
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("DIFFERS")]
    assert lines, r.stdout
    assert any("layers.0.self_attention.query_key_value.weight (fp32): max |diff|" in l for l in lines), r.stdout
    for l in lines:
        m = re.search(r"max \|diff\| (\S+)", l)
        assert m and float(m.group(1)) > 0, l
    assert "differ" in r.stdout.splitlines()[-1]


def test_json_and_atol(ckpts):
    r = run("diff", ckpts["s1"], ckpts["s2"], "--json", "--state", "exp_avg_sq")
    assert r.returncode == 1
    j = json.loads(r.stdout)
    assert {t["state"] for t in j["tensors"]} == {"exp_avg_sq"}
    worst = max(t["max_abs_diff"] for t in j["tensors"])
    assert 0 < worst < 4  # synth values have |x| < 2
    # an atol above the largest difference makes them pass; one below does not
    assert run("diff", ckpts["s1"], ckpts["s2"], "--state", "exp_avg_sq", "--atol", worst * 1.01).returncode == 0
    assert run("diff", ckpts["s1"], ckpts["s2"], "--state", "exp_avg_sq", "--atol", worst * 0.99).returncode == 1


def test_same_seed_other_layout_is_equal(ckpts):
    r = run("diff", ckpts["s1"], ckpts["s1_tp1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 differ" in r.stdout


def test_safetensors_state_dict_side_and_small_difference(ckpts):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    files = st.load_file(str(ckpts["s1_tp1"] / "step-2" / "rank_00000.safetensors"))
    master = {k[len("fp32/"):]: v for k, v in files.items() if k.startswith("fp32/")}
    weights = {k[len("weight/"):]: v for k, v in files.items() if k.startswith("weight/")}
    d = ckpts["dir"]
    # Global shapes come from inspect; the files hold 1-D buffers at tp=1.
    j = json.loads(run("inspect", ckpts["s1"], "--json").stdout)
    shapes = {t["name"]: t["shape"] for t in j["tensors"]}
    master = {k: v.reshape(shapes[k]).contiguous() for k, v in master.items()}
    weights = {k: v.reshape(shapes[k]).contiguous() for k, v in weights.items()}
    st.save_file(master, str(d / "master.safetensors"))
    st.save_file(weights, str(d / "weights.safetensors"))
    # fp32 file -> compared with the fp32 master of a differently laid out checkpoint
    r = run("diff", ckpts["s1"], d / "master.safetensors")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fp32 state" in r.stdout
    r = run("diff", d / "weights.safetensors", ckpts["s1"])
    assert r.returncode == 0, r.stdout + r.stderr
    # Exact copies compare bitwise: the 16-bit file's values widened to fp32 (as the checkpoint
    # side is held) have the same bytes; the summary counts them all.
    n = len(weights)
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert f"{n} equal ({n} bitwise)" in r.stdout and "BF16 vs F32, compared widened to fp32" in r.stdout, r.stdout
    r = run("diff", ckpts["s1"], d / "master.safetensors")
    assert f"{len(master)} equal ({len(master)} bitwise)" in r.stdout, r.stdout
    # a small perturbation is found, and --atol lets it pass
    name = "layers.1.mlp.dense_4h_to_h.weight"
    master[name] = master[name].clone()
    master[name][3, 5] += 1e-4
    st.save_file(master, str(d / "master_perturbed.safetensors"))
    r = run("diff", ckpts["s1"], d / "master_perturbed.safetensors", "--json")
    assert r.returncode == 1
    bad = [t for t in json.loads(r.stdout)["tensors"] if not t["equal"]]
    assert [t["tensor"] for t in bad] == [name]
    assert bad[0]["max_abs_diff"] == pytest.approx(1e-4, rel=0.05)
    assert run("diff", ckpts["s1"], d / "master_perturbed.safetensors", "--atol", "1e-3").returncode == 0
    # a tensor missing from the file is a difference
    del master["final_layernorm.bias"]
    st.save_file(master, str(d / "master_partial.safetensors"))
    r = run("diff", ckpts["s1"], d / "master_partial.safetensors")
    assert r.returncode == 1 and "final_layernorm.bias (fp32): max |diff| -" in r.stdout and "only in A" in r.stdout
    # NaN or Inf against a number is a difference no tolerance hides (it printed max |diff| inf and
    # --atol inf called it equal); NaN against NaN and Inf against the same Inf are equal.
    name = "layers.0.mlp.dense_4h_to_h.weight"
    master = {k: v.reshape(shapes[k]).contiguous() for k, v in
              ((k[len("fp32/"):], v) for k, v in files.items() if k.startswith("fp32/"))}
    master[name] = master[name].clone()
    master[name][0, 1] = float("nan")
    master[name][2, 3] = float("inf")
    st.save_file(master, str(d / "master_nan.safetensors"))
    for atol in ("0", "inf"):
        r = run("diff", ckpts["s1"], d / "master_nan.safetensors", "--atol", atol)
        assert r.returncode == 1, r.stdout
        assert "2 element(s) NaN or infinite where the other side differs" in r.stdout, r.stdout
    r = run("diff", d / "master_nan.safetensors", d / "master_nan.safetensors")
    assert r.returncode == 0 and "0 differ" in r.stdout, r.stdout


@pytest.mark.parametrize("which", ["nonexistent", "file", "empty"])
def test_unreadable_input_exit_2(ckpts, tmp_path, which):
    bad = {"nonexistent": tmp_path / "nope", "file": tmp_path / "f.txt", "empty": tmp_path / "empty"}[which]
    if which == "file":
        bad.write_text("x")
    if which == "empty":
        bad.mkdir()
    for args in ([ckpts["s1"], bad], [bad, ckpts["s1"]]):
        r = run("diff", *args)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(bad) in lines[0], r.stderr
