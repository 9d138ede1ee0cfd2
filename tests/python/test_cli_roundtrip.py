"""reshard synth / convert / diff: A -> B -> A round trips are bitwise equal for tp, pp, dp and ZeRO
changes in both directions, in one process and under mpirun with one rank per target rank."""
import json
import os
import subprocess
from pathlib import Path

import pytest

import mpi_cli
from mpi_cli import MPIRUN

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
MODEL = ROOT / "configs" / "models" / "tiny-gpt.yaml"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} not built (run scripts/setup.sh)")


def run(*args, timeout=120):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def synth(out, layout, seed=7):
    r = run("synth", out, "--model", MODEL, "--layout", layout, "--seed", seed)
    assert r.returncode == 0, r.stderr
    return out


def diff_json(a, b, *extra):
    r = run("diff", a, b, "--json", *extra)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def assert_bitwise_equal(a, b):
    code, j = diff_json(a, b)
    bad = [t for t in j["tensors"] if not t["bitwise"]]
    assert code == 0 and not bad, bad[:5]
    # every tensor of every state kind was compared
    states = {t["state"] for t in j["tensors"]}
    assert states == {"weight", "fp32", "exp_avg", "exp_avg_sq"}, states
    assert j["compared"] == j["num_bitwise"] > 0


PAIRS = [
    ("tp=1,pp=1,dp=1,zero=0", "tp=2,pp=2,dp=2,zero=1"),
    ("tp=2,pp=1,dp=2,zero=2", "tp=4,pp=1,dp=1,zero=3"),
    ("tp=1,pp=2,dp=4,zero=1", "tp=1,pp=1,dp=3,zero=3"),
    ("tp=4,pp=2,dp=1,zero=0", "tp=2,pp=1,dp=4,zero=2"),
    ("tp=2,pp=2,dp=1,zero=1", "tp=1,pp=1,dp=2,zero=0"),
]


@pytest.mark.parametrize("la,lb", PAIRS, ids=[f"{a}__{b}" for a, b in PAIRS])
def test_convert_round_trip_is_bitwise(tmp_path, la, lb):
    a = synth(tmp_path / "a", la)
    r = run("convert", a, tmp_path / "b", "--target", lb)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "latest").read_text().strip() == "step-8"  # iteration of seed 7
    r = run("convert", tmp_path / "b", tmp_path / "a2", "--target", la)
    assert r.returncode == 0, r.stderr
    assert_bitwise_equal(a, tmp_path / "b")
    assert_bitwise_equal(a, tmp_path / "a2")
    assert_bitwise_equal(tmp_path / "b", tmp_path / "a2")
    # the converted checkpoint is what synth writes at B directly
    assert_bitwise_equal(tmp_path / "b", synth(tmp_path / "sb", lb))
    # it verifies, and inspect reports the target layout
    r = run("verify", tmp_path / "b")
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads(run("inspect", tmp_path / "a2", "--json").stdout)
    topo = {k: v for k, v in j["topology"].items() if k != "world_size"}
    want = {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "zero": 0}
    want.update({k: int(v) for k, v in (kv.split("=") for kv in la.split(","))})
    assert topo == want


def test_convert_step_name_option(tmp_path):
    a = synth(tmp_path / "a", "tp=2,dp=1")
    r = run("convert", a, tmp_path / "b", "--target", "tp=1,dp=2,zero=1", "--out-step", "mystep", "--memory-budget", "1MiB")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "mystep" / "metadata.json").is_file()
    assert_bitwise_equal(a, tmp_path / "b")
    # The same OUT step again: refused (a converted checkpoint is never replaced silently), then
    # replaced with --overwrite.
    before = (tmp_path / "b" / "mystep" / "metadata.json").read_bytes()
    r = run("convert", a, tmp_path / "b", "--target", "tp=1,dp=1,zero=1", "--out-step", "mystep")
    assert r.returncode == 2 and "already holds a checkpoint; pass --overwrite" in r.stderr, r.stderr
    assert (tmp_path / "b" / "mystep" / "metadata.json").read_bytes() == before
    r = run("convert", a, tmp_path / "b", "--target", "tp=1,dp=1,zero=1", "--out-step", "mystep", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert "dp=1," in json.loads((tmp_path / "b" / "mystep" / "metadata.json").read_text())["topology"]
    # OUT inside the source's step folder (the step folder itself, or a folder in it) is refused
    # before anything is written (it used to write step-N/step-N and a `latest` among the source
    # files).
    step = next(p for p in a.iterdir() if p.is_dir())
    (step / "sub").mkdir()
    for out in (step, step / "sub", step / "new" / "deeper", step / "sub" / ".." / "new2"):
        listing = sorted(p.name for p in step.iterdir())
        r = run("convert", step, out, "--target", "tp=1,dp=1,zero=1")
        assert r.returncode == 2 and "is inside the source step folder" in r.stderr, r.stderr
        assert sorted(p.name for p in step.iterdir()) == listing
    # Next to the step folder is fine.
    r = run("convert", step, step.parent / "beside", "--target", "tp=1,dp=1,zero=1")
    assert r.returncode == 0, r.stderr


def test_convert_refuses_outs_that_would_lose_or_hide_data(tmp_path):
    """Each case is refused with exit 2 before anything under OUT changes."""
    a = synth(tmp_path / "a", "tp=2,dp=1")
    step = next(p.name for p in a.iterdir() if p.is_dir())  # what convert names the output step

    def refused(out, needle, *extra):
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        r = run("convert", a, out, "--target", "tp=1,dp=1,zero=0", *extra)
        assert r.returncode == 2 and needle in r.stderr, r.stdout + r.stderr
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before

    # A file where the step folder goes: kept, with or without --overwrite (it was deleted).
    (tmp_path / "o1").mkdir()
    (tmp_path / "o1" / step).write_text("my notes")
    for extra in ((), ("--overwrite",)):
        refused(tmp_path / "o1", "exists and is not a folder", *extra)
    assert (tmp_path / "o1" / step).read_text() == "my notes"
    # OUT is a step folder of another checkpoint (its root would not show the conversion).
    other = synth(tmp_path / "other", "tp=1,dp=1", seed=5)
    refused(next(p for p in other.iterdir() if p.is_dir()), "is a checkpoint's step folder")
    # OUT is a DeepSpeed root: its `latest` is what DeepSpeed's own load follows.
    ds = tmp_path / "ds"
    (ds / "global_step3").mkdir(parents=True)
    (ds / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ds / "latest").write_text("global_step3")
    refused(ds, "is a DeepSpeed checkpoint root")
    # A `latest` folder: the save could put the step in but not replace `latest`.
    (tmp_path / "o2" / "latest").mkdir(parents=True)
    refused(tmp_path / "o2", "latest is a folder")
    # The source root named through a folder that does not exist yet ("missing/.." resolves only
    # once it is created): still the source step itself, and "missing" is not created.
    refused(tmp_path / "missing" / ".." / "a", "is the source step folder itself", "--overwrite")
    assert not (tmp_path / "missing").exists()
    # Step names are checked before anything else (the same message with or without --overwrite).
    for extra in ((), ("--overwrite",)):
        refused(tmp_path / "o3", "step name '..' is not allowed", "--out-step", "..", *extra)


def mpirun(k, *args):
    return mpi_cli.mpirun(CLI, k, *args)


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_convert_under_mpirun_one_rank_per_target_rank(tmp_path):
    la, lb = "tp=2,pp=2,dp=1,zero=0", "tp=2,pp=1,dp=2,zero=1"
    a = synth(tmp_path / "a", la)
    r = mpirun(4, "convert", a, tmp_path / "b", "--target", lb)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 ranks under mpirun" in r.stdout
    r = mpirun(4, "convert", tmp_path / "b", tmp_path / "a2", "--target", la)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_bitwise_equal(a, tmp_path / "b")
    assert_bitwise_equal(a, tmp_path / "a2")
    assert_bitwise_equal(tmp_path / "b", synth(tmp_path / "sb", lb))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_convert_under_mpirun_wrong_rank_count_names_both(tmp_path):
    a = synth(tmp_path / "a", "tp=2,dp=1")
    r = mpirun(3, "convert", a, tmp_path / "b", "--target", "tp=2,dp=2,zero=1")
    assert r.returncode != 0
    assert "world size 4" in r.stderr and "3 ranks" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()
