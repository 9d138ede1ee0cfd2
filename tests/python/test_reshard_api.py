"""reshard's Python API in one process (fast): errors, inspect, plan, load, save, strictness,
replica policies (failures.md B10), resume configs, and the torch.distributed communicator under
gloo (a small mpirun job)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO, "build", "bin", "reshard")
reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")

_DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

TINY = {"name": "tiny-f32", "num_layers": 2, "hidden": 16, "ffn": 32, "heads": 4, "query_groups": 2, "vocab": 60,
        "vocab_divisible_by": 8, "max_position_embeddings": 8, "swiglu": True, "tied_embeddings": True, "bias": True,
        "norm": "layernorm", "param_dtype": "f32", "qkv_version": 3.0}


def zeros_for(layout, rank=0, fill=None):
    g = torch.Generator().manual_seed(1 + rank)
    out = {}
    for b in layout.buffers:
        if b["rank"] == rank:
            t = torch.empty(b["numel"], dtype=_DT[b["dtype"]])
            if fill is None:
                t.copy_(torch.randn(b["numel"], generator=g))
            else:
                t.fill_(fill)
            out[b["name"]] = t
    return out


def test_error_classes():
    for name in ("InvalidArgument", "NotFound", "DataLoss", "Unsupported", "FailedPrecondition", "Internal"):
        cls = getattr(reshard, name)
        assert issubclass(cls, reshard.Error)
        assert cls.code == name
    with pytest.raises(reshard.NotFound, match="/no/such/ckpt"):
        reshard.inspect("/no/such/ckpt")
    with pytest.raises(reshard.InvalidArgument, match="bogus"):
        reshard.parse_topology("tp=2,bogus=3")
    with pytest.raises(reshard.InvalidArgument, match="unknown field"):
        reshard.model_config({**TINY, "hiden": 3})


def test_inspect_plan_load_roundtrip(tmp_path):
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=2,dp=2,zero=1", 5)
    info = reshard.inspect(str(tmp_path))
    assert info["writer"] == "native" and info["topology"]["tp"] == 2 and info["topology"]["world_size"] == 8
    assert info["state"]["step"] >= 1 and len(info["state"]["per_rank"]) == 8
    names = {t["name"] for t in info["tensors"]}
    assert "layers.1.mlp.dense_h_to_4h.weight" in names and "lm_head.weight" not in names
    p = reshard.plan(str(tmp_path), "tp=1,pp=1,dp=1,zero=1")
    assert p["target_world_size"] == 1 and p["bytes_to_read"] == p["bytes_needed"] > 0
    assert p["change"].startswith("tp 2->1")
    # One target rank: it holds the whole target and reads every byte the plan reads.
    assert p["live_bytes_total"] == p["live_bytes_per_rank_max"] == p["target_bytes"] and p["live_bytes_max_rank"] == 0
    assert p["read_bytes_per_rank_max"] == p["bytes_to_read"]
    p2 = reshard.plan(str(tmp_path), "tp=1,pp=1,dp=4,zero=1")
    assert p2["live_bytes_total"] == p2["target_bytes"] and p2["target_bytes"] / 4 <= p2["live_bytes_per_rank_max"]
    # Load into tp=1 (one process), save again, load into tp=1 again: bitwise the same.
    L1 = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    a = zeros_for(L1, fill=float("nan"))
    rep = reshard.load(str(tmp_path), L1, a)
    assert all(not torch.isnan(t).any() for t in a.values())
    assert rep["step"] == info["state"]["step"] and rep["not_carried"]  # per-rank state dropped, and said so
    assert rep["target_bytes"] == L1.total_bytes and rep["gbps"] > 0
    # Phase times of this rank: the pre-flight (replica comparisons of the tied embedding here)
    # and the copy both took time, and neither exceeds the load's wall time.
    assert 0 < rep["preflight_seconds"] <= rep["seconds"], rep
    assert 0 < rep["copy_seconds"] <= rep["seconds"], rep
    L1s = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1", weights_on_dp0_only=True)
    reshard.save(str(tmp_path / "again"), "step-1", L1s, a, state={"iteration": 3, "consumed_samples": 24, "step": 3})
    b = zeros_for(L1)
    rep2 = reshard.load(str(tmp_path / "again"), L1, b)
    assert rep2["change"] == "no change" and rep2["iteration"] == 3
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_load_progress_callback_and_logging(tmp_path, caplog, monkeypatch):
    """progress= gets "plan", "preflight" and one "wave" per wave with this rank's bytes; the same
    events go to logger "reshard" at DEBUG and the finished load at INFO; a callback that raises is
    logged once and the load completes with the same values; a non-callable is InvalidArgument
    before anything is read. The staged (CUDA-style) path reports the same events."""
    import logging
    m = reshard.model_config(dict(TINY, hidden=128, ffn=512, vocab=1024))
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=1,zero=1", 7)
    L1 = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    pol = {"memory_budget_bytes": 1 << 20}  # several waves
    events = []
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        a = zeros_for(L1, fill=float("nan"))
        rep = reshard.load(str(tmp_path), L1, a, policies=pol, progress=events.append)
    assert rep["waves"] >= 2
    assert [e["stage"] for e in events] == ["plan", "preflight"] + ["wave"] * rep["waves"]
    assert [e["index"] for e in events[2:]] == list(range(1, rep["waves"] + 1))
    assert all(e["count"] == rep["waves"] for e in events[2:])
    done = [e["bytes_done"] for e in events]
    assert done == sorted(done) and done[1] == 0 and done[-1] == events[0]["bytes_total"] > 0
    # One process receives every delivery: its total is the source bytes the plan reads.
    assert events[0]["bytes_total"] == rep["bytes_read"]
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "reshard"]
    assert sum(1 for lv, msg in msgs if lv == logging.DEBUG and " load wave " in msg) == rep["waves"], msgs
    assert any(lv == logging.INFO and msg.startswith("[rank 0] loaded ") and "tp 2->1" in msg for lv, msg in msgs), msgs
    caplog.clear()

    def boom(event):
        raise RuntimeError("callback failed on purpose")
    with caplog.at_level(logging.WARNING, logger="reshard"):
        b = zeros_for(L1, fill=float("nan"))
        reshard.load(str(tmp_path), L1, b, policies=pol, progress=boom)
    warned = [r.getMessage() for r in caplog.records if r.name == "reshard" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "callback failed on purpose" in warned[0], warned
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c = zeros_for(L1, fill=0.0)
    with pytest.raises(reshard.InvalidArgument, match="progress must be callable"):
        reshard.load(str(tmp_path), L1, c, progress=3)
    assert all(bool((t == 0).all()) for t in c.values())
    monkeypatch.setattr(reshard, "_STAGE_CPU_TENSORS_FOR_TESTS", True)
    staged = []
    reshard.load(str(tmp_path), L1, zeros_for(L1), policies=pol, progress=staged.append)
    assert [e["stage"] for e in staged] == [e["stage"] for e in events]


def test_staged_load_equals_in_place_load_and_writes_nothing_on_error(tmp_path, monkeypatch):
    """The path CUDA tensors take (load into host staging, then copy to the device tensors), run
    with CPU tensors: the same bits as the in-place load; the report says it staged; an error
    leaves every tensor untouched."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=2,zero=1", 21)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    direct = zeros_for(L, fill=float("nan"))
    reshard.load(str(tmp_path), L, direct)
    monkeypatch.setattr(reshard, "_STAGE_CPU_TENSORS_FOR_TESTS", True)
    staged = zeros_for(L, fill=float("nan"))
    rep = reshard.load(str(tmp_path), L, staged)
    for k in direct:
        assert torch.equal(direct[k], staged[k]), k
    assert rep["device"] == "cpu" and rep["staged_host_bytes"] == L.total_bytes
    assert any("host staging" in p for p in rep["policies"]), rep["policies"]
    # A model that the checkpoint does not cover (untied head): refused, nothing written.
    untied = reshard.derive_layout(reshard.model_config({**TINY, "tied_embeddings": False}), "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(untied)
    snap = {k: v.clone() for k, v in live.items()}
    with pytest.raises(reshard.InvalidArgument, match="lm_head.weight"):
        reshard.load(str(tmp_path), untied, live)
    for k in live:
        assert torch.equal(live[k], snap[k]), k


def test_load_builds_the_buffer_list_a_fixed_number_of_times(tmp_path, monkeypatch):
    """Layout.buffers builds a list of every buffer of every rank on each access (O(buffers));
    load() once read it per tensor, which made a 4620-buffer load spend 11 s in Python around a
    0.4 s load. Count the builds on both paths: a constant, whatever the number of tensors."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=2,zero=1", 5)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L, fill=float("nan"))
    assert len(live) >= 20, len(live)
    prop = type(L).__dict__["buffers"]
    calls = []

    def counting(self):
        calls.append(1)
        return prop.fget(self)

    monkeypatch.setattr(type(L), "buffers", property(counting))
    for staged in (False, True):
        monkeypatch.setattr(reshard, "_STAGE_CPU_TENSORS_FOR_TESTS", staged)
        calls.clear()
        reshard.load(str(tmp_path), L, live)
        assert 1 <= len(calls) <= 3, (staged, len(calls), len(live))
        # and the load itself happened: every element of every tensor written
        assert not any(torch.isnan(t).any() for t in live.values()), staged
        for t in live.values():
            t.fill_(float("nan"))


def test_allocate_gives_tensors_load_accepts(tmp_path):
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=1,zero=1", 4)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    live = reshard.allocate(L, fill=float("nan"))
    assert set(live) == {b["name"] for b in L.buffers}
    assert all(live[b["name"]].numel() == b["numel"] and live[b["name"]].dtype == _DT[b["dtype"]] for b in L.buffers)
    reshard.load(str(tmp_path), L, live)
    assert all(not torch.isnan(t).any() for t in live.values())
    with pytest.raises(reshard.InvalidArgument, match="rank 1 is outside layout"):
        reshard.allocate(L, 1)
    with pytest.raises(reshard.InvalidArgument, match="allocate needs a Layout"):
        reshard.allocate("tp=1,pp=1,dp=1,zero=1", 0)
    # verify="full" on a clean checkpoint: every piece the load reads is checked, before any write.
    rep = reshard.load(str(tmp_path), L, live, verify="full")
    assert rep["bytes_verified"] >= rep["bytes_read"] > 0 and rep["bytes_unchecked"] == 0, rep
    with pytest.raises(reshard.InvalidArgument, match="must be off, free or full"):
        reshard.load(str(tmp_path), L, live, verify="always")


def test_the_report_notes_only_what_verify_free_did_not_check(tmp_path):
    """One process reads every stored piece whole, so "free" checks all of it and the report adds
    no "verify=free did not check ..." note; a budget that cuts pieces has them checked in the
    pre-flight, still no note (MpiLoad.FullVerifyChecksPiecesCutBetweenRanks... and
    MpiLoad.TheUncheckedNoteCountsFragmentsNotTotals show the note where pieces are cut between
    ranks)."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=2,zero=1", 4)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=3")
    rep = reshard.load(str(tmp_path), L, reshard.allocate(L), verify="free")
    assert rep["bytes_verified"] == rep["bytes_read"] > 0 and rep["bytes_unchecked"] == 0, rep
    assert not [p for p in rep["policies"] if p.startswith("verify=free")], rep["policies"]
    rep = reshard.load(str(tmp_path), L, reshard.allocate(L), verify="off")
    assert rep["bytes_unchecked"] == rep["bytes_read"] > 0 and rep["bytes_verified"] == 0, rep
    # Pieces of 512 KiB (fp32 word embeddings, 1024 x 128) under a 64 KiB budget: cut into
    # fragments, each piece checked whole in the pre-flight instead; nothing unchecked.
    m2 = reshard.model_config(dict(TINY, name="mid-f32", hidden=128, ffn=256, vocab=1024, vocab_divisible_by=64))
    reshard.synth_checkpoint(str(tmp_path / "mid"), m2, "tp=1,pp=1,dp=1,zero=1", 5)
    L2 = reshard.derive_layout(m2, "tp=1,pp=1,dp=1,zero=1")
    rep = reshard.load(str(tmp_path / "mid"), L2, reshard.allocate(L2), policies={"memory_budget_bytes": 65536},
                       verify="free")
    assert rep["bytes_unchecked"] == 0 and rep["verify_bytes_read"] > 0 and rep["waves"] > 1, rep
    assert not [p for p in rep["policies"] if p.startswith("verify=free")], rep["policies"]


def test_build_layout_takes_the_trainers_uneven_pipeline_stages():
    """3 layers over pp=2 (DeepSpeed splits them 1+2 or 2+1): the stages the trainer gives place
    each layer; reshard's own uniform split refuses; inconsistent or partial stages are named."""
    m = reshard.model_config(dict(TINY, num_layers=3))
    names = [t["name"] for t in reshard.model_tensors(m, 1)]
    layer = {n: int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    stages = {n: [0 if l == 0 else 1] for n, l in layer.items()}
    L = reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=stages)
    on = {r: {int(b["name"].split(".")[1]) for b in L.buffers
              if b["rank"] == r and b["name"].startswith("weight/layers.")} for r in (0, 1)}
    assert on == {0: {0}, 1: {1, 2}}, on
    with pytest.raises(reshard.InvalidArgument, match="num_layers=3 is not divisible by pp\\*vpp=2"):
        reshard.derive_layout(m, "tp=1,pp=2,dp=1,zero=1")
    split = dict(stages, **{"layers.2.self_attention.dense.weight": [0]})
    with pytest.raises(reshard.InvalidArgument, match="other tensors of layer 2 on stage 1"):
        reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=split)
    partial = {n: v for n, v in stages.items() if layer[n] != 2}
    with pytest.raises(reshard.InvalidArgument, match="stages names no stage for layer 2"):
        reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=partial)
    with pytest.raises(reshard.InvalidArgument, match="on stage 2, not in \\[0, pp=2\\)"):
        reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=dict(stages, **{n: [2] for n, l in layer.items() if l == 0}))
    # A whole layer on stage -1 is named as such (not "no stage"), and non-int stages are
    # InvalidArgument naming the tensor, not a pybind cast error.
    with pytest.raises(reshard.InvalidArgument, match="on stage -1, not in \\[0, pp=2\\)"):
        reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=dict(stages, **{n: [-1] for n, l in layer.items() if l == 2}))
    name = next(iter(stages))
    for bad in ([2**31], [1.5], ["1"], [True], 1, "0"):
        with pytest.raises(reshard.InvalidArgument, match=f"stages\\['{name}'\\] must be a list of stage numbers"):
            reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=dict(stages, **{name: bad}))
    with pytest.raises(reshard.InvalidArgument, match="stages must be a mapping"):
        reshard.build_layout(m, "tp=1,pp=2,dp=1,zero=1", stages=[1, 2])


def test_optimizer_state_the_targets_groups_leave_out_is_not_dropped_silently(tmp_path):
    """A trainer's param groups without one tensor (frozen, or built wrong) gave its fp32 master and
    moments no place in the target: the plan skipped them and said nothing.
    Now an InvalidArgument naming them under strict_unexpected (the default), a note without it."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=1,pp=1,dp=1,zero=1", 3)
    full = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    frozen = "layers.1.mlp.dense_4h_to_h.weight"
    groups = full.flat_groups
    for g in groups[0]:
        g["entries"] = [e for e in g["entries"] if e[0] != frozen]
    L = reshard.build_layout(m, "tp=1,pp=1,dp=1,zero=1", groups=groups)
    with pytest.raises(reshard.InvalidArgument, match=f"3 optimizer state\\(s\\) in the checkpoint have no place in "
                       f"the target.*{frozen}/fp32.*strict_unexpected is on"):
        reshard.plan(str(tmp_path), L)
    p = reshard.plan(str(tmp_path), L, policies={"strict_unexpected": False})
    assert any(n.startswith("not loaded (strict_unexpected off): 3 optimizer state(s)") and frozen in n
               for n in p["notes"]), p["notes"]
    # The whole model's groups: nothing to say.
    assert not any("no place in the target" in n for n in reshard.plan(str(tmp_path), full)["notes"])


def test_wrong_argument_types_are_invalid_argument(tmp_path):
    """Policies and tensors of the wrong type raise InvalidArgument naming what is wrong (they
    used to give raw binding errors and a misleading device message)."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=1,pp=1,dp=1,zero=1", 2)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L)
    for pol, words in [({"replicas": None}, "policy 'replicas' must be a string"),
                       ({"memory_budget_gib": -1.0}, "memory_budget_gib' must be a positive number"),
                       ({"memory_budget_bytes": 1.5e6}, "memory_budget_bytes' must be a non-negative integer"),
                       ({"replica_atol": "x"}, "replica_atol' must be a number"),
                       ({"replica_atol": -1.0}, "replica_atol' must be >= 0"),
                       ({"dedup": "maybe"}, "policy 'dedup' must be True or False"),
                       ("average", "policies must be a dict")]:
        with pytest.raises(reshard.InvalidArgument, match=words.replace("(", r"\(")):
            reshard.load(str(tmp_path), L, live, policies=pol)
    k = next(iter(live))
    with pytest.raises(reshard.InvalidArgument, match=f"{k} is a ndarray, not a torch.Tensor"):
        reshard.load(str(tmp_path), L, {**live, k: live[k].numpy()})
    with pytest.raises(reshard.InvalidArgument, match="tensors must be a dict"):
        reshard.load(str(tmp_path), L, 5)
    with pytest.raises(reshard.InvalidArgument, match="io_threads=0"):
        reshard.load(str(tmp_path), L, live, io_threads=0)


def test_strict_missing_raises_before_any_write(tmp_path):
    """The checkpoint (tied) lacks lm_head.weight that the target model (untied) has."""
    reshard.synth_checkpoint(str(tmp_path), reshard.model_config(TINY), "tp=2,pp=1,dp=1,zero=1", 9)
    untied = reshard.model_config({**TINY, "tied_embeddings": False})
    L = reshard.derive_layout(untied, "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L)
    snap = {k: v.clone() for k, v in live.items()}
    with pytest.raises(reshard.InvalidArgument, match="lm_head.weight"):
        reshard.load(str(tmp_path), L, live)
    for k in live:
        assert torch.equal(live[k], snap[k]), f"{k} changed although the load failed"
    # Not strict: loads everything else and leaves lm_head alone.
    reshard.load(str(tmp_path), L, live, policies={"strict_missing": False})
    assert torch.equal(live["weight/lm_head.weight"], snap["weight/lm_head.weight"])
    assert not torch.equal(live["weight/final_layernorm.weight"], snap["weight/final_layernorm.weight"])


def _divergent_checkpoint(tmp_path, delta=0.5):
    """A tp=2 checkpoint, written with valid checksums, whose tp rank 1 copy of one LayerNorm
    weight differs from tp rank 0's in one element (failures.md B10)."""
    from safetensors.torch import load_file
    m = reshard.model_config(TINY)
    src = tmp_path / "synth"
    reshard.synth_checkpoint(str(src), m, "tp=2,pp=1,dp=1,zero=1", 11)
    step_dir = reshard.inspect(str(src))["path"]
    L = reshard.derive_layout(m, "tp=2,pp=1,dp=1,zero=1", weights_on_dp0_only=True)
    files = {r: load_file(os.path.join(step_dir, f"rank_{r:05d}.safetensors")) for r in range(2)}
    tensors = [files[b["rank"]][b["name"]].clone() for b in L.buffers]
    name = "weight/layers.1.input_layernorm.weight"
    i1 = [i for i, b in enumerate(L.buffers) if b["rank"] == 1 and b["name"] == name][0]
    original = tensors[i1][3].item()
    tensors[i1][3] += delta
    changed = tensors[i1][3].item()
    reshard.save_all_ranks(str(tmp_path / "div"), "step-1", L, tensors, state={"iteration": 1, "step": 1,
                                                                              "consumed_samples": 8})
    return str(tmp_path / "div"), original, changed, tensors[i1].dtype


def test_replica_divergence_policies(tmp_path):
    root, original, changed, dtype = _divergent_checkpoint(tmp_path)
    L = reshard.derive_layout(reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L)
    snap = {k: v.clone() for k, v in live.items()}
    with pytest.raises(reshard.DataLoss, match=r"layers\.1\.input_layernorm\.weight.*max \|diff\| 0\.5"):
        reshard.load(root, L, live, policies={"replicas": "error"})
    for k in live:
        assert torch.equal(live[k], snap[k])
    # Within tolerance: loads.
    reshard.load(root, L, live, policies={"replicas": "error", "replica_atol": 0.6})
    rep = reshard.load(root, L, live, policies={"replicas": "first"})
    assert live["weight/layers.1.input_layernorm.weight"][3].item() == original  # tp rank 0's copy
    assert any("layers.1.input_layernorm.weight" in s for s in rep["replica_report"])
    first = {k: v.clone() for k, v in live.items()}
    # Average: the mean of the two saved copies, rounded once to the saved dtype; all else as 'first'.
    rep = reshard.load(root, L, live, policies={"replicas": "average"})
    name = "weight/layers.1.input_layernorm.weight"
    want = ((torch.tensor(original, dtype=torch.float64) + changed) / 2).to(dtype)
    assert live[name][3].item() == want.item() != original
    assert torch.equal(live[name][:3], first[name][:3]) and torch.equal(live[name][4:], first[name][4:])
    for k in live:
        if k != name:
            assert torch.equal(live[k], first[k]), k
    assert any("layers.1.input_layernorm.weight" in s for s in rep["replica_report"])
    assert "replica policy: average" in rep["policies"]
    assert rep["bytes_read"] > rep["bytes_needed"]  # the second copy was read to average it


def test_bad_tensors_are_invalid_argument(tmp_path):
    reshard.synth_checkpoint(str(tmp_path), reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1", 1)
    L = reshard.derive_layout(reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L)
    k = next(iter(live))
    live[k] = live[k][:-1].clone()
    with pytest.raises(reshard.InvalidArgument, match="elements"):
        reshard.load(str(tmp_path), L, live)
    with pytest.raises(reshard.InvalidArgument, match="policy"):
        reshard.load(str(tmp_path), L, zeros_for(L), policies={"replica": "first"})
    with pytest.raises(reshard.NotFound, match="step"):
        reshard.load(str(tmp_path), L, zeros_for(L), step=99)
    # A lazy negation view's bytes are not its values: load would write -x where x is shown and
    # save would store -x; refused, and nothing is written.
    live = zeros_for(L)
    k = next(k for k, t in live.items() if t.dtype == torch.float32)
    base = torch.full_like(live[k], 7.0)
    live[k] = torch._neg_view(base)
    assert live[k].is_neg()
    with pytest.raises(reshard.InvalidArgument, match="negation view"):
        reshard.load(str(tmp_path), L, live)
    assert torch.equal(base, torch.full_like(base, 7.0))
    with pytest.raises(reshard.InvalidArgument, match="negation view"):
        reshard.save(str(tmp_path / "neg"), "step-1", L, live)


def test_tensors_that_share_memory_or_hold_none_are_refused_before_any_write(tmp_path):
    reshard.synth_checkpoint(str(tmp_path), reshard.model_config(TINY), "tp=2,pp=1,dp=1,zero=1", 1)
    L = reshard.derive_layout(reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1")
    ref = zeros_for(L, fill=0.0)
    reshard.load(str(tmp_path), L, ref)
    names = sorted(ref)
    a, b = [n for n in names if ref[n].dtype == torch.float32][:2]
    # The same tensor for two buffers of one dtype and size: one's values would overwrite the other's.
    same = [(x, y) for x in names for y in names if x < y and ref[x].dtype == ref[y].dtype
            and ref[x].numel() == ref[y].numel()]
    x, y = same[0]
    live = zeros_for(L, fill=0.0)
    live[y] = live[x]
    with pytest.raises(reshard.InvalidArgument, match=f"buffers {x} and {y} overlap in memory|buffers {y} and {x} overlap"):
        reshard.load(str(tmp_path), L, live)
    assert all(not t.any() for t in live.values())
    # Overlapping views of one storage (not the same start).
    big = torch.zeros(ref[a].numel() + ref[b].numel(), dtype=torch.float32)
    live = zeros_for(L, fill=0.0)
    live[a] = big[: ref[a].numel()]
    live[b] = big[1: 1 + ref[b].numel()]
    with pytest.raises(reshard.InvalidArgument, match="overlap in memory"):
        reshard.load(str(tmp_path), L, live)
    assert not big.any()
    # Meta tensors hold no data: refused like save() refuses them, not "loaded" by a no-op copy.
    meta = {k: torch.empty(v.numel(), dtype=v.dtype, device="meta") for k, v in ref.items()}
    with pytest.raises(reshard.InvalidArgument, match="is on meta"):
        reshard.load(str(tmp_path), L, meta)
    # Adjacent views that do not overlap load like separate tensors.
    live = zeros_for(L, fill=0.0)
    live[a] = big[: ref[a].numel()]
    live[b] = big[ref[a].numel():]
    reshard.load(str(tmp_path), L, live)
    assert torch.equal(live[a], ref[a]) and torch.equal(live[b], ref[b])


def test_a_model_whose_vocab_differs_from_the_checkpoints_is_refused(tmp_path):
    # Both vocabs pad to 64 rows: the shapes agree, the real rows do not (60 vs 57).
    reshard.synth_checkpoint(str(tmp_path), reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1", 1)
    other = reshard.model_config(dict(TINY, vocab=57))
    assert other.padded_vocab(1) == reshard.model_config(TINY).padded_vocab(1)
    L = reshard.derive_layout(other, "tp=1,pp=1,dp=1,zero=1")
    live = zeros_for(L, fill=0.0)
    with pytest.raises(reshard.InvalidArgument, match="vocab: 60 real rows in the checkpoint, 57 in the model"):
        reshard.load(str(tmp_path), L, live)
    assert all(not t.any() for t in live.values())


def test_save_refuses_state_it_would_not_keep_and_bad_step_names(tmp_path):
    m = reshard.model_config(TINY)
    L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1", weights_on_dp0_only=True)
    t = zeros_for(L)
    cases = [({"consumed_sample": 5}, "unknown state key 'consumed_sample'"),
             ({"iteration": "5"}, "state 'iteration' must be an int"),
             ({"step": 3.5}, "state 'step' must be an int"),
             ({"iteration": 2**70}, "does not fit in 64 bits"),
             ({"iteration": -5}, "state 'iteration' must be >= 0"),
             ({"per_rank": {5: b"x"}}, "names rank 5, outside the layout's world size 1"),
             ({"per_rank": {0: "text"}}, "must map int ranks to bytes"),
             # JSON that is not one object: readers refuse it, so the newest step would not open
             ({"json": [1, 2]}, "must be one JSON object, not array"),
             ({"json": "null"}, "must be one JSON object, not null"),
             ({"json": '"text"'}, "must be one JSON object, not string"),
             ({"json": "{nope"}, "not valid JSON"),
             ({"json": {"lr": 0.1}}, None)]  # a dict: serialised to its JSON text, saved
    for state, msg in cases:
        if msg is None:
            reshard.save(str(tmp_path / "ok"), "step-1", L, t, state=state)
            continue
        with pytest.raises(reshard.InvalidArgument, match=msg):
            reshard.save(str(tmp_path / "bad"), "step-1", L, t, state=state)
        assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    for step in ("step-2 ", "step-1\n", " step-3", "step\t4"):
        with pytest.raises(reshard.InvalidArgument, match="not allowed"):
            reshard.save(str(tmp_path / "names"), step, L, t)
    with pytest.raises(reshard.InvalidArgument, match="rank must be an int"):
        reshard.allocate(L, "0")


def test_resume_config_fields_are_checked_by_type_and_named(tmp_path):
    base = "checkpoint: {root: /x}\ntarget: tp=1,pp=1,dp=1,zero=1\n"
    f = tmp_path / "rc.yaml"
    cases = [(base + "policies: {memory_budget_gib: -1}\n", "policies.memory_budget_gib must be a positive"),
             (base + "policies: {memory_budget_gib: 0}\n", "policies.memory_budget_gib must be a positive"),
             (base + "policies: {memory_budget_bytes: -5}\n", "policies.memory_budget_bytes must be positive"),
             (base + "policies: {memory_budget_gib: 1, memory_budget_bytes: 65536}\n", "both given"),
             (base + "policies: {replica_atol: .nan}\n", "replica_atol must be a number >= 0"),
             (base + "target: tp=2\n", "field 'target' is given twice"),
             ("checkpoint: /x\ntarget: tp=1\n", "field checkpoint must be a mapping"),
             (base + "policies: [replicas]\n", "field policies must be a mapping"),
             (base + "policies: first\n", "field policies must be a mapping"),
             (base + "policies: {[a]: 1}\n", "is not a name"),
             (base + "policies: {replicas: [first]}\n", "field replicas: cannot read"),
             # A second document used to be ignored, and 1e-300 GiB became a 0-byte budget.
             (base + "---\ncheckpoint: {root: /y}\ntarget: tp=2\n", "holds 2 YAML documents"),
             (base + "policies: {memory_budget_gib: 1e-300}\n", "policies.memory_budget_gib gives 0 bytes, below"),
             (base + "policies: {memory_budget_bytes: 100}\n", "policies.memory_budget_bytes gives 100 bytes, below"),
             (base + "policies: {vocab_padding: drop}\n", "policies.vocab_padding is 'drop'; expected warn or refuse")]
    for text, msg in cases:
        f.write_text(text)
        with pytest.raises(reshard.InvalidArgument, match=msg) as e:
            reshard.load_resume_config(str(f))
        assert str(f) in str(e.value)
    with pytest.raises(reshard.InvalidArgument, match="is a folder"):
        reshard.load_resume_config(str(tmp_path))
    # A path to a device was read without end (7.5 GB in 15 s); a large file is refused by size.
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    with pytest.raises(reshard.InvalidArgument, match="is not a regular file"):
        reshard.load_resume_config(str(tmp_path / "zero.yaml"))
    with pytest.raises(reshard.InvalidArgument, match="is not a regular file"):
        reshard.model_config(str(tmp_path / "zero.yaml"))
    (tmp_path / "big.yaml").write_text(base + "#" * (2 << 20) + "\n")
    with pytest.raises(reshard.InvalidArgument, match="a model or resume file is a few KB"):
        reshard.load_resume_config(str(tmp_path / "big.yaml"))
    ck = str(tmp_path / "ck")
    reshard.synth_checkpoint(ck, reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1", 1)
    with pytest.raises(reshard.InvalidArgument, match="both given"):
        reshard.plan(ck, "tp=1", policies={"memory_budget_gib": 1, "memory_budget_bytes": 65536})
    with pytest.raises(reshard.InvalidArgument, match="memory_budget_gib"):
        reshard.plan(ck, "tp=1", policies={"memory_budget_gib": float("inf")})
    L = reshard.derive_layout(reshard.model_config(TINY), "tp=1,pp=1,dp=1,zero=1")
    with pytest.raises(reshard.InvalidArgument, match="io_threads"):
        reshard.load(ck, L, zeros_for(L), io_threads="4")
    assert reshard.load(ck, L, zeros_for(L), io_threads=None)["target_bytes"] == L.total_bytes  # None: the default


def test_resume_configs():
    d = os.path.join(REPO, "configs", "resume")
    files = sorted(f for f in os.listdir(d) if f.endswith(".yaml"))
    assert files
    for f in files:
        rc = reshard.load_resume_config(os.path.join(d, f))
        assert rc["checkpoint"]
        if rc["target"] == "auto":  # chosen at restart (docs/elastic.md)
            assert rc["target_topology"] is None and rc["elastic"]["policy"] in ("keep", "list", "refuse"), f
        else:
            assert rc["target_topology"]["tp"] >= 1 and rc["elastic"] == {"policy": "keep", "allowed": []}, f
        assert rc["policies"]["replicas"] in ("error", "first")
    rc = reshard.load_resume_config(os.path.join(d, "demo_tp1_pp2_dp4.yaml"))
    assert (rc["target_topology"]["tp"], rc["target_topology"]["pp"], rc["target_topology"]["dp"]) == (1, 2, 4)
    assert rc["step"] == "24" and rc["policies"]["memory_budget_bytes"] == 2**30
    assert rc["policies"]["node_local_reads"] is True and rc["policies"]["compare_replicas"] is True
    assert rc["verify"] == "full"
    assert rc["policies"]["vocab_padding"] == "warn"


def test_vocab_padding_drop_warns_with_the_divisor_and_refuse_stops_it(tmp_path):
    """vocab 13, vocab_divisible_by 1: tp=2 pads to 14 rows, tp=1 to 13. The load drops the trained
    padding row (real rows bitwise), and the report's warning says how many rows and that
    vocab_divisible_by 2 keeps them; policy vocab_padding=refuse stops it before any write."""
    m = {"name": "v13", "num_layers": 1, "hidden": 8, "ffn": 16, "heads": 2, "vocab": 13, "vocab_divisible_by": 1,
         "max_position_embeddings": 0, "swiglu": False, "tied_embeddings": True, "bias": True, "norm": "layernorm",
         "param_dtype": "f32", "qkv_version": 3.0}
    ck = str(tmp_path / "ck")
    reshard.synth_checkpoint(ck, m, "tp=2,pp=1,dp=1,zero=1", 3)
    p = reshard.plan(ck, "tp=1,pp=1,dp=1,zero=1")
    assert len(p["warnings"]) == 1, p
    w = p["warnings"][0]
    assert "pads vocab 13 to 14 rows, the target to 13" in w and "1 trained padding row(s)" in w, w
    assert "--make-vocab-size-divisible-by 2) at tp 1 keeps the 14 rows" in w, w
    L = reshard.derive_layout(reshard.model_config(m), "tp=1,pp=1,dp=1,zero=1")
    t = zeros_for(L)
    report = reshard.load(ck, L, t, comm=reshard.local_communicator())
    assert report["warnings"] == [w] and "warning: vocab padding" in report["text"]
    emb = t["weight/embedding.word_embeddings.weight"].view(13, 8)
    L2 = reshard.derive_layout(reshard.model_config(m), "tp=1,pp=1,dp=1,zero=1")
    t2 = zeros_for(L2, fill=0.0)
    with pytest.raises(reshard.InvalidArgument, match="refused: policy vocab_padding=refuse"):
        reshard.load(ck, L2, t2, comm=reshard.local_communicator(), policies={"vocab_padding": "refuse"})
    assert all(float(x.abs().sum()) == 0 for x in t2.values())  # nothing written
    with pytest.raises(reshard.InvalidArgument, match="vocab_padding' must be warn or refuse"):
        reshard.plan(ck, "tp=1,pp=1,dp=1,zero=1", policies={"vocab_padding": "drop"})
    # The divisor the warning names keeps every row: no warning, and refuse lets it through.
    m2 = dict(m, vocab_divisible_by=2)
    L3 = reshard.derive_layout(reshard.model_config(m2), "tp=1,pp=1,dp=1,zero=1")
    t3 = zeros_for(L3)
    r3 = reshard.load(ck, L3, t3, comm=reshard.local_communicator(), policies={"vocab_padding": "refuse"})
    assert r3["warnings"] == []
    kept = t3["weight/embedding.word_embeddings.weight"].view(14, 8)
    assert torch.equal(kept[:13], emb)  # the same real rows either way
    assert float(kept[13].abs().sum()) > 0  # and the trained padding row, which the drop lost


def test_one_verify_default_for_every_face(tmp_path):
    """One checksum default, stated once (reshard::kDefaultVerify, exported as
    reshard.DEFAULT_VERIFY): reshard.load, the Megatron-DeepSpeed hook, a resume YAML without
    ``verify:`` and the CLI's convert and bench load all take it, and it is "full": a default load
    of a checkpoint whose 16-bit weight is not its fp32 master rounded (every checksum valid)
    fails before any write, where "free" loads it."""
    import inspect
    from reshard.integrations import megatron_deepspeed as mds
    assert reshard.DEFAULT_VERIFY == "full"
    assert inspect.signature(reshard.load).parameters["verify"].default == reshard.DEFAULT_VERIFY
    for fn in (mds.load_checkpoint, mds.fill_engine):
        assert inspect.signature(fn).parameters["verify"].default == reshard.DEFAULT_VERIFY, fn
    f = tmp_path / "rc.yaml"
    f.write_text("checkpoint: {root: /x}\ntarget: tp=1,pp=1,dp=1,zero=1\n")
    assert reshard.load_resume_config(str(f))["verify"] == reshard.DEFAULT_VERIFY
    for cmd in (["convert", "--help"], ["bench", "load", "--help"]):
        out = subprocess.run([CLI, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
        assert "default " + reshard.DEFAULT_VERIFY in " ".join(out.split()), (cmd, out)
    # The behaviour, not only the names: an edited weight, saved through the writer.
    m = reshard.model_config(TINY)
    src = tmp_path / "ck"
    reshard.synth_checkpoint(str(src), m, "tp=1,pp=1,dp=1,zero=1", 3)
    c = reshard.open_checkpoint(str(src))
    L = c.layout
    from safetensors.torch import load_file
    stored = load_file(str(src / "step-1" / "rank_00000.safetensors"))
    tensors = []
    for b in L.buffers:
        t = stored[b["name"]].clone()
        if b["name"] == "weight/layers.0.mlp.dense_4h_to_h.weight":
            t.view(torch.int16).view(-1)[3] ^= 1  # one bf16 ulp off its rounded master
        tensors.append(t)
    reshard.save_all_ranks(str(src), "step-2", L, tensors, state=c.state)
    live = reshard.allocate(L, fill=0.0)
    with pytest.raises(reshard.DataLoss, match="weights against the fp32 master"):
        reshard.load(str(src), L, live, step="step-2")
    assert all(bool((t == 0).all()) for t in live.values())  # nothing written
    rep = reshard.load(str(src), L, live, step="step-2", verify="free")
    assert rep["bytes_read"] > 0


def test_resume_config_verify_field(tmp_path):
    base = "checkpoint: {root: /x}\ntarget: tp=1,pp=1,dp=1,zero=1\n"
    f = tmp_path / "rc.yaml"
    f.write_text(base + "verify: off\n")
    assert reshard.load_resume_config(str(f))["verify"] == "off"
    f.write_text(base + "verify: always\n")
    with pytest.raises(reshard.InvalidArgument) as e:
        reshard.load_resume_config(str(f))
    assert "field verify is 'always'" in str(e.value) and str(f) in str(e.value)


COMM_CHECK = r'''
import os, sys, torch, torch.distributed as dist
r = int(os.environ["OMPI_COMM_WORLD_RANK"]); w = int(os.environ["OMPI_COMM_WORLD_SIZE"])
dist.init_process_group("gloo", rank=r, world_size=w)
import reshard
c = reshard.communicator()
assert (c.rank, c.size, c.name) == (r, w, "torch:gloo")
assert c.all_reduce_sum(r + 1) == w * (w + 1) // 2 and c.all_reduce_max(r) == w - 1
assert c.all_gather_strings(b"x" * r) == [b"x" * p for p in range(w)]
# all_to_all_v: rank r sends r+1 bytes of value r to every rank, packed in reverse rank order;
# rank 0 sends nothing to itself (a zero count is still collective).
sc = [0 if (r == 0 and p == 0) else r + 1 for p in range(w)]
sd = [sum(sc[q] for q in range(p + 1, w)) for p in range(w)]
send = torch.full((sum(sc),), r, dtype=torch.uint8)
rc = [0 if (r == 0 and p == 0) else p + 1 for p in range(w)]
rd = [sum(rc[:p]) for p in range(w)]
recv = torch.zeros(sum(rc), dtype=torch.uint8)
reshard._C._comm_all_to_all_v(c, send, sc, sd, recv, rc, rd)
exp = torch.cat([torch.full((rc[p],), p, dtype=torch.uint8) for p in range(w)])
assert torch.equal(recv, exp), (recv, exp)
# A count mismatch is an error naming both ranks, not a hang.
try:
    bad = [1] * w
    reshard._C._comm_all_to_all_v(c, torch.zeros(w, dtype=torch.uint8), bad, list(range(w)),
                                  torch.zeros(2 * w, dtype=torch.uint8), [2] * w, [2 * p for p in range(w)])
    raise SystemExit("no error on mismatched counts")
except reshard.FailedPrecondition as e:
    assert "count mismatch" in str(e) and f"[rank {r}/{w}]" in str(e), str(e)
# Broadcast inside a subgroup (only members call) and over everyone.
t = torch.full((5,), r, dtype=torch.uint8)
if r in (1, 3):
    reshard._C._comm_broadcast(c, t, 3, [1, 3])
    assert t.tolist() == [3] * 5
t = torch.full((4,), r, dtype=torch.uint8)
reshard._C._comm_broadcast(c, t, 2, list(range(w)))
assert t.tolist() == [2] * 4
c.barrier()
# A distributed load over gloo: tp=2,pp=2,dp=1 synth checkpoint into tp=1,pp=2,dp=2.
m = reshard.model_config(dict(name="t", num_layers=2, hidden=16, ffn=32, heads=4, query_groups=2, vocab=60,
                              vocab_divisible_by=8, swiglu=True, tied_embeddings=True, param_dtype="f32"))
L = reshard.derive_layout(m, "tp=1,pp=2,dp=2,zero=1")
ts = {b["name"]: torch.full((b["numel"],), float("nan")) for b in L.buffers if b["rank"] == r}
# One read per job: the ranks (all on this machine) exchange the dp-replicated weights over gloo
# instead of each copying them out of the page cache, so the exchange path runs.
rep = reshard.load(sys.argv[1], L, ts, policies={"node_local_reads": False})
assert all(not torch.isnan(t).any() for t in ts.values())
assert rep["bytes_exchanged"] > 0
# Node-local reads (the default): the same values with nothing exchanged.
ts2 = {k: torch.full_like(v, float("nan")) for k, v in ts.items()}
rep2 = reshard.load(sys.argv[1], L, ts2)
assert rep2["bytes_exchanged"] == 0 and rep2["bytes_reread_on_node"] > 0, rep2
assert all(torch.equal(ts[k], ts2[k]) for k in ts)
# A bad argument on one rank fails every rank before anything is read or written, instead of
# leaving the others waiting in a collective: rank 1 gives a float64 tensor for one buffer.
ts3 = {k: torch.zeros_like(v) for k, v in ts.items()}
k0 = sorted(ts3)[0]
if r == 1:
    ts3[k0] = torch.zeros(ts3[k0].numel(), dtype=torch.float64)
try:
    reshard.load(sys.argv[1], L, ts3)
    raise SystemExit("no error for a float64 tensor on rank 1")
except reshard.InvalidArgument as e:
    assert f"buffer {k0} has dtype F64" in str(e) and (r == 1 or "[rank 1]" in str(e)), str(e)
assert all(not t.any() for t in ts3.values()), "a refused load wrote"
# Ranks given different replica policies (the plan can be the same): Internal on every rank.
ts4 = {k: torch.zeros_like(v) for k, v in ts.items()}
try:
    reshard.load(sys.argv[1], L, ts4, policies={"replicas": "first"} if r == 0 else None)
    raise SystemExit("no error for differing replica policies")
except reshard.Internal as e:
    assert "replica policy differs between ranks" in str(e), str(e)
assert all(not t.any() for t in ts4.values()), "a refused load wrote"
# Checks that only C++ made, or planning, failing on one rank: every rank raises, none waits for
# it (the peers used to sit in an all-gather until gloo's 30-minute timeout).
for pol in ({"replicas": "sometimes"}, {"memory_budget_bytes": 1000}, {"replica_atol": -1}, {"strict_missing": 1}):
    try:
        reshard.load(sys.argv[1], L, ts4, policies=pol if r == 1 else None)
        raise SystemExit(f"no error for {pol} on rank 1")
    except reshard.InvalidArgument as e:
        assert r == 1 or "rank 1" in str(e), str(e)
base = dict(name="t", num_layers=2, hidden=16, ffn=32, heads=4, query_groups=2, vocab=60, vocab_divisible_by=8,
            swiglu=True, tied_embeddings=True, param_dtype="f32")
L5 = reshard.derive_layout(dict(base, num_layers=4) if r == 1 else base, "tp=1,pp=2,dp=2,zero=1")
ts5 = reshard.allocate(L5, r, fill=0.0)
try:
    reshard.load(sys.argv[1], L5, ts5)
    raise SystemExit("no error for a model that differs on rank 1")
except reshard.Error as e:
    assert "rank 1" in str(e) and "not in the checkpoint" in str(e), str(e)
# A one-process target on a multi-rank communicator: refused on the rank that asked, at once.
if r == 0:
    L1 = reshard.derive_layout(base, "tp=1,pp=1,dp=1,zero=1")
    try:
        reshard.load(sys.argv[1], L1, reshard.allocate(L1, 0))
        raise SystemExit("no error for a world-size-1 target on 4 ranks")
    except reshard.InvalidArgument as e:
        assert "has world size 1 but the communicator has 4 ranks" in str(e), str(e)
print("OK", r, flush=True)
dist.destroy_process_group()
'''


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_torch_communicator_gloo(tmp_path):
    m = reshard.model_config(dict(name="t", num_layers=2, hidden=16, ffn=32, heads=4, query_groups=2, vocab=60,
                                  vocab_divisible_by=8, swiglu=True, tied_embeddings=True, param_dtype="f32"))
    reshard.synth_checkpoint(str(tmp_path / "ck"), m, "tp=2,pp=2,dp=1,zero=1", 3)
    script = tmp_path / "comm_check.py"
    script.write_text(COMM_CHECK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    r = subprocess.run(["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "4",
                        sys.executable, str(script), str(tmp_path / "ck")], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and r.stdout.count("OK") == 4, r.stdout[-2000:] + r.stderr[-4000:]


def test_live_tensor_and_argument_cases_get_clear_errors(tmp_path):
    """Each case raised nothing (or crashed) before: now a clear error before anything is written,
    or a correct load."""
    ck = str(tmp_path / "ck")
    reshard.synth_checkpoint(ck, reshard.model_config(TINY), "tp=2,pp=1,dp=1,zero=1", 5)
    L = reshard.derive_layout(reshard.open_checkpoint(ck).model, "tp=1,pp=1,dp=1,zero=1")
    # A tensor whose storage was shrunk (as FSDP frees parameters) was written past its memory.
    ts = reshard.allocate(L, 0, fill=0.0)
    name = max(ts, key=lambda k: ts[k].numel())
    ts[name].untyped_storage().resize_(16)
    with pytest.raises(reshard.InvalidArgument, match=f"tensor for buffer {name} needs .* its storage holds 16"):
        reshard.load(ck, L, ts)
    # step= or model= with an opened Checkpoint were ignored (the wrong step loaded silently).
    c = reshard.open_checkpoint(ck)
    for kw in ({"step": "step-1"}, {"model": "/nonexistent.yaml"}):
        with pytest.raises(reshard.InvalidArgument, match="apply when a path is opened"):
            reshard.load(c, L, reshard.allocate(L, 0), **kw)
        with pytest.raises(reshard.InvalidArgument, match="apply when a path is opened"):
            reshard.plan(c, "tp=1", **kw)
    # save(step=None) made a folder named "None".
    with pytest.raises(reshard.InvalidArgument, match="step must be the step folder's name"):
        reshard.save(str(tmp_path / "s"), None, L, reshard.allocate(L, 0, fill=0.0))
    assert not (tmp_path / "s").exists()
    # Writes through raw pointers now count as in-place writes for autograd, as the staged path's do.
    ts = reshard.allocate(L, 0, fill=1.0)
    w = next(t for k, t in ts.items() if k.startswith("fp32/")).requires_grad_()
    loss = (w * w).sum()  # saves w for backward
    reshard.load(ck, L, ts)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Tensors made under inference_mode load on the staged path (the one CUDA tensors take) too:
    # its copy into them failed after some were written.
    with torch.inference_mode():
        inf_ts = reshard.allocate(L, 0, fill=0.0)
    ref = reshard.allocate(L, 0, fill=0.0)
    reshard.load(ck, L, ref)
    reshard._STAGE_CPU_TENSORS_FOR_TESTS = True
    try:
        reshard.load(ck, L, inf_ts)
    finally:
        reshard._STAGE_CPU_TENSORS_FOR_TESTS = False
    assert all(torch.equal(inf_ts[k], ref[k]) for k in ref)


def test_values_that_do_not_fit_the_target_dtype_fail_the_load(tmp_path):
    """bf16 1e6 loaded into an f16 model came out as inf with every check passing."""
    import yaml
    with open(os.path.join(REPO, "configs", "models", "tiny-gpt.yaml")) as f:
        base = yaml.safe_load(f)
    L = reshard.derive_layout(base, "tp=1,dp=1,zero=1", weights_on_dp0_only=True)
    dt = {"BF16": torch.bfloat16, "F32": torch.float32}
    vals = [torch.full((b["numel"],), 1.0e6, dtype=dt[b["dtype"]]) for b in L.buffers]
    reshard.save_all_ranks(str(tmp_path / "ck"), "step-1", L, vals)
    L16 = reshard.derive_layout(dict(base, param_dtype="f16"), "tp=1,dp=1,zero=1")
    with pytest.raises(reshard.FailedPrecondition, match="does not fit in F16") as e:
        reshard.load(str(tmp_path / "ck"), L16, reshard.allocate(L16, 0, fill=0.0))
    assert "buffer weight/" in str(e.value)
    # Values that fit convert as before (bf16 -> f16 rounds to nearest).
    small = [torch.full((b["numel"],), 3.0, dtype=dt[b["dtype"]]) for b in L.buffers]
    reshard.save_all_ranks(str(tmp_path / "ck2"), "step-1", L, small)
    out = reshard.allocate(L16, 0, fill=0.0)
    reshard.load(str(tmp_path / "ck2"), L16, out)
    assert all(bool((t == 3).all()) for t in out.values())


def test_open_checkpoint_takes_the_model_as_a_value(tmp_path):
    """model= as a dict or ModelConfig (no file needed) is checked against what the checkpoint
    records exactly as a model file is; anything else is InvalidArgument naming the types."""
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, "tp=2,pp=1,dp=1,zero=1", 3)
    for given in (TINY, m):
        c = reshard.open_checkpoint(str(tmp_path), model=given)
        assert "the given model description agrees with the model the checkpoint records" in c.notes
    with pytest.raises(reshard.InvalidArgument, match="the given model description disagrees .*hidden 16 vs 32"):
        reshard.open_checkpoint(str(tmp_path), model=dict(TINY, hidden=32))
    with pytest.raises(reshard.InvalidArgument, match="model must be a path, a dict of model keys or a ModelConfig"):
        reshard.open_checkpoint(str(tmp_path), model=7)
