"""reshard verify, and convert's checks of its input: a flipped byte, a truncated and a deleted rank
file are reported by name (file, tensor, byte range; missing files and uncovered element ranges),
verify exits 1 and convert exits 2 before anything is written to OUT; bad paths exit 2."""
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
MODEL = ROOT / "configs" / "models" / "tiny-gpt.yaml"
LAYOUT = "tp=2,pp=1,dp=2,zero=1"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} not built (run scripts/setup.sh)")


def run(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def ckpt(tmp_path):
    r = run("synth", tmp_path / "ck", "--model", MODEL, "--layout", LAYOUT, "--seed", 3)
    assert r.returncode == 0, r.stderr
    return tmp_path / "ck"


def step_dir(ck):
    return ck / (ck / "latest").read_text().strip()


def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("reshard: error:"), lines[0]
    return lines[0]


def test_sound_checkpoint_verifies(ckpt):
    r = run("verify", ckpt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    j = json.loads(run("verify", ckpt, "--json").stdout)
    assert j["ok"] and j["problems"] == [] and j["uncovered"] == []


def test_flipped_byte(ckpt, tmp_path):
    f = step_dir(ckpt) / "rank_00001.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    b, e = header["weight/layers.0.mlp.dense_h_to_4h.weight"]["data_offsets"]
    pos = 8 + n + b + (e - b) // 2
    data[pos] ^= 0x40
    f.write_bytes(bytes(data))

    r = run("verify", ckpt)
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [l for l in r.stdout.splitlines() if l.startswith("problem:")]
    assert len(bad) == 1, r.stdout
    assert "rank_00001.safetensors" in bad[0] and "tensor " in bad[0] and "bytes [" in bad[0], bad[0]
    lo, hi = map(int, bad[0].split("bytes [")[1].split(")")[0].split(", "))
    assert lo <= pos < hi, (lo, pos, hi)

    out = tmp_path / "out"
    r = run("convert", ckpt, out, "--target", "tp=1,pp=1,dp=1,zero=0")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert "rank_00001.safetensors" in line and f"bytes [{lo}, {hi})" in line and "xxh3 mismatch" in line, line
    assert not out.exists()
    # an OUT that already holds a checkpoint gets no new step
    r = run("synth", out, "--model", MODEL, "--layout", "tp=1", "--seed", 9, "--out-step", "old")
    assert r.returncode == 0
    r = run("convert", ckpt, out, "--target", "tp=1,pp=1,dp=1,zero=0")
    assert r.returncode == 2
    assert sorted(p.name for p in out.iterdir()) == ["latest", "old"]


def test_deleted_rank_file(ckpt, tmp_path):
    f = step_dir(ckpt) / "rank_00002.safetensors"
    f.unlink()
    r = run("verify", ckpt)
    assert r.returncode == 1, r.stdout + r.stderr
    missing = [l for l in r.stdout.splitlines() if l.startswith("missing:")]
    assert len(missing) == 1 and str(f) in missing[0], r.stdout
    uncovered = [l for l in r.stdout.splitlines() if l.startswith("uncovered:")]
    assert uncovered, r.stdout
    # rank 2 = tp rank 0 of dp rank 1: its half of the fp32 partition; the 16-bit weights live on dp rank 0
    assert all("(weight)" not in l for l in uncovered)
    assert any("(fp32): elements [" in l for l in uncovered), uncovered
    assert any("(exp_avg_sq): elements [" in l for l in uncovered), uncovered

    out = tmp_path / "out"
    r = run("convert", ckpt, out, "--target", "tp=1,pp=1,dp=2,zero=1")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert f"missing data file(s): {f};" in line and "uncovered: tensor " in line and "elements [" in line, line
    assert not out.exists()


def test_truncated_rank_file(ckpt, tmp_path):
    f = step_dir(ckpt) / "rank_00003.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    r = run("verify", ckpt)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rank_00003.safetensors" in r.stdout and "truncated" in r.stdout, r.stdout
    r = run("convert", ckpt, tmp_path / "out", "--target", "tp=1")
    assert r.returncode == 2 and "rank_00003.safetensors" in one_line_error(r)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["nonexistent", "file", "empty"])
@pytest.mark.parametrize("cmd", ["verify", "inspect", "convert"])
def test_bad_path_exit_2_one_line(tmp_path, which, cmd):
    bad = {"nonexistent": tmp_path / "nope", "file": tmp_path / "f.txt", "empty": tmp_path / "empty"}[which]
    if which == "file":
        bad.write_text("not a checkpoint")
    if which == "empty":
        bad.mkdir()
    args = [cmd, bad] + (["out", "--target", "tp=1"] if cmd == "convert" else [])
    r = run(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(bad) in one_line_error(r)


def as_written_before_the_identity_record(step):
    """Turns a native step into the form older versions of reshard wrote: no "save" in
    metadata.json, only "format" in each data file's __metadata__ (the record blanked with spaces,
    which JSON allows, so no offset moves). Such a checkpoint's metadata.json can be edited to
    make cases the open would otherwise refuse as an edit (layout digest)."""
    import re
    meta = step / "metadata.json"
    d = json.loads(meta.read_text())
    d.pop("save", None)
    meta.write_text(json.dumps(d))
    for f in step.glob("rank_*.safetensors"):
        data = bytearray(f.read_bytes())
        m = re.search(rb',"layout":"[0-9a-f]{16}","rank":"\d+","save":"[0-9a-f]{16}"', bytes(data[:4096]))
        assert m, f
        data[m.start():m.end()] = b" " * (m.end() - m.start())
        f.write_bytes(bytes(data))


def test_partial_sum_tensor_at_tp2_verifies_and_gaps_are_found(tmp_path):
    """A model whose rule declares a partial_sum tensor: verify used to plan to tp=1, which would
    have to sum the tp ranks' partial values (not implemented), and exited 2 without checking a
    checksum. It checks coverage at the stored tp now."""
    import collections
    model = tmp_path / "m.yaml"
    model.write_text(MODEL.read_text() + "rules:\n"
                     "  - {pattern: 'layers\\.\\d+\\.mlp\\.dense_4h_to_h\\.bias', split: replicated, reduction: partial_sum}\n")
    ck = tmp_path / "ps"
    r = run("synth", ck, "--model", model, "--layout", "tp=2,dp=2,zero=1", "--seed", 4)
    assert r.returncode == 0, r.stderr
    r = run("verify", ck)
    assert r.returncode == 0 and "OK:" in r.stdout, r.stdout + r.stderr
    meta = step_dir(ck) / "metadata.json"
    as_written_before_the_identity_record(step_dir(ck))  # else the edit below is refused as such
    d = json.loads(meta.read_text())
    key = lambda p: (p["array"], tuple(p["off"]), tuple(p["len"]))
    count = collections.Counter(key(p) for p in d["pieces"])
    drop = next(i for i, p in enumerate(d["pieces"]) if count[key(p)] == 1 and d["arrays"][p["array"]]["state"] == "fp32")
    tensor = d["arrays"][d["pieces"][drop]["array"]]["tensor"]
    d["pieces"] = [p for i, p in enumerate(d["pieces"]) if i != drop]
    meta.write_text(json.dumps(d))
    r = run("verify", ck)
    assert r.returncode == 1 and f"uncovered: tensor {tensor} (fp32)" in r.stdout, r.stdout + r.stderr
