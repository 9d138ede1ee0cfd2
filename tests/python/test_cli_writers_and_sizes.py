"""Writers of one checkpoint root run one at a time; model sizes beyond the declared limits and a
--model that contradicts a native checkpoint are refused by name, before anything is written."""
import fcntl
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))

pytestmark = pytest.mark.skipif(not CLI.exists(), reason="build/bin/reshard not built (run scripts/setup.sh)")


def run(*args, env=None, limit_bytes=None, timeout=180):
    def cap():
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, preexec_fn=cap)


def small_model(tmp_path, name="m", **over):
    fields = dict(name=name, num_layers=1, hidden=4, ffn=8, heads=4, vocab=10, vocab_divisible_by=1,
                  bias="true", norm="layernorm", param_dtype="bf16")
    fields.update(over)
    p = tmp_path / f"{name}.yaml"
    p.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    return p


def step_folders(root):
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))


# --- concurrent writers -------------------------------------------------------------------------

def test_concurrent_converts_into_one_root_each_leave_a_step_that_verifies(tmp_path):
    """Four converts into one new OUT at once used to leave `latest` naming a missing folder, or a
    step without its rank files, while some of them exited 0: each one's sweep of dead
    temporaries deleted another's half-written step. With the root's lock they run one at a
    time. Without --overwrite the first to commit step-5 wins and the others are refused by name
    (each checked that OUT/step-5 did not exist before it began, and checks again under the
    lock); with --overwrite every one replaces it in turn. Either way OUT verifies."""
    src = tmp_path / "src"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=2,dp=2,zero=1", "--seed", "4").returncode == 0
    for trial, overwrite in enumerate([False, False, True, True]):
        out = tmp_path / f"out{trial}"
        extra = ["--overwrite"] if overwrite else []
        procs = [subprocess.Popen([str(CLI), "convert", str(src), str(out), "--target", f"dp={i},zero=1", *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 2, 3, 4)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        for p in procs:
            p.stdout.close()
            p.stderr.close()
        rcs = [rc for rc, _ in results]
        if overwrite:
            assert rcs == [0, 0, 0, 0], results
        else:
            assert rcs.count(0) == 1 and rcs.count(2) == 3, results
            for rc, err in results:
                if rc:
                    assert ("was saved by another writer while this one ran" in err
                            or "already holds a checkpoint" in err), err
        v = run("verify", out, "--json")
        assert v.returncode == 0, (trial, v.stdout, v.stderr)
        assert json.loads(v.stdout)["ok"] is True
        latest = (out / "latest").read_text().strip()
        assert step_folders(out) == [latest] == ["step-5"]
        files = sorted(p.name for p in (out / latest).iterdir())
        meta = json.loads((out / latest / "metadata.json").read_text())
        assert files == sorted(["metadata.json"] + [f["name"] for f in meta["files"]]), files
        assert len(meta["files"]) in (1, 2, 3, 4)  # tp=1 (the target's default) at one of dp=1..4
        # No temporaries of any writer are left behind, and no lock file.
        assert [n for n in os.listdir(out) if n.startswith(".")] == []


def hold_lock(root):
    """Holds ROOT/.reshard-lock the way another process's writer does (a POSIX record lock
    conflicts with reshard's open-file-description lock); returns the open file."""
    os.makedirs(root, exist_ok=True)
    f = open(os.path.join(root, ".reshard-lock"), "r+" if os.path.exists(os.path.join(root, ".reshard-lock")) else "w+")
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write("pid 4242 on testhost: saving step step-9 to somewhere\n")
    f.flush()
    return f


def test_a_writer_that_cannot_get_the_lock_fails_by_name_and_writes_nothing(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=2,dp=1,zero=1").returncode == 0
    held = hold_lock(out)
    try:
        r = run("convert", src, out, "--target", "tp=1,dp=1,zero=1", env={"RESHARD_LOCK_TIMEOUT_S": "0.5"})
        assert r.returncode != 0, (r.stdout, r.stderr)
        assert "another writer holds" in r.stderr and ".reshard-lock" in r.stderr, r.stderr
        assert "pid 4242 on testhost" in r.stderr, r.stderr
        assert sorted(os.listdir(out)) == [".reshard-lock"]
        bad = run("convert", src, out, "--target", "tp=1", env={"RESHARD_LOCK_TIMEOUT_S": "soon"})
        assert bad.returncode != 0 and "RESHARD_LOCK_TIMEOUT_S='soon'" in bad.stderr, bad.stderr
    finally:
        held.close()
    # Released: the same convert goes through and waits for nobody.
    r = run("convert", src, out, "--target", "tp=1,dp=1,zero=1", env={"RESHARD_LOCK_TIMEOUT_S": "0.5"})
    assert r.returncode == 0, r.stderr
    assert run("verify", out).returncode == 0


def test_a_writer_waits_for_the_holder_instead_of_failing(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=2,dp=1,zero=1").returncode == 0
    held = hold_lock(out)
    threading.Timer(1.5, held.close).start()
    r = run("convert", src, out, "--target", "tp=1,dp=1,zero=1", env={"RESHARD_LOCK_TIMEOUT_S": "60"})
    assert r.returncode == 0, r.stderr
    assert run("verify", out).returncode == 0


def test_a_trainer_save_and_a_convert_into_one_root_both_land_whole(tmp_path):
    """reshard.save_all_ranks in this process while convert processes write the same root."""
    reshard = pytest.importorskip("reshard")
    src, out = tmp_path / "src", tmp_path / "out"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=1,dp=2,zero=1").returncode == 0
    c = reshard.open_checkpoint(str(src))
    L = c.layout
    from safetensors.torch import load_file
    sd = src / (src / "latest").read_text().strip()
    files = {r: load_file(str(sd / f"rank_{r:05d}.safetensors")) for r in range(L.world_size)}
    tensors = [files[b["rank"]][b["name"]].clone() for b in L.buffers]
    procs = [subprocess.Popen([str(CLI), "convert", str(src), str(out), "--target", f"dp={i},zero=1", "--out-step", f"conv-{i}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in (1, 4)]
    for k in range(3):
        reshard.save_all_ranks(str(out), f"step-{k}", L, tensors, state=dict(c.state))
    errs = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stderr.close()
    assert [rc for rc, _ in errs] == [0, 0], errs
    assert set(step_folders(out)) == {"conv-1", "conv-4", "step-0", "step-1", "step-2"}
    for s in step_folders(out):
        v = run("verify", out, "--step", s)
        assert v.returncode == 0, (s, v.stdout, v.stderr)


# --- model sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize("over,says", [
    # 2^62 rows x 4: the embedding's element count wrapped to 0 and plan printed 2520 bytes.
    (dict(vocab=2**62), "field vocab=4611686018427387904 exceeds the limit of 17592186044416"),
    # 2^63 - 1: the padded vocab itself overflowed.
    (dict(vocab=2**63 - 1), "field vocab=9223372036854775807 exceeds the limit"),
    (dict(vocab=2**40, hidden=1024, heads=8, ffn=4096), "the word embedding's elements (padded vocab x hidden) = "
     "1125899906842624 exceeds the limit of 17592186044416"),
    (dict(num_layers=100000), "num_layers = 100000 exceeds the limit of 16384"),
])
def test_model_sizes_beyond_the_limits_are_refused_before_plan_or_write(tmp_path, over, says):
    m = small_model(tmp_path, "huge", **over)
    p = run("plan", "--model", m, "--source", "tp=1", "--target", "tp=2", "--json")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert says in p.stderr and "model 'huge'" in p.stderr, p.stderr
    s = run("synth", tmp_path / "ck", "--model", m, "--layout", "tp=1", limit_bytes=4 << 30)
    assert s.returncode == 2, (s.stdout, s.stderr)
    assert says in s.stderr, s.stderr
    assert not (tmp_path / "ck").exists()


def test_a_plan_of_matrices_with_2_to_the_60_elements_is_refused_not_killed(tmp_path):
    """hidden = ffn = 2^30 allocated until the kernel killed plan (or bad_alloc under a limit)."""
    m = small_model(tmp_path, "h30", hidden=2**30, ffn=2**30, heads=1)
    r = run("plan", "--model", m, "--source", "tp=1", "--target", "tp=1,dp=2,zero=1", limit_bytes=3 << 30, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-400:])
    assert "bad_alloc" not in r.stderr
    assert "model 'h30'" in r.stderr and "a fused QKV weight's elements = 3458764513820540928" in r.stderr, r.stderr


def test_the_padded_vocab_at_the_target_tp_is_checked_too(tmp_path):
    """Within the limit at tp=1 (untied embedding and head of (2^41 - 2^31) x 4 rows: 2^44 - 2^34
    elements, plus a tiny layer); at tp=4 the vocab pads to a multiple of 2^30 x 4 = 2^32, i.e.
    2^41 rows, and the same model is over the limit, refused before planning."""
    edge = dict(vocab=2**41 - 2**31, hidden=4, heads=4, ffn=4, vocab_divisible_by=2**30, bias="false")
    m = small_model(tmp_path, "edge", **edge)
    r = run("plan", "--model", m, "--source", "tp=1", "--target", "tp=4", limit_bytes=3 << 30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "model 'edge' at tp=4" in r.stderr and "the model's parameters = " in r.stderr, r.stderr
    r = run("plan", "--model", m, "--source", "tp=4", "--target", "tp=1", limit_bytes=3 << 30)
    assert r.returncode == 2 and "model 'edge' at tp=4" in r.stderr, r.stderr


# --- --model against a native checkpoint --------------------------------------------------------

def test_convert_refuses_a_model_file_that_contradicts_a_native_checkpoint(tmp_path):
    m = small_model(tmp_path, "m")
    liar = small_model(tmp_path, "liar", hidden=8)
    src = tmp_path / "src"
    assert run("synth", src, "--model", m, "--layout", "tp=2,dp=2,zero=1").returncode == 0
    r = run("convert", src, tmp_path / "out", "--target", "dp=1", "--model", liar)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "disagrees with the model this checkpoint records" in r.stderr and "hidden 4 vs 8" in r.stderr, r.stderr
    assert str(liar) in r.stderr
    assert not (tmp_path / "out").exists()
    # Every reader of the source says the same (inspect, verify, plan from the checkpoint).
    for args in (("inspect", src, "--model", liar), ("verify", src, "--model", liar),
                 ("plan", src, "--model", liar, "--target", "tp=1")):
        rr = run(*args)
        assert rr.returncode == 2 and "hidden 4 vs 8" in rr.stderr, (args, rr.stdout, rr.stderr)
    swiglu = small_model(tmp_path, "sw", swiglu="true")
    r = run("convert", src, tmp_path / "out", "--target", "dp=1", "--model", swiglu)
    assert r.returncode == 2 and "swiglu false vs true" in r.stderr, r.stderr
    # The model it was saved with is accepted, by path and as given.
    r = run("convert", src, tmp_path / "out", "--target", "dp=1", "--model", m)
    assert r.returncode == 0, r.stderr
    out_meta = json.loads(next((tmp_path / "out").glob("*/metadata.json")).read_text())
    assert out_meta["model"]["hidden"] == 4
