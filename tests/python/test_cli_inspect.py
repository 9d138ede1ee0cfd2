"""reshard inspect: layout, tensors with canonical names and global shapes, files, and --stats
numbers checked against the safetensors files of a tp=1,pp=1,dp=1,zero=0 synth of the same seed."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
MODEL = ROOT / "configs" / "models" / "tiny-gpt.yaml"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} not built (run scripts/setup.sh)")


def run(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


def synth(out, layout, seed=11):
    r = run("synth", out, "--model", MODEL, "--layout", layout, "--seed", seed)
    assert r.returncode == 0, r.stderr
    return out


# tiny-gpt: H 64, F 128 (SwiGLU: 2F rows), 8 heads of 8 in 4 query groups, vocab 256.
def expected_shapes():
    s = {"embedding.word_embeddings.weight": [256, 64]}
    for i in range(4):
        p = f"layers.{i}."
        s.update({
            p + "input_layernorm.weight": [64], p + "input_layernorm.bias": [64],
            p + "self_attention.query_key_value.weight": [4 * (2 + 2) * 8, 64],
            p + "self_attention.query_key_value.bias": [128],
            p + "self_attention.dense.weight": [64, 64], p + "self_attention.dense.bias": [64],
            p + "post_attention_layernorm.weight": [64], p + "post_attention_layernorm.bias": [64],
            p + "mlp.dense_h_to_4h.weight": [256, 64], p + "mlp.dense_h_to_4h.bias": [256],
            p + "mlp.dense_4h_to_h.weight": [64, 128], p + "mlp.dense_4h_to_h.bias": [64],
        })
    s.update({"final_layernorm.weight": [64], "final_layernorm.bias": [64], "lm_head.weight": [256, 64]})
    return s


def test_inspect_json_of_synth(tmp_path):
    ck = synth(tmp_path / "ck", "tp=2,pp=2,dp=2,zero=1")
    r = run("inspect", ck, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["writer"] == "native"
    assert {k: j["topology"][k] for k in ("tp", "pp", "vpp", "dp", "zero")} == {"tp": 2, "pp": 2, "vpp": 1, "dp": 2, "zero": 1}
    assert j["topology"]["world_size"] == 8
    assert {t["name"]: t["shape"] for t in j["tensors"]} == expected_shapes()
    emb = next(t for t in j["tensors"] if t["name"] == "embedding.word_embeddings.weight")
    assert emb["dtype"] == "BF16" and sorted(emb["states"]) == ["exp_avg", "exp_avg_sq", "fp32", "weight"]
    assert len(j["files"]) == 8 and all(f.endswith(".safetensors") for f in j["files"])
    assert all(f["present"] and f["bytes"] > 0 for f in j["file_sizes"])
    assert j["file_bytes"] == sum(f["bytes"] for f in j["file_sizes"]) > j["state_bytes"] > 0
    assert j["problems"] == [] and j["iteration"] == 12 and j["step"] == 12
    # the text form names the layout and the tensors
    r = run("inspect", ck)
    assert r.returncode == 0 and "tp=2,pp=2,vpp=1,dp=2,zero=1" in r.stdout and "lm_head.weight" in r.stdout


def test_inspect_reports_missing_file(tmp_path):
    """A missing file is a problem found: listed, and exit 1 (as verify), text or JSON."""
    ck = synth(tmp_path / "ck", "tp=1,pp=1,dp=2,zero=2")
    (ck / "step-12" / "rank_00001.safetensors").unlink()
    text = run("inspect", ck)
    assert text.returncode == 1 and "problem: missing data file" in text.stdout, text.stdout + text.stderr
    r = run("inspect", ck, "--json")
    assert r.returncode == 1, r.stderr
    j = json.loads(r.stdout)
    assert [f["present"] for f in j["file_sizes"]] == [True, False]
    assert any("missing data file" in p and "rank_00001" in p for p in j["problems"])
    assert any("covered by no file" in p for p in j["problems"])


def reference_stats(tp1_checkpoint):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    files = st.load_file(str(tp1_checkpoint / "step-12" / "rank_00000.safetensors"))
    out = {}
    for key, v in files.items():
        state, name = key.split("/", 1)
        x = v.to(torch.float64)
        out[(name, state)] = {
            "mean": x.mean().item(), "std": x.std(unbiased=False).item(), "min": x.min().item(),
            "max": x.max().item(), "zero_fraction": (x == 0).double().mean().item(), "numel": x.numel(),
        }
    return out


@pytest.mark.parametrize("layout", ["tp=1,pp=1,dp=1,zero=0", "tp=2,pp=2,dp=2,zero=1", "tp=4,pp=1,dp=2,zero=3"])
def test_stats_match_numbers_from_the_files(tmp_path, layout):
    ref = reference_stats(synth(tmp_path / "tp1", "tp=1,pp=1,dp=1,zero=0"))
    ck = synth(tmp_path / "ck", layout)
    r = run("inspect", ck, "--json", "--stats")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    seen = 0
    for t in j["tensors"]:
        for state, s in t["stats"].items():
            want = ref[(t["name"], state)]
            assert s["numel"] == want["numel"]
            for k in ("mean", "std", "min", "max", "zero_fraction"):
                assert s[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (t["name"], state, k)
            seen += 1
    assert seen == len(ref) == 4 * len(expected_shapes())
    # inspect_json's own schema: top-level "stats" of the 16-bit weights
    assert j["stats"]["lm_head.weight"]["mean"] == pytest.approx(ref[("lm_head.weight", "weight")]["mean"], rel=1e-9)


def test_stats_show_a_zeroed_shard(tmp_path):
    """A checkpoint whose shards are partly zeros shows at a glance (zero_fraction)."""
    import struct
    ck = synth(tmp_path / "ck", "tp=2,pp=1,dp=1,zero=0")
    f = ck / "step-12" / "rank_00001.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    b, e = header["weight/lm_head.weight"]["data_offsets"]
    data[8 + n + b:8 + n + e] = bytes(e - b)
    f.write_bytes(bytes(data))
    j = json.loads(run("inspect", ck, "--json", "--stats").stdout)
    head = next(t for t in j["tensors"] if t["name"] == "lm_head.weight")
    assert head["stats"]["weight"]["zero_fraction"] == pytest.approx(0.5)
    assert head["stats"]["fp32"]["zero_fraction"] == 0
    # --stats reads every byte, so it checks the stored checksums too: statistics of corrupted
    # bytes look plausible, the problem list says they are corrupted (it used to show shifted
    # statistics with "problems: []").
    bad = [p for p in j["problems"] if p.startswith("checksum: ")]
    assert len(bad) == 1, j["problems"]
    assert "rank_00001.safetensors" in bad[0] and "weight/lm_head.weight" in bad[0] and "xxh3 mismatch" in bad[0], bad[0]
    clean = json.loads(run("inspect", synth(tmp_path / "clean", "tp=2,pp=1,dp=1,zero=0"), "--json", "--stats").stdout)
    assert not [p for p in clean["problems"] if p.startswith("checksum: ")], clean["problems"]


def test_stats_text_names_nan_and_inf(tmp_path):
    """NaN and Inf are left out of mean..max; the text output must still say they are there (it
    used to show finite statistics, and no word of them, for a checkpoint holding both)."""
    import torch
    import reshard
    src = synth(tmp_path / "src", "tp=1,pp=1,dp=1,zero=1")
    L = reshard.derive_layout(reshard.model_config(str(MODEL)), "tp=1,pp=1,dp=1,zero=1")
    live = reshard.allocate(L, 0)
    reshard.load(str(src), L, live)
    fp32 = next(k for k in live if k.startswith("fp32/"))
    avg = next(k for k in live if k.startswith("exp_avg/"))
    live[fp32].view(-1)[5] = float("nan")
    live[avg].view(-1)[7] = float("inf")
    reshard.save(str(tmp_path / "bad"), "step-1", L, live)
    text = run("inspect", tmp_path / "bad", "--stats")
    assert text.returncode == 0, text.stderr
    flagged = [l for l in text.stdout.splitlines() if "NON-FINITE 1" in l]
    assert len(flagged) == 2, text.stdout
    assert {l.split()[0] for l in flagged} == {"fp32", "exp_avg"}, flagged
    j = json.loads(run("inspect", tmp_path / "bad", "--json", "--stats").stdout)
    counts = sorted(s.get("non_finite", 0) for t in j["tensors"] for s in t["stats"].values())
    assert counts[-2:] == [1, 1] and sum(counts) == 2, counts
    # A state with no finite element: no made-up statistics.
    live[fp32].fill_(float("nan"))
    reshard.save(str(tmp_path / "nan"), "step-1", L, live)
    text = run("inspect", tmp_path / "nan", "--stats")
    line = next(l for l in text.stdout.splitlines() if l.split()[:1] == ["fp32"] and "NON-FINITE" in l)
    assert "mean -" in line and "max -" in line, line
    j = json.loads(run("inspect", tmp_path / "nan", "--json", "--stats").stdout)
    allnan = [s for t in j["tensors"] for k, s in t["stats"].items() if k == "fp32" and s.get("non_finite") == s["numel"]]
    assert allnan and all(s["mean"] is None and s["max"] is None for s in allnan), allnan[:1]
