"""Reference trainer (integration/megatron_deepspeed) checks with real DeepSpeed on CPU.

    .venv/bin/python -m pytest -m reference_trainer tests/python/test_reference_trainer.py

Runs in ~3-4 minutes on 2 cores (mpirun, oversubscribed). Set RESHARD_ALL_CHECKPOINT_CASES=1 to let
the make_checkpoints test generate every case (~5 minutes more).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

pytestmark = pytest.mark.reference_trainer


def _have_deepspeed():
    try:
        import deepspeed  # noqa: F401
        return True
    except Exception:
        return False


if not _have_deepspeed():
    pytest.skip("deepspeed not importable", allow_module_level=True)
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found", allow_module_level=True)
if not os.path.isfile("/usr/share/games/fortunes/fortunes"):
    pytest.skip("fortunes corpus missing (apt-get install fortunes-min fortunes)", allow_module_level=True)

import torch  # noqa: E402

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32",
         "--micro-batch", "2", "--global-batch", "8"]


from integration.megatron_deepspeed.launch import cleanup_shm, free_port  # noqa: E402


def _shm_of(port):
    """Files in /dev/shm whose name holds the job's rendezvous port (DeepSpeed's CPU allreduce
    buffers are named ..._<addr>_<port>_<rank>)."""
    return [f for f in os.listdir("/dev/shm") if f"_{port}_" in f] if os.path.isdir("/dev/shm") else []


def train(tmp_path, name, tp, pp, dp, extra=(), timeout=300):
    """Run the trainer under mpirun; return the per-step losses (list of floats)."""
    log = tmp_path / f"{name}.json"
    world = tp * pp * dp
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(world), sys.executable,
           "-m", "integration.megatron_deepspeed.train", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
           "--log-json", str(log), "--quiet"] + MODEL + list(extra)
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        left = _shm_of(port)
    finally:
        cleanup_shm(port)
    assert r.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-5000:]}"
    # DeepSpeed never unlinks its shm allreduce buffers (69 MB per rank); the trainer's ranks do.
    assert left == [], left
    with open(log) as f:
        return json.load(f)["steps"]


def _assert_close(a, b, rel=1e-5):
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b):
        assert x["step"] == y["step"]
        assert abs(x["loss"] - y["loss"]) <= rel * abs(y["loss"]), (x, y)


def test_loss_parity_tp2_pp2_dp2(tmp_path):
    ref = train(tmp_path, "t1p1d1", 1, 1, 1, ["--steps", "5"])
    par = train(tmp_path, "t2p2d2", 2, 2, 2, ["--steps", "5"])
    assert [s["step"] for s in ref] == [1, 2, 3, 4, 5]
    assert ref[-1]["loss"] < ref[0]["loss"]  # it learns
    _assert_close(par, ref)


def test_loss_parity_tp2_dp2_gqa_swiglu(tmp_path):
    extra = ["--steps", "5", "--query-groups", "4", "--swiglu", "--untied"]
    ref = train(tmp_path, "t1p1d1_gqa", 1, 1, 1, extra)
    par = train(tmp_path, "t2p1d2_gqa", 2, 1, 2, extra)
    _assert_close(par, ref)


def test_resume_parity_deepspeed_load(tmp_path):
    """DeepSpeed's own same-layout load_checkpoint continues with the uninterrupted losses."""
    full = train(tmp_path, "full", 1, 2, 1, ["--steps", "5"])
    ck = tmp_path / "ck"
    first = train(tmp_path, "first", 1, 2, 1, ["--steps", "3", "--save", str(ck)])
    assert (ck / "latest").read_text() == "global_step3"
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = train(tmp_path, "resumed", 1, 2, 1, ["--steps", "5", "--load", str(ck)])
    assert [s["step"] for s in resumed] == [4, 5]
    _assert_close(first, full[:3], rel=0)
    _assert_close(resumed, full[3:], rel=1e-6)


def test_make_checkpoints(tmp_path):
    from integration.megatron_deepspeed import make_checkpoints as mc
    cases = ["pipe_pp1_tp1_dp2_z1_fp32", "pipe_pp1_tp2_dp2_z1_fp32", "pipe_pp1_tp1_dp2_z1_bf16_zeroopt",
             "plain_dp2_z3_fp32"]
    if os.environ.get("RESHARD_ALL_CHECKPOINT_CASES") == "1":
        cases = list(mc.CASES)
    root = tmp_path / "ckpts"
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "integration.megatron_deepspeed.make_checkpoints", str(root), "--cases", ",".join(cases)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        # A DeepSpeed run on CPU can die outside the code under test: seen here as SIGABRT with
        # "terminate called without an active exception" at the end of a ZeRO-3 job on the loaded
        # 2-core machine. Print why, then try the set once more, as make_deepspeed_fixtures.sh does.
        print(r.stdout[-2000:])
        for f in sorted((root / "logs").glob("*.train.err.log")):
            tail = f.read_text(errors="replace").strip().splitlines()[-6:]
            print(f"--- {f.name}:", *tail, sep="\n")
        shutil.rmtree(root)
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    man = json.loads((root / "manifest.json").read_text())
    assert set(cases) <= set(man["cases"])

    def files(case):
        return {f["path"] for f in man["cases"][case]["files"]}

    def load(case, rel):
        return torch.load(root / case / rel, map_location="cpu", weights_only=False)

    # --- ZeRO-1 pipeline, tp=1 pp=1 dp=2, fp32
    c = "pipe_pp1_tp1_dp2_z1_fp32"
    fs = files(c)
    for f in ["latest", "latest_checkpointed_iteration.txt", "global_step3/mp_rank_00_model_states.pt",
              "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"] + \
            [f"global_step3/layer_{i:02d}-model_00-model_states.pt" for i in range(1, 7)]:
        assert f in fs, (f, sorted(fs))
    assert not any("layer_07" in f for f in fs)  # the tied head writes no file
    ms = load(c, "global_step3/mp_rank_00_model_states.pt")
    assert ms["module"] is None
    assert ms["checkpoint_version"] == 3.0 and ms["iteration"] == 3
    assert ms["mp_world_size"] == 1 and ms["dp_world_size"] == 2
    a = ms["args"]
    assert (a.padded_vocab_size, a.num_layers, a.hidden_size, a.num_attention_heads) == (256, 4, 64, 8)
    assert a.tensor_model_parallel_size == 1 and a.pipeline_model_parallel_size == 1
    assert a.params_dtype == torch.float32 and a.consumed_train_samples == 24
    uci = ms["universal_checkpoint_info"]
    assert uci["universal_checkpoint_version"] == 0.2 and uci["original_vocab_size"] == 256
    shapes = {}
    for g in ms["param_shapes"]:
        shapes.update(g)
    assert len(ms["param_shapes"]) == 2  # Megatron param groups: decay / no decay
    assert shapes["tied_modules.embed.word_embeddings.weight"] == torch.Size([256, 64])
    assert shapes["tied_modules.embed.position_embeddings.weight"] == torch.Size([32, 64])
    assert shapes["2.self_attention.query_key_value.weight"] == torch.Size([192, 64])
    assert shapes["2.self_attention.dense.weight"] == torch.Size([64, 64])
    assert shapes["5.mlp.dense_h_to_4h.weight"] == torch.Size([128, 64])
    assert shapes["5.mlp.dense_4h_to_h.weight"] == torch.Size([64, 128])
    assert shapes["6.weight"] == torch.Size([64]) and shapes["6.bias"] == torch.Size([64])
    assert all(n.endswith(".bias") or shapes[n].__len__() == 1 for n in ms["param_shapes"][1])
    layer = load(c, "global_step3/layer_02-model_00-model_states.pt")
    assert layer["self_attention.query_key_value.weight"].shape == (192, 64)
    assert "input_layernorm.weight" in layer and "mlp.dense_4h_to_h.bias" in layer
    emb = load(c, "global_step3/layer_01-model_00-model_states.pt")
    assert set(emb) == {"word_embeddings.weight", "position_embeddings.weight"}
    opt = load(c, "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert "zero_stage" in opt and "single_partition_of_fp32_groups" in opt and "param_slice_mappings" in opt
    assert opt["partition_count"] == [2, 2]
    refs = man["cases"][c]["reference"]
    assert refs["ds_to_universal"]["ok"], refs
    assert (root / c / "reference/universal/zero/2.self_attention.query_key_value.weight/fp32.pt").is_file()
    # DeepSpeed's zero_to_fp32 cannot read PipelineEngine files (module is None); the workaround output exists
    assert refs["zero_to_fp32"].get("workaround_ok") or refs["zero_to_fp32"]["ok"], refs
    fp32 = torch.load(root / c / "reference/zero_to_fp32.pt", weights_only=False)
    assert fp32["2.self_attention.query_key_value.weight"].shape == (192, 64)

    # --- tp=2: TP slices in param_shapes and layer files
    c = "pipe_pp1_tp2_dp2_z1_fp32"
    fs = files(c)
    assert {"global_step3/layer_01-model_01-model_states.pt", "global_step3/mp_rank_01_model_states.pt",
            "global_step3/zero_pp_rank_1_mp_rank_01_optim_states.pt"} <= fs
    ms = load(c, "global_step3/mp_rank_01_model_states.pt")
    shapes = {k: v for g in ms["param_shapes"] for k, v in g.items()}
    assert ms["mp_world_size"] == 2
    assert shapes["tied_modules.embed.word_embeddings.weight"] == torch.Size([128, 64])
    assert shapes["2.self_attention.query_key_value.weight"] == torch.Size([96, 64])
    assert shapes["2.self_attention.dense.weight"] == torch.Size([64, 32])
    assert shapes["2.self_attention.dense.bias"] == torch.Size([64])
    assert shapes["3.mlp.dense_4h_to_h.weight"] == torch.Size([64, 64])
    assert man["cases"][c]["reference"]["ds_to_universal"]["ok"]
    u = torch.load(root / c / "reference/universal/zero/2.self_attention.dense.weight/fp32.pt", weights_only=False)
    assert u["param"].shape == (64, 64) and u["cat_dim"] == 1

    # --- bf16 + ZeRO-1 (DeepSpeedZeroOptimizer), bf16_ prefixed shards
    c = "pipe_pp1_tp1_dp2_z1_bf16_zeroopt"
    fs = files(c)
    assert "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in fs
    assert "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in fs
    assert load(c, "global_step3/layer_03-model_00-model_states.pt")["mlp.dense_h_to_4h.weight"].dtype == torch.bfloat16
    assert load(c, "global_step3/mp_rank_00_model_states.pt")["args"].params_dtype == torch.bfloat16

    # --- ZeRO-3 on the plain engine (Megatron GPTModel names)
    c = "plain_dp2_z3_fp32"
    fs = files(c)
    assert {"global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt",
            "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= fs
    ms = load(c, "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt")
    shapes = {k: v for g in ms["param_shapes"] for k, v in g.items()}
    assert shapes["language_model.embedding.word_embeddings.weight"] == torch.Size([256, 64])
    assert shapes["language_model.encoder.layers.0.self_attention.query_key_value.weight"] == torch.Size([192, 64])
    assert "language_model.encoder.final_layernorm.weight" in shapes
    assert "language_model" in ms["module"]  # Megatron's nested state_dict_for_save_checkpoint
    fp32 = torch.load(root / c / "reference/zero_to_fp32.pt", weights_only=False)
    assert fp32["language_model.encoder.layers.3.mlp.dense_4h_to_h.weight"].shape == (64, 128)
