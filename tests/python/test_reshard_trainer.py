"""reshard inside the reference Megatron-DeepSpeed trainer (real DeepSpeed, ZeRO-1, gloo, mpirun).

One source run (tp=2,pp=2,dp=2, tied embeddings, 4 iterations, saving at 3 and 4 in DeepSpeed's
format and reshard's native one, with state dumps) feeds:
  * same layout: reshard_load equals DeepSpeed's own load_checkpoint bitwise (every module weight,
    fp32 partition, exp_avg, exp_avg_sq, step, iteration, consumed samples) and gives the same
    logits on a fixed batch;
  * tp=1,pp=2,dp=4 and tp=4,pp=1,dp=2: the consolidated state equals the source's bitwise; the
    logits match; step is restored, not incremented, and the first update after resume equals
    iteration 4 of the uninterrupted run (failures.md B06, B08, B13, B04);
4 layers over pp=3 (DeepSpeed's uneven split) as a target through the hook and as a source;
a GQA + SwiGLU + untied model goes tp=2,pp=2 -> tp=4,pp=1 (B08, B12, B13); a bf16 run
(DeepSpeed's BF16_Optimizer) goes tp=2,pp=2 -> tp=1,pp=2,dp=2; and the plain DeepSpeedEngine
(--no-pipeline) is filled under ZeRO-3, ZeRO-2 and ZeRO-0: ZeRO-3 dp=4 -> ZeRO-3 dp=3 and -> a
tp=2,pp=2 pipeline, ZeRO-3 tp=2,dp=2 -> ZeRO-1 tp=1,pp=2,dp=2, ZeRO-2 dp=2 -> ZeRO-3 dp=4, fp16
ZeRO-0 tp=2 (FP16_UnfusedOptimizer with torch AdamW, FP16_Optimizer with DeepSpeed's FusedAdam) ->
fp16 ZeRO-1 and ZeRO-0 at dp=2 with the loss scaler's position, ZeRO-2 dp=2 -> fp32 ZeRO-0 tp=2 (the torch optimizer) and its files into a pipeline; bad
ZeRO-3 inputs (a missing optimizer file, a short partition, another model) and the engines reshard
does not fill (a load inside GatheredParameters, optimizer offload) fail on every rank by name
with nothing written.
Each job starts live state scrambled to NaN, so every element must be written by the load.
About 12 minutes on 2 cores (8-rank jobs are mostly start-up).
"""

import json
import os
import shutil
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the reference trainer (integration/); reshard is the installed package
reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")
pytest.importorskip("deepspeed")
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found", allow_module_level=True)

from integration.megatron_deepspeed import model as M  # noqa: E402
from integration.megatron_deepspeed.launch import mpirun_module  # noqa: E402
from integration.megatron_deepspeed.reshard_hook import model_config_dict  # noqa: E402
from integration.megatron_deepspeed.state_dump import consolidate, gather_logits, load_dump  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32", "--micro-batch", "2",
         "--global-batch", "8"]
GQA = ["--query-groups", "4", "--swiglu", "--untied"]
KINDS = ("weight", "fp32", "exp_avg", "exp_avg_sq")


def job(tmp, name, tp, pp, dp, extra, model=MODEL, timeout=400):
    log = os.path.join(tmp, f"{name}.json")
    r, cmd = mpirun_module("state_dump", tp, pp, dp, ["--log-json", log, "--quiet"] + model + list(extra), timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-6000:]}"
    if os.path.exists(log):
        with open(log) as f:
            return {s["step"]: s["loss"] for s in json.load(f)["steps"]}
    return {}


def cfg_dict(extra=()):
    swiglu, untied, groups = "--swiglu" in extra, "--untied" in extra, 8
    if "--query-groups" in extra:
        groups = int(extra[list(extra).index("--query-groups") + 1])
    return model_config_dict(M.GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=groups,
                                         ffn_hidden_size=128, swiglu=swiglu, tied=not untied, seq_length=32))


def assert_same_consolidated(a, b, what):
    for k in KINDS:
        assert set(a[k]) == set(b[k]), (what, k, set(a[k]) ^ set(b[k]))
        for n in a[k]:
            assert not torch.isnan(b[k][n]).any(), (what, k, n, "not written")
            assert torch.equal(a[k][n], b[k][n]), (what, k, n, float((a[k][n] - b[k][n]).abs().max()))
    assert a["step"] == b["step"], (what, a["step"], b["step"])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("src"))
    losses = job(tmp, "source", 2, 2, 2, ["--dump-dir", f"{tmp}/dump", "--dump-at-save", "--eval", "--save",
                                          f"{tmp}/ds", "--save-native", f"{tmp}/native", "--save-interval", "3",
                                          "--steps", "4"])
    return {"tmp": tmp, "losses": losses, "cfg": cfg_dict()}


def ds_readable(tmp):
    try:
        reshard.inspect(f"{tmp}/ds", step=3, model=model_yaml(tmp))
        return True
    except reshard.Unsupported:
        return False


def model_yaml(tmp, extra=()):
    import yaml
    path = os.path.join(tmp, "model.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg_dict(extra), f)
    return path


def test_same_layout_equals_deepspeed_load(source):
    """reshard reads DeepSpeed's own folder (the native one if this build has no DeepSpeed reader)."""
    tmp = source["tmp"]
    root = f"{tmp}/ds" if ds_readable(tmp) else f"{tmp}/native"
    job(tmp, "same", 2, 2, 2, ["--dump-dir", f"{tmp}/same", "--scramble", "--eval", "--load", root,
                               "--load-with", "reshard", "--load-step", "3", "--deepspeed-load", f"{tmp}/ds",
                               "--deepspeed-tag", "global_step3", "--exit-after-load"])
    ours, theirs = load_dump(f"{tmp}/same/load"), load_dump(f"{tmp}/same/deepspeed")
    assert len(ours) == len(theirs) == 8
    for r, (x, y) in enumerate(zip(ours, theirs)):
        for n, w in y["weight"].items():
            if n in y["dead"]:  # the last stage's unused position-embedding copy (reshard_hook docstring)
                continue
            assert torch.equal(x["weight"][n], w), (r, n)
        dead = [(off, n) for name, off, n in y["groups"][0]["entries"] if name in y["dead"]]
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            for g, (u, v) in enumerate(zip(x[k], y[k])):
                keep = torch.ones(v.numel(), dtype=torch.bool)
                if g == 0:
                    P, lo = y["groups"][0]["partition_size"], y["dp_rank"] * y["groups"][0]["partition_size"]
                    for off, n in dead:
                        a, b = max(off - lo, 0), min(off + n - lo, P)
                        if a < b:
                            keep[a:b] = False
                assert torch.equal(u[keep], v[keep]), (r, k, g)
        assert x["step"] == y["step"] == [3.0, 3.0], (r, x["step"], y["step"])
        assert (x["iteration"], x["consumed"], x["global_steps"], x["global_samples"]) == (3, 24, 3, 24)
        assert (y["iteration"], y["consumed"]) == (3, 24)
        assert x["eval_loss"] == y["eval_loss"], (r, x["eval_loss"], y["eval_loss"])
    assert torch.equal(gather_logits(ours), gather_logits(theirs))
    # DeepSpeed's load restores exactly what was saved (the source's own state at iteration 3).
    assert_same_consolidated(consolidate(f"{tmp}/dump/it3", source["cfg"]), consolidate(ours, source["cfg"]), "same")


@pytest.mark.parametrize("tp,pp,dp,fmt", [(1, 2, 4, "ds"), (4, 1, 2, "native")])
def test_layout_change_then_first_update(source, tp, pp, dp, fmt):
    tmp, cfg = source["tmp"], source["cfg"]
    name = f"t{tp}p{pp}d{dp}"
    if fmt == "ds" and not ds_readable(tmp):
        fmt = "native"
    losses = job(tmp, name, tp, pp, dp, ["--dump-dir", f"{tmp}/{name}", "--scramble", "--eval", "--load",
                                         f"{tmp}/{fmt}", "--load-with", "reshard", "--load-step", "3",
                                         "--dump-at-save", "--save", f"{tmp}/{name}_ds", "--steps", "4"])
    src3 = consolidate(f"{tmp}/dump/it3", cfg)
    got = consolidate(f"{tmp}/{name}/load", cfg)
    assert_same_consolidated(src3, got, name)  # bitwise, every tensor and state kind
    assert got["global_steps"] == [3] and got["global_samples"] == [24]
    assert not {k: v for k, v in got["replica_diffs"].items() if v > 0}
    # Forward parity on a fixed batch (fp32; reduction order differs with tp).
    src_dump, dst_dump = load_dump(f"{tmp}/dump/it3"), load_dump(f"{tmp}/{name}/load")
    src_loss = src_dump[0]["eval_loss"]
    assert abs(dst_dump[0]["eval_loss"] - src_loss) <= 1e-5 * abs(src_loss)
    torch.testing.assert_close(gather_logits(dst_dump), gather_logits(src_dump), rtol=1e-5, atol=1e-5)
    # Step restored, not incremented; the first update after resume equals iteration 4 uninterrupted.
    assert got["step"] == [3.0]
    assert abs(losses[4] - source["losses"][4]) <= 1e-5 * abs(source["losses"][4]), (losses, source["losses"])
    after = consolidate(f"{tmp}/{name}/it4", cfg)
    ref4 = consolidate(f"{tmp}/dump/it4", cfg)
    assert after["step"] == ref4["step"] == [4.0]
    for k in ("fp32", "exp_avg", "exp_avg_sq"):
        for n in ref4[k]:
            torch.testing.assert_close(after[k][n], ref4[k][n], rtol=1e-4, atol=1e-6, msg=f"{name} {k} {n}")


def test_uneven_pipeline_stages_both_ways(source, tmp_path):
    """4 layers over pp=3: DeepSpeed's PipelineModule splits them unevenly (partition_method
    type:transformer) and trains it; reshard used to refuse such a target ("num_layers=4 is not
    divisible by pp*vpp=3"), although the live engine says where each layer is.
    Into it: tp=2,pp=2,dp=2 -> tp=1,pp=3,dp=2 through the hook, bitwise, then one update equal to
    the uninterrupted run's. Out of it: that job's own DeepSpeed save (uneven stages as the source)
    read into one rank's full tensors, bitwise equal to what the job held when it saved."""
    tmp, cfg = source["tmp"], source["cfg"]
    if not ds_readable(tmp):
        pytest.skip("this build has no DeepSpeed reader")
    out = str(tmp_path)
    losses = job(out, "t1p3d2", 1, 3, 2, ["--dump-dir", f"{out}/dst", "--scramble", "--load", f"{tmp}/ds",
                                          "--load-with", "reshard", "--load-step", "3", "--dump-at-save",
                                          "--save", f"{out}/ds", "--save-native", f"{out}/native", "--steps", "4"])
    dumps = load_dump(f"{out}/dst/load")
    # Every element of every rank written (consolidate reads weights of dp rank 0 only).
    for d in dumps:
        for k in KINDS:
            vals = d[k].values() if isinstance(d[k], dict) else d[k]
            for v in vals:
                assert v is not None and not torch.isnan(v.float()).any(), (d["stage"], d["tp_rank"], d["dp_rank"], k)
    per_stage = {d["stage"]: sorted({n.split(".")[1] for n in d["weight"] if n.startswith("layers.")})
                 for d in dumps}
    assert sorted(len(v) for v in per_stage.values()) == [1, 1, 2], per_stage  # really uneven
    assert_same_consolidated(consolidate(f"{tmp}/dump/it3", cfg), consolidate(dumps, cfg), "pp=3 target")
    assert abs(losses[4] - source["losses"][4]) <= 1e-5 * abs(source["losses"][4]), (losses, source["losses"])
    # The uneven saves (DeepSpeed's and reshard's native one) as sources: every value of the job
    # at iteration 4, into one rank's ZeRO-0 buffers.
    held = consolidate(f"{out}/dst/it4", cfg)
    model = model_yaml(out)
    L = reshard.derive_layout(reshard.model_config(model), "tp=1,pp=1,dp=1,zero=0")
    for fmt in ("ds", "native"):
        assert reshard.inspect(f"{out}/{fmt}", model=model)["layout"].startswith("tp=1,pp=3,"), fmt
        live = reshard.allocate(L, 0, fill=float("nan"))
        reshard.load(f"{out}/{fmt}", L, live, model=model)
        for k in KINDS:
            for n, want in held[k].items():
                got = live[f"{k}/{n}"]
                assert torch.equal(got.reshape(want.shape).float(), want), (fmt, k, n)


def test_gqa_swiglu_untied_tp2pp2_to_tp4pp1(tmp_path):
    tmp = str(tmp_path)
    cfg = cfg_dict(GQA)
    job(tmp, "src", 2, 2, 1, ["--dump-dir", f"{tmp}/src", "--dump-at-save", "--eval", "--save", f"{tmp}/ds",
                              "--save-native", f"{tmp}/native", "--no-deepspeed-save", "--steps", "2"], model=MODEL + GQA)
    job(tmp, "dst", 4, 1, 1, ["--dump-dir", f"{tmp}/dst", "--scramble", "--eval", "--load", f"{tmp}/native",
                              "--load-with", "reshard", "--exit-after-load"], model=MODEL + GQA)
    assert_same_consolidated(consolidate(f"{tmp}/src/it2", cfg), consolidate(f"{tmp}/dst/load", cfg), "gqa")
    a, b = load_dump(f"{tmp}/src/it2"), load_dump(f"{tmp}/dst/load")
    assert abs(a[0]["eval_loss"] - b[0]["eval_loss"]) <= 1e-5 * abs(a[0]["eval_loss"])
    torch.testing.assert_close(gather_logits(b), gather_logits(a), rtol=1e-5, atol=1e-5)


def test_deepspeed_tp_replica_divergence(source, tmp_path):
    """failures.md B10 on a real DeepSpeed folder: one LayerNorm value changed in the tp rank 1 layer
    file. 'error' raises DataLoss naming the tensor and max |diff| before any write; 'first' loads tp
    rank 0's copy; 'average' the mean of both copies."""
    tmp = source["tmp"]
    if not ds_readable(tmp):
        pytest.skip("this build has no DeepSpeed reader")
    ds = tmp_path / "ds"
    shutil.copytree(f"{tmp}/ds", ds)
    layer = ds / "global_step3" / "layer_02-model_01-model_states.pt"  # spec 2 = layer 0, tp rank 1
    sd = torch.load(layer, weights_only=False)
    original = sd["input_layernorm.weight"][5].item()
    sd["input_layernorm.weight"][5] += 0.25
    torch.save(sd, layer)
    model = model_yaml(str(tmp_path))
    L = reshard.derive_layout(reshard.model_config(model), "tp=1,pp=1,dp=1,zero=1")
    live = {b["name"]: torch.zeros(b["numel"]) for b in L.buffers}
    with pytest.raises(reshard.DataLoss, match=r"layers\.0\.input_layernorm\.weight.*max \|diff\| 0\.25"):
        reshard.load(str(ds), L, live, step=3, model=model)
    assert all(not t.any() for t in live.values()), "a tensor was written although the load failed"
    rep = reshard.load(str(ds), L, live, step=3, model=model, policies={"replicas": "first"})
    w = live["weight/layers.0.input_layernorm.weight"]
    assert w[5].item() == original
    assert torch.equal(w, consolidate(f"{tmp}/dump/it3", source["cfg"])["weight"]["layers.0.input_layernorm.weight"])
    assert any("layers.0.input_layernorm.weight" in s for s in rep["replica_report"])
    # 'average': element 5 is the mean of the two tp copies (rounded once to fp32), the rest as saved.
    first = w.clone()
    rep = reshard.load(str(ds), L, live, step=3, model=model, policies={"replicas": "average"})
    want = ((torch.tensor(original, dtype=torch.float64) + sd["input_layernorm.weight"][5].double()) / 2).float()
    assert w[5].item() == want.item() != original
    assert torch.equal(w[:5], first[:5]) and torch.equal(w[6:], first[6:])
    assert any("layers.0.input_layernorm.weight" in s for s in rep["replica_report"])


def test_bf16_optimizer_tp2pp2_to_tp1pp2dp2(tmp_path):
    """bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, not the ZeRO-1
    optimizer: reshard_load fills it in place from its own DeepSpeed checkpoint and from the
    native one, at a new layout, bitwise for every state kind."""
    tmp = str(tmp_path)
    cfg = cfg_dict()
    job(tmp, "src", 2, 2, 1, ["--bf16", "--dump-dir", f"{tmp}/src", "--dump-at-save", "--eval", "--save", f"{tmp}/ds",
                              "--save-native", f"{tmp}/native", "--steps", "2"])
    assert reshard.inspect(f"{tmp}/ds")["writer"] == "deepspeed-bf16"
    a = consolidate(f"{tmp}/src/it2", cfg)
    for fmt in ("ds", "native"):
        job(tmp, f"dst_{fmt}", 1, 2, 2, ["--bf16", "--dump-dir", f"{tmp}/dst_{fmt}", "--scramble", "--eval", "--load",
                                         f"{tmp}/{fmt}", "--load-with", "reshard", "--exit-after-load"])
        assert_same_consolidated(a, consolidate(f"{tmp}/dst_{fmt}/load", cfg), f"bf16 {fmt}")
        la, lb = load_dump(f"{tmp}/src/it2")[0]["eval_loss"], load_dump(f"{tmp}/dst_{fmt}/load")[0]["eval_loss"]
        assert abs(la - lb) <= 1e-3 * abs(la), (fmt, la, lb)  # bf16 matmuls split differently at tp=1


# The plain DeepSpeedEngine (--no-pipeline) with ZeRO-2 and ZeRO-3. A global batch of 24 divides
# by micro batch 2 at dp 1, 2, 3 and 4.
PLAIN = MODEL[:-1] + ["24"]


def plain_source(tmp, tp, dp, zero, extra=()):
    losses = job(tmp, "src", tp, 1, dp, ["--no-pipeline", "--zero", str(zero)] + list(extra) + ["--dump-dir", f"{tmp}/src",
                                         "--dump-at-save", "--save", f"{tmp}/ds", "--save-native", f"{tmp}/native",
                                         "--save-interval", "3", "--steps", "4"], model=PLAIN)
    return losses


def resume_from_iteration3(tmp, src_losses, name, tp, pp, dp, zero, fmt, plain, extra=(), step=3.0, rtol=1e-6):
    """Loads the source's iteration 3 into a scrambled engine: its consolidated state must equal the
    source's bitwise, its optimizer step be ``step``, and its step 4 loss the uninterrupted run's
    within ``rtol`` relative (1e-6: fp32). Returns the load's dumps."""
    losses = job(tmp, name, tp, pp, dp, (["--no-pipeline"] if plain else []) + list(extra) + [
        "--zero", str(zero), "--dump-dir", f"{tmp}/{name}", "--scramble", "--load", f"{tmp}/{fmt}", "--load-with",
        "reshard", "--load-step", "3", "--dump-at-save", "--save", f"{tmp}/{name}_ds", "--steps", "4"], model=PLAIN)
    cfg = cfg_dict()
    got = consolidate(f"{tmp}/{name}/load", cfg)
    assert_same_consolidated(consolidate(f"{tmp}/src/it3", cfg), got, name)
    assert got["step"] == [step] and got["global_steps"] == [3] and got["global_samples"] == [72]
    assert abs(losses[4] - src_losses[4]) <= rtol * abs(src_losses[4]), (name, losses, src_losses)
    return load_dump(f"{tmp}/{name}/load")


@pytest.fixture(scope="module")
def zero3_dp4(tmp_path_factory):
    """A ZeRO-3 dp=4 run of the plain engine, saved at iterations 3 and 4 (DeepSpeed and native)."""
    tmp = str(tmp_path_factory.mktemp("zero3"))
    return tmp, plain_source(tmp, 1, 4, 3)


def test_zero3_dp4_to_zero3_dp3_and_to_a_pipeline(zero3_dp4, tmp_path):
    """DeepSpeed itself refuses a ZeRO-3 load at another dp size."""
    tmp, src = zero3_dp4
    resume_from_iteration3(tmp, src, "z3d3", 1, 1, 3, 3, "ds", True)
    resume_from_iteration3(tmp, src, "pipe", 2, 2, 1, 1, "native", False)


def failing_load(tmp, name, tp, dp, zero, load, model=PLAIN, extra=(), refused_engine=False):
    """A plain-engine job whose reshard load must fail: returns each rank's error text, after
    checking that every rank failed and that no live tensor changed (the dumps before and after).
    ``refused_engine``: the engine itself is refused (its view cannot even be dumped), so the
    load never starts."""
    log = os.path.join(tmp, f"{name}.json")
    r, cmd = mpirun_module("state_dump", tp, 1, dp, [
        "--log-json", log, "--quiet", "--no-pipeline", "--zero", str(zero), "--dump-dir", f"{tmp}/{name}",
        "--dump-on-error", "--load", load, "--load-with", "reshard", "--steps", "4"] + list(extra) + model, 400)
    assert r.returncode == 3, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    errors = []
    for rank in range(tp * dp):
        path = f"{tmp}/{name}/error-rank{rank}.txt"
        assert os.path.exists(path), (rank, r.stdout[-2000:], r.stderr[-4000:])
        with open(path) as f:
            errors.append(f.read())
    if refused_engine:
        assert not os.path.exists(f"{tmp}/{name}/before")
        return errors
    before, after = load_dump(f"{tmp}/{name}/before"), load_dump(f"{tmp}/{name}/after")
    assert len(before) == len(after) == tp * dp
    for b, a in zip(before, after):
        key = "weight_parts" if b.get("zero") == 3 else "weight"  # ZeRO-3: this rank's partitions
        for n in b[key]:
            assert torch.equal(b[key][n], a[key][n]), (name, key, n, "written by a failed load")
        for x, y in zip(b["fp32"], a["fp32"]):
            assert torch.equal(x, y), (name, "fp32 written by a failed load")
        assert a["step"] == b["step"] and a["loss_scaler"] == b["loss_scaler"]
    return errors


def test_zero3_bad_inputs_fail_on_every_rank_and_write_nothing(zero3_dp4, tmp_path):
    """A ZeRO-3 checkpoint missing one rank's optimizer file, one whose partition holds one element
    too few, and a live engine built with another model: each a named error on every rank, and no
    live tensor written."""
    src, _ = zero3_dp4
    tmp = str(tmp_path)

    def copy_of(name):
        shutil.copytree(f"{src}/ds", f"{tmp}/{name}")
        return f"{tmp}/{name}/global_step4"

    gone = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.remove(os.path.join(copy_of("missing"), gone))
    for e in failing_load(tmp, "missing", 1, 3, 3, f"{tmp}/missing"):
        assert gone in e and "DataLoss" in e, e

    short = "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    path = os.path.join(copy_of("short"), short)
    sd = torch.load(path, weights_only=False)  # a file this test made with DeepSpeed
    osd = sd["optimizer_state_dict"]
    osd["fp32_flat_groups"][0] = osd["fp32_flat_groups"][0][:-1].clone()
    for k in ("exp_avg", "exp_avg_sq"):
        osd["optimizer_state_dict"]["state"][0][k] = osd["optimizer_state_dict"]["state"][0][k][:-1].clone()
    torch.save(sd, path)
    for e in failing_load(tmp, "short", 1, 3, 3, f"{tmp}/short"):
        assert short in e and "elements" in e, e

    other = PLAIN[:PLAIN.index("--ffn") + 1] + ["96"] + PLAIN[PLAIN.index("--ffn") + 2:]
    for e in failing_load(tmp, "other", 1, 2, 3, f"{src}/ds", model=other):
        assert "ffn" in e and "96" in e and "128" in e, e


def test_gathered_zero3_parameters_and_offload_are_refused_by_name(zero3_dp4, tmp_path):
    """The engines reshard does not fill: a load inside GatheredParameters (its partitions would
    be filled and the gathered copies left stale) is FailedPrecondition naming a parameter, with
    nothing written; optimizer offload at ZeRO-3 and ZeRO-2 is Unsupported, refused before the
    load starts."""
    src, _ = zero3_dp4
    tmp = str(tmp_path)
    # Threshold 0: no parameter is persistent (kept gathered by design), as in a large model.
    for e in failing_load(tmp, "gathered", 1, 2, 3, f"{src}/ds",
                          extra=["--load-gathered", "--param-persistence-threshold", "0"]):
        assert e.startswith("FailedPrecondition") and "is gathered" in e and "language_model." in e, e
    for zero in (3, 2):
        for e in failing_load(tmp, f"offload{zero}", 1, 2, zero, f"{src}/ds", extra=["--offload-optimizer"],
                              refused_engine=True):
            assert e.startswith("Unsupported") and f"ZeRO-{zero} with offload_optimizer" in e, e


FP16 = ["--fp16", "--initial-scale-power", "8"]


@pytest.mark.parametrize("optimizer,wrapper", [("adamw", "FP16_UnfusedOptimizer"), ("fused-adam", "FP16_Optimizer")])
def test_fp16_zero0_tp2_to_fp16_zero1_dp2_with_the_loss_scale(tmp_path, optimizer, wrapper):
    """fp16 at ZeRO-0 runs DeepSpeed's FP16_UnfusedOptimizer around torch AdamW (one fp32 copy per
    parameter) and FP16_Optimizer around its FusedAdam (one flat fp32 copy per group): their state
    lies in the mp_rank files' `optimizer`, and their torch optimizer is one step ahead of the
    engine (stepped once with zero gradients when built). Into fp16 ZeRO-1 at dp=2 from the
    DeepSpeed files and into fp16 ZeRO-0 at dp=2 from the native ones: every state kind bitwise,
    the step and the loss scaler's position carried (the targets start at another initial scale),
    the next loss the uninterrupted run's (fp16: within 1e-5 relative, the tp change regroups fp16
    sums)."""
    tmp = str(tmp_path)
    opt = ["--optimizer", optimizer]
    src = job(tmp, "src", 2, 1, 1, ["--no-pipeline", "--zero", "0"] + FP16 + opt + [
        "--dump-dir", f"{tmp}/src", "--dump-at-save", "--save", f"{tmp}/ds", "--save-native", f"{tmp}/native",
        "--save-interval", "3", "--steps", "4"], model=PLAIN)
    info = reshard.inspect(f"{tmp}/ds", step=3)
    assert info["writer"] == "deepspeed-zero0-fp16" and any(wrapper + "'s state" in n for n in info["notes"])
    saved = load_dump(f"{tmp}/src/it3")[0]["loss_scaler"]
    assert saved["cur_scale"] == 256.0 and saved["cur_iter"] == 3, saved
    target = ["--fp16", "--initial-scale-power", "12"] + opt
    for name, zero, fmt in (("z1", 1, "ds"), ("z0", 0, "native")):
        dumps = resume_from_iteration3(tmp, src, name, 1, 1, 2, zero, fmt, True, extra=target, step=4.0, rtol=1e-5)
        for d in dumps:
            got = d["loss_scaler"]
            assert {k: got[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter")} == \
                {k: saved[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter")}, (name, got, saved)

    if optimizer != "adamw":
        return
    # The saved moments are numbered, not named: the fp32 copies of two same-shaped weights
    # swapped (what param groups in another order give) and groups that are not Megatron's are
    # refused at open, naming the tensor or the groups.
    for case, error, match in (("swapped", reshard.DataLoss, "fp32 copy of layers.0.self_attention.query_key_value"),
                               ("groups", reshard.Unsupported, "param groups are not Megatron.s")):
        step = f"{tmp}/bad_{case}/global_step3"
        shutil.copytree(f"{tmp}/ds/global_step3", step)
        path = f"{step}/mp_rank_00_model_states.pt"
        sd = torch.load(path, weights_only=False)  # a file this test made with DeepSpeed
        o = sd["optimizer"]
        if case == "swapped":  # group 0 in module order: word, position, then 4 weights per layer
            g = o["fp32_groups"][0]
            g[2], g[6] = g[6], g[2]
        else:
            for pg in o["optimizer_state_dict"]["param_groups"]:
                pg["weight_decay"] = 0.0
                pg.pop("wd_mult", None)
        torch.save(sd, path)
        with pytest.raises(error, match=match):
            reshard.open_checkpoint(step)


def test_zero2_dp2_to_zero0_tp2_then_its_files_into_a_pipeline(tmp_path):
    """fp32 ZeRO-0 runs the torch optimizer itself (the module weights are the master): filled from
    a ZeRO-2 dp=2 checkpoint, then its own DeepSpeed files (the torch optimizer's state_dict under
    `optimizer`) loaded into a ZeRO-1 tp=1,pp=2 pipeline, bitwise."""
    tmp = str(tmp_path)
    resume_from_iteration3(tmp, plain_source(tmp, 1, 2, 2), "z0", 2, 1, 1, 0, "ds", True)
    assert reshard.inspect(f"{tmp}/z0_ds")["writer"] == "deepspeed-zero0"
    job(tmp, "pipe", 1, 2, 1, ["--zero", "1", "--dump-dir", f"{tmp}/pipe", "--scramble", "--load", f"{tmp}/z0_ds",
                               "--load-with", "reshard", "--exit-after-load"], model=PLAIN)
    cfg = cfg_dict()
    got = consolidate(f"{tmp}/pipe/load", cfg)
    assert_same_consolidated(consolidate(f"{tmp}/z0/it4", cfg), got, "ZeRO-0 files into a pipeline")
    assert got["step"] == [4.0] and got["global_steps"] == [4]


def test_zero3_tp2dp2_to_zero1_pipeline_tp1pp2dp2(tmp_path):
    tmp = str(tmp_path)
    resume_from_iteration3(tmp, plain_source(tmp, 2, 2, 3), "pipe", 1, 2, 2, 1, "ds", False)


def test_zero2_dp2_to_zero3_dp4(tmp_path):
    """With round_robin_gradients (the flat buffer reordered over dp; DeepSpeed's own
    param_slice_mappings then disagree with it) and contiguous_gradients off."""
    tmp = str(tmp_path)
    src = plain_source(tmp, 1, 2, 2, extra=["--round-robin-gradients", "--no-contiguous-gradients"])
    assert any("round_robin_gradients" in n for n in reshard.inspect(f"{tmp}/ds", step=3)["notes"])
    # No persistent parameters in the target (threshold 0): every weight lives only in its
    # ds_tensor partitions, as in a large model (the other ZeRO-3 targets keep DeepSpeed's
    # default, under which every parameter of this small model stays gathered).
    resume_from_iteration3(tmp, src, "z3d4", 1, 1, 4, 3, "ds", True, extra=["--param-persistence-threshold", "0"])
