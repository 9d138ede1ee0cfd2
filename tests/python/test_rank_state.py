"""A checkpoint is data: per-rank state in reshard.rank_state's typed encoding round-trips every
generator exactly; a pickled per-rank blob is never unpickled (by reshard.load, the trainer
hook, inspect, verify or convert); a damaged or oversized typed blob is refused by name on its
rank before any tensor is written; no product code turns checkpoint bytes into code."""

import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the reference trainer (integration/); reshard is the installed package
reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")
R = reshard.rank_state

TINY = {"name": "tiny-f32", "num_layers": 2, "hidden": 16, "ffn": 32, "heads": 4, "query_groups": 2, "vocab": 60,
        "vocab_divisible_by": 8, "max_position_embeddings": 8, "swiglu": True, "tied_embeddings": True, "bias": True,
        "norm": "layernorm", "param_dtype": "f32", "qkv_version": 3.0}
TOPO = "tp=1,pp=1,dp=1,zero=1"
CLI = os.path.join(REPO, "build", "bin", "reshard")


def draws():
    """The next values of every generator a trainer uses (python random incl. gauss's cached
    value, numpy's legacy generator incl. its cached gaussian, torch's CPU generator)."""
    return ([random.random() for _ in range(3)] + [random.gauss(0, 1) for _ in range(3)],
            np.random.standard_normal(5).tolist() + np.random.randint(0, 1 << 30, 3).tolist(),
            torch.randn(7).tolist() + torch.randint(0, 1 << 30, (3,)).tolist())


def scramble():
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def test_capture_restore_continues_every_generator():
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    random.gauss(0, 1)  # leaves python's second gaussian cached (gauss_next)
    np.random.standard_normal()  # and numpy's (has_gauss = 1)
    blob = R.capture(extra={"sampler": {"epoch": 2, "offset": 4096}})
    assert R.kind(blob) == "typed" and blob.startswith(R.MAGIC)
    doc = json.loads(blob)
    assert doc["python_random"]["gauss_next"] is not None and doc["numpy"]["has_gauss"] == 1
    uninterrupted = draws()
    scramble()
    assert draws() != uninterrupted
    state = R.decode(blob, rank=3)
    assert state.extra == {"sampler": {"epoch": 2, "offset": 4096}}
    assert "python, numpy and torch CPU generators" in R.restore(state)
    assert draws() == uninterrupted


def synth_with_state(tmp_path, per_rank, topo=TOPO, name="ck"):
    """A native checkpoint written through reshard's own writer (valid checksums) with the
    given per-rank blobs; returns (root, the tensors saved, layout)."""
    from safetensors.torch import load_file
    m = reshard.model_config(TINY)
    src = tmp_path / f"{name}-synth"
    reshard.synth_checkpoint(str(src), m, topo, 3)
    step_dir = reshard.inspect(str(src))["path"]
    c = reshard.open_checkpoint(str(src))
    L = c.layout
    files = {r: load_file(os.path.join(step_dir, f"rank_{r:05d}.safetensors")) for r in range(L.world_size)}
    tensors = [files[b["rank"]][b["name"]].clone() for b in L.buffers]
    st = dict(c.state)
    st["per_rank"] = per_rank
    root = tmp_path / name
    reshard.save_all_ranks(str(root), "step-7", L, tensors, state=st)
    return str(root), tensors, L


def test_typed_blob_round_trips_through_save_and_load(tmp_path):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    blob = R.capture(extra={"consumed_in_epoch": 17})
    uninterrupted = draws()
    root, saved, L = synth_with_state(tmp_path, {0: blob})
    out = reshard.allocate(L, 0, fill=float("nan"))
    scramble()
    report = reshard.load(root, L, out)
    assert report["state"]["per_rank"] == {0: blob}
    assert R.restore_or_reseed(report["state"]["per_rank"].get(0), 1, 7, 0).startswith("restored (identical layout)")
    assert draws() == uninterrupted


class _Payload:
    """Unpickling this runs a shell command that creates MARKER (what a hostile checkpoint does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


@pytest.fixture
def pickled(tmp_path):
    marker = str(tmp_path / "MARKER")
    blob = pickle.dumps(_Payload(marker))
    assert R.kind(blob) == "pickle"
    root, saved, L = synth_with_state(tmp_path, {0: blob})
    return root, saved, L, marker, blob


def test_pickled_rank_state_is_never_unpickled_by_load(pickled):
    root, saved, L, marker, blob = pickled
    c = reshard.open_checkpoint(root)
    assert c.state["per_rank"][0] == blob  # bytes, handed over as data by open
    reshard.inspect(root)
    out = reshard.allocate(L, 0, fill=float("nan"))
    report = reshard.load(root, L, out)
    assert not os.path.exists(marker)
    for b, want in zip(L.buffers, saved):
        assert torch.equal(out[b["name"]], want), b["name"]
    assert 0 not in report["state"]["per_rank"]
    assert any("pickled blobs" in s and "never unpickled" in s for s in report["not_carried"]), report["not_carried"]
    how = R.restore_or_reseed(report["state"]["per_rank"].get(0), 1234, 7, 0)
    assert how.startswith("reseeded deterministically"), how
    # Even handed the pickle itself, restore_or_reseed reads none of it.
    how = R.restore_or_reseed(blob, 1234, 7, 0)
    assert "never unpickled" in how and not os.path.exists(marker)
    s = R.reseed(1234, 7, 0)
    first = draws()
    R.restore_or_reseed(blob, 1234, 7, 0)
    assert draws() == first and s == (1234 * 1_000_003 + 7 * 7919) % (2**31 - 1)


@pytest.mark.skipif(not os.path.exists(CLI), reason="build/bin/reshard not built")
def test_pickled_rank_state_is_never_unpickled_by_the_cli(pickled, tmp_path):
    root, _, _, marker, _ = pickled
    for args in (["inspect", root], ["verify", root], ["convert", root, str(tmp_path / "out"), "--target", TOPO]):
        r = subprocess.run([CLI] + args, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    assert not os.path.exists(marker)


def damaged_blobs():
    good = json.loads(R.capture())
    out = {}

    def edit(name, fn):
        d = json.loads(json.dumps(good))
        fn(d)
        out[name] = (json.dumps(d, separators=(",", ":")).encode(), "")

    out["truncated"] = (R.capture()[:-40], "not UTF-8 JSON")
    out["oversized"] = (R.MAGIC + b" " * R.MAX_BYTES, "more than the limit")
    edit("numpy.key", lambda d: d["numpy"]["key"].pop())
    edit("python_random.state", lambda d: d["python_random"]["state"].__setitem__(5, 1 << 32))
    edit("torch_cpu", lambda d: d.__setitem__("torch_cpu", d["torch_cpu"][:-8]))
    edit("unknown field", lambda d: d.__setitem__("code", "os.system"))
    edit("numpy.pos", lambda d: d["numpy"].__setitem__("pos", -1))
    edit("version", lambda d: d.__setitem__("version", 2))
    return out


@pytest.mark.parametrize("case", sorted(damaged_blobs()))
def test_damaged_typed_blob_is_refused_before_any_write(tmp_path, case):
    blob, _ = damaged_blobs()[case]
    assert R.kind(blob) == "typed"
    root, _, L = synth_with_state(tmp_path, {0: blob})
    out = reshard.allocate(L, 0, fill=float("nan"))
    want = reshard.Unsupported if case == "version" else reshard.DataLoss
    with pytest.raises(want) as e:
        reshard.load(root, L, out)
    msg = str(e.value)
    assert "[rank 0]" in msg and "per-rank state" in msg, msg
    field = {"oversized": "more than the limit", "truncated": "not UTF-8 JSON", "unknown field": "'code'",
             "version": "version 2"}.get(case, case)
    assert field in msg, msg
    for name, t in out.items():
        assert torch.isnan(t).all(), f"{name} was written"
    with pytest.raises(want):
        R.decode(blob, rank=0)


def test_damaged_blob_is_not_an_error_when_the_layout_changes(tmp_path):
    """Per-rank state is not carried across a layout change, so its blobs are not read."""
    bad = R.capture()[:-40]
    root, saved, _ = synth_with_state(tmp_path, {0: bad, 1: bad}, topo="tp=2,pp=1,dp=1,zero=1")
    target = reshard.derive_layout(TINY, TOPO)
    out = reshard.allocate(target, 0, fill=float("nan"))
    report = reshard.load(root, target, out)
    assert report["state"]["per_rank"] == {}
    assert any("layout changed" in s for s in report["not_carried"])
    assert not any(torch.isnan(t).any() for t in out.values())


# Product code (python/, integration/, csrc/) never turns checkpoint bytes into code. Tools that
# read files the test suite itself just wrote may; each is named in docs/reliability.md.
_UNSAFE = re.compile(r"pickle\.loads?\(|weights_only=False|yaml\.load\(")
_TEST_TOOLS = {"integration/megatron_deepspeed/make_checkpoints.py", "integration/megatron_deepspeed/state_dump.py"}


def test_no_product_code_turns_checkpoint_bytes_into_code():
    found = set()
    for top in ("python", "integration", "csrc"):
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith((".py", ".cc", ".h", ".cu")):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8", errors="replace") as fh:
                        if _UNSAFE.search(fh.read()):
                            found.add(os.path.relpath(p, REPO))
    assert found <= _TEST_TOOLS, sorted(found - _TEST_TOOLS)
    with open(os.path.join(REPO, "docs", "reliability.md")) as fh:
        doc = fh.read()
    for t in _TEST_TOOLS:
        assert t in doc, f"docs/reliability.md does not name the test tool {t}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_trainer_hook_restores_typed_state_and_never_unpickles(tmp_path):
    """The reference trainer (real DeepSpeed, PipelineEngine, ZeRO-1, 2 ranks) saves natively at
    iteration 2 and trains on to 3. Resuming at the identical layout restores every rank's
    generators from the typed blobs; the same save re-written with pickled per-rank blobs that
    would create a marker resumes with every tensor loaded, no marker, and a reseed the report
    names. Both resumed runs' iteration 3 loss equals the uninterrupted run's."""
    pytest.importorskip("deepspeed")
    from integration.megatron_deepspeed.launch import mpirun_module
    model = ["--layers", "2", "--hidden", "32", "--heads", "4", "--ffn", "64", "--seq-length", "16",
             "--micro-batch", "2", "--global-batch", "4", "--quiet"]

    def run(module, extra, name):
        log = str(tmp_path / f"{name}.json")
        r, cmd = mpirun_module(module, 1, 1, 2, model + ["--log-json", log] + extra, 400)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        with open(log) as f:
            return {s["step"]: s["loss"] for s in json.load(f)["steps"]}

    native = str(tmp_path / "native")
    base = run("train_reshard", ["--save-native", native, "--no-deepspeed-save", "--save", str(tmp_path / "ds"),
                                 "--save-interval", "2", "--steps", "3"], "base")
    c = reshard.open_checkpoint(native, step="step-2")
    assert sorted(c.state["per_rank"]) == [0, 1]
    assert all(R.kind(b) == "typed" for b in c.state["per_rank"].values())

    def resume(root, name):
        rpt = str(tmp_path / f"{name}-report.json")
        losses = run("train", ["--load", root, "--load-with", "reshard", "--load-step", "step-2", "--reshard-report",
                               rpt, "--steps", "3"], name)
        with open(rpt) as f:
            return losses, json.load(f)

    losses, rep = resume(native, "typed")
    assert rep["rng"].startswith("restored (identical layout): python, numpy and torch"), rep["rng"]
    assert losses[3] == base[3], (losses, base)

    from safetensors.torch import load_file
    marker = str(tmp_path / "MARKER")
    L = c.layout
    files = {r: load_file(os.path.join(c.path, f"rank_{r:05d}.safetensors")) for r in range(L.world_size)}
    tensors = [files[b["rank"]][b["name"]].clone() for b in L.buffers]
    st = dict(c.state)
    st["per_rank"] = {r: pickle.dumps(_Payload(marker)) for r in range(L.world_size)}
    hostile = str(tmp_path / "hostile")
    reshard.save_all_ranks(hostile, "step-2", L, tensors, state=st)
    losses, rep = resume(hostile, "pickled")
    assert not os.path.exists(marker)
    assert "never unpickled" in rep["rng"] and "reseeded deterministically" in rep["rng"], rep["rng"]
    assert any("pickled blobs" in s for s in rep["not_carried"]), rep["not_carried"]
    assert rep["bit16_check"].startswith("module weights equal the fp32 master"), rep["bit16_check"]
    assert losses[3] == base[3], (losses, base)


@pytest.mark.parametrize("what", ["fifo", "device"])
def test_rank_file_that_is_a_fifo_or_a_device_is_refused_by_name(tmp_path, what):
    """A hostile checkpoint cannot make a load wait forever (a FIFO) or read without end (a link to
    /dev/zero): the rank file is refused by name when the load opens it."""
    root, _, L = synth_with_state(tmp_path, {})
    f = os.path.join(reshard.inspect(root)["path"], "rank_00000.safetensors")
    os.unlink(f)
    if what == "fifo":
        os.mkfifo(f)
    else:
        os.symlink("/dev/zero", f)
    code = ("import sys, reshard; L = reshard.open_checkpoint(sys.argv[1]).layout; "
            "reshard.load(sys.argv[1], L, reshard.allocate(L, 0))")
    r = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "DataLoss" in r.stderr and f in r.stderr, r.stderr[-2000:]
