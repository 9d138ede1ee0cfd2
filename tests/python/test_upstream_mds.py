"""Checkpoints written by upstream Megatron-DeepSpeed's own trainer (tests/data/upstream_mds,
made by tests/fixtures/upstream_mds/make_upstream_checkpoints.sh): its fused QKV rows are
re-cut by the order its code wrote them in, [Q | K | V] blocks per tp rank at and after its
FPDT change (args has ds_sequence_parallel_fpdt), [groups, heads/groups + 2, hn] before, both
under checkpoint_version 3.0. Each expected value is computed here from the files themselves,
independently of reshard's planner."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the reference trainer (integration/); reshard is the installed package
CLI = os.path.join(REPO, "build", "bin", "reshard")
DATA = os.path.join(REPO, "tests", "data", "upstream_mds")
if not os.path.exists(CLI):
    pytest.skip("build/bin/reshard not built", allow_module_level=True)
from safetensors.torch import load_file  # noqa: E402

QKV = "self_attention.query_key_value"


def source_rows(case, layer, what):
    """Per tp rank, the fused QKV rows of transformer layer `layer` as upstream saved them
    (layer_NN files: NN = layer + 2 in GPTModelPipe; test code, reading the suite's own data)."""
    step = open(os.path.join(DATA, case, "latest")).read().strip()
    out = []
    for t in range(2):
        p = os.path.join(DATA, case, step, f"layer_{layer + 2:02d}-model_{t:02d}-model_states.pt")
        out.append(torch.load(p, map_location="cpu", weights_only=False)[f"{QKV}.{what}"].float())
    return out


def logical(rows, order, heads, groups):
    """[groups, heads/groups + 2, hn, ...] from each tp rank's rows in `order`."""
    q = heads // groups
    parts = []
    for r in rows:
        npg = groups // len(rows)
        hn = r.shape[0] // (npg * (q + 2))
        rest = r.shape[1:]
        if order == "interleaved":
            parts.append(r.reshape(npg, q + 2, hn, *rest))
        else:
            qb, kb = npg * q * hn, npg * hn
            Q = r[:qb].reshape(npg, q, hn, *rest)
            K = r[qb:qb + kb].reshape(npg, 1, hn, *rest)
            V = r[qb + kb:].reshape(npg, 1, hn, *rest)
            parts.append(torch.cat([Q, K, V], dim=1))
    return torch.cat(parts, dim=0)


def rank_rows(L, order, tp, u):
    """Target tp rank u's rows of the logical QKV tensor in `order`."""
    groups, q2 = L.shape[0], L.shape[1]
    sel = L[u * groups // tp:(u + 1) * groups // tp]
    rest = L.shape[3:]
    if order == "interleaved":
        return sel.reshape(-1, *rest)
    return torch.cat([sel[:, :q2 - 2].reshape(-1, *rest), sel[:, q2 - 2].reshape(-1, *rest),
                      sel[:, q2 - 1].reshape(-1, *rest)])


def convert(case, out, tp, order=None):
    cmd = [CLI, "convert", os.path.join(DATA, case), str(out), "--target", f"tp={tp},pp=1,dp=1,zero=1"]
    if order:
        cmd += ["--target-qkv-order", order]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    step = open(os.path.join(out, "latest")).read().strip()
    meta = json.load(open(os.path.join(out, step, "metadata.json")))
    return [load_file(os.path.join(out, step, f"rank_{u:05d}.safetensors")) for u in range(tp)], meta, r.stdout


CASES = [  # case, source order, heads, query groups, target tp values
    ("head_tp2pp2_fp32", "blocked", 4, 4, (1, 4)),
    ("head_tp2pp2_bf16", "blocked", 4, 4, (1,)),
    ("pre_fpdt_tp2pp2_fp32", "interleaved", 4, 4, (1, 4)),
    ("pre_fpdt_gqa_tp2pp2_fp32", "interleaved", 4, 2, (1,)),
]


@pytest.mark.parametrize("case,order,heads,groups,tps", CASES, ids=[c[0] for c in CASES])
def test_upstream_qkv_is_recut_by_the_writers_order(tmp_path, case, order, heads, groups, tps):
    if not os.path.isdir(os.path.join(DATA, case)):
        pytest.skip(f"{case} not in tests/data/upstream_mds")
    r = subprocess.run([CLI, "inspect", os.path.join(DATA, case)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"QKV rows: {'[Q | K | V] blocks' if order == 'blocked' else 'interleaved'}" in r.stdout
    for tp in tps:
        for target in (None, "interleaved", "blocked"):
            if tp > 1 and target:
                continue
            files, meta, _ = convert(case, tmp_path / f"t{tp}-{target}", tp, target)
            want_order = target or order
            assert meta["model"]["qkv_order"] == want_order
            for layer in range(4):
                for what in ("weight", "bias") if case != "pre_fpdt_gqa_tp2pp2_fp32" else ("weight",):
                    L = logical(source_rows(case, layer, what), order, heads, groups)
                    for u in range(tp):
                        got = files[u][f"weight/layers.{layer}.{QKV}.{what}"].float()
                        want = rank_rows(L, want_order, tp, u).reshape(-1)
                        assert torch.equal(got, want), (case, tp, target, layer, what, u)
    # A wrong order would differ: with more than one group per rank the blocked and interleaved
    # readings of the same rows are not equal (with one group per rank they coincide).
    rows = source_rows(case, 0, "weight")
    if groups // 2 > 1:
        assert not torch.equal(logical(rows, "blocked", heads, groups), logical(rows, "interleaved", heads, groups))


def test_upstream_other_tensors_merge_as_concatenation(tmp_path):
    """The row-parallel attention output and column-parallel MLP weights of the head checkpoint
    merge at tp 2->1 as plain concatenation along their split dim (bitwise)."""
    case = "head_tp2pp2_fp32"
    files, _, _ = convert(case, tmp_path / "t1", 1)
    step = open(os.path.join(DATA, case, "latest")).read().strip()
    for layer in range(4):
        src = [torch.load(os.path.join(DATA, case, step, f"layer_{layer + 2:02d}-model_{t:02d}-model_states.pt"),
                          map_location="cpu", weights_only=False) for t in range(2)]
        for name, dim in (("self_attention.dense.weight", 1), ("mlp.dense_h_to_4h.weight", 0),
                          ("mlp.dense_4h_to_h.weight", 1), ("input_layernorm.weight", None)):
            want = src[0][name] if dim is None else torch.cat([s[name] for s in src], dim=dim)
            got = files[0][f"weight/layers.{layer}.{name}"]
            assert torch.equal(got, want.reshape(-1)), (layer, name)


def test_unknown_qkv_order_refuses_a_recut_and_copies_at_the_same_tp(tmp_path):
    """A native checkpoint whose writer could not tell the QKV order (qkv_order: unknown) loads at
    the same tp and order, and a tp change is refused by name before anything is written."""
    import reshard
    m = {"name": "u", "num_layers": 1, "hidden": 16, "ffn": 32, "heads": 4, "query_groups": 4, "vocab": 32,
         "vocab_divisible_by": 8, "max_position_embeddings": 0, "swiglu": False, "tied_embeddings": True,
         "bias": True, "norm": "layernorm", "param_dtype": "f32", "qkv_version": 3.0, "qkv_order": "unknown"}
    src = tmp_path / "src"
    reshard.synth_checkpoint(str(src), m, "tp=2,pp=1,dp=1,zero=1", 5)
    r = subprocess.run([CLI, "convert", str(src), str(tmp_path / "o1"), "--target", "tp=1,pp=1,dp=1,zero=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "qkv_order" in r.stderr and "query_key_value" in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "o1" / "latest")
    r = subprocess.run([CLI, "convert", str(src), str(tmp_path / "o2"), "--target", "tp=2,pp=1,dp=2,zero=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_vocab_padding_growth_warns_and_the_named_divisor_keeps_the_rows(tmp_path):
    """Upstream's vocab-parallel cross entropy normalises over every padded row, so rows a tp change
    adds (or drops) change the loss. vocab 128 with --make-vocab-size-divisible-by 64 is 128 rows at
    tp 2 and 256 at tp 4: convert warns with the count and the divisor that keeps 128 rows, refuses
    under --vocab-padding refuse, and with that divisor writes the source's rows bitwise."""
    case = "head_tp2pp2_fp32"
    src, target = os.path.join(DATA, case), "tp=4,pp=1,dp=1,zero=1"
    r = subprocess.run([CLI, "convert", src, str(tmp_path / "grow"), "--target", target],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("reshard: warning: vocab padding: the source pads vocab 128 to 128 rows, the target to 256 "
            "(vocab_divisible_by 64 x tp 4): 128 padding row(s) of embedding.word_embeddings.weight added as zeros"
            in r.stderr), r.stderr[-2000:]
    assert "--make-vocab-size-divisible-by 32) at tp 4 keeps the 128 rows" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([CLI, "plan", src, "--target", target, "--vocab-padding", "refuse"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "refused: policy vocab_padding=refuse" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([CLI, "convert", src, str(tmp_path / "refused"), "--target", target, "--vocab-padding", "refuse"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "refused: policy vocab_padding=refuse" in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "refused" / "latest")
    out = tmp_path / "kept"
    r = subprocess.run([CLI, "convert", src, str(out), "--target", target, "--target-vocab-divisible-by", "32",
                        "--vocab-padding", "refuse"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-2000:]
    step = open(os.path.join(DATA, case, "latest")).read().strip()
    emb = torch.cat([torch.load(os.path.join(src, step, f"layer_01-model_{t:02d}-model_states.pt"), map_location="cpu",
                                weights_only=False)["word_embeddings.weight"] for t in range(2)])
    assert emb.shape[0] == 128
    ostep = open(os.path.join(out, "latest")).read().strip()
    got = torch.cat([load_file(os.path.join(out, ostep, f"rank_{u:05d}.safetensors"))["weight/embedding.word_embeddings.weight"]
                     .view(32, -1) for u in range(4)])
    assert torch.equal(got, emb)
