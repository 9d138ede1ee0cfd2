"""reshard in the reference Megatron-DeepSpeed trainer: load a checkpoint saved under any layout
into the live DeepSpeed engine in place, and save the live engine in reshard's native format.

    iteration, consumed, report = reshard_load(engine, args, "/ckpt", step=None,
                                               policies={"replicas": "error"})

What is filled (torch AdamW): the PipelineEngine with ZeRO-1 or BF16_Optimizer, and the plain
DeepSpeedEngine of ``--no-pipeline`` (GPTModel) with ZeRO-0 (fp32: the torch optimizer itself;
fp16: FP16_UnfusedOptimizer), ZeRO-1, ZeRO-2 or ZeRO-3 (there the weights are each rank's ZeRO-3
partitions, ``param.ds_tensor``; reshard.integrations.megatron_deepspeed.EngineView):
  * module weights (the 16-bit/bit16 copies DeepSpeed keeps in its flat groups; fp32 runs keep
    float32 there), from the checkpoint's weights, via canonical names (include/reshard/model.h);
  * the ZeRO optimizer's flat fp32 partitions (engine.optimizer.single_partition_of_fp32_groups),
    laid out in the live optimizer's own flat order (offsets read from bit16_groups_flat, gaps and
    padding included) with its partition size;
  * exp_avg / exp_avg_sq of the torch optimizer's state for each flat partition (created when the
    optimizer has not stepped yet, attached only after the load succeeded);
  * step (the checkpoint's value, never incremented; torch AdamW keeps a float32 tensor per
    parameter), loss scale, LR scheduler position, iteration, consumed samples (the trainer's data
    order follows consumed samples);
  * RNG state: carried over only when the layout is identical, in reshard.rank_state's typed
    encoding (never a pickle: a checkpoint is data); otherwise, or for a save whose per-rank
    state is a pickle, every rank reseeds deterministically from (seed, iteration, rank) and the
    report says so (failures.md B19).

The engine part is reshard.integrations.megatron_deepspeed's (EngineView, fill_engine), shared with upstream
Megatron-DeepSpeed's trainer. Every rank gathers every other rank's (pp, tp) param-group
description, so the target layout covers the whole job and every rank plans the same load. Errors are reshard.Error subclasses,
raised on every rank; a planning or pre-flight error leaves every live tensor untouched.

Tied embeddings at pp > 1: DeepSpeed's TiedLayerSpec puts the whole embedding module on the last
stage too, but only word_embeddings is used and synchronised there; the last stage's copy of
position_embeddings is dead (no gradient; weight decay only). It is not saved by reshard_save,
and on load it is filled from the first stage's (live) copy.
"""

from __future__ import annotations

import json
import time
from typing import List, Optional, Tuple

import torch.distributed as dist

import reshard
import reshard.integrations.megatron_deepspeed as RM

from . import model as M


# ----------------------------------------------------------------------------------------------
# Model description and names
# ----------------------------------------------------------------------------------------------


def model_config_dict(cfg: M.GPTConfig) -> dict:
    """reshard's model description (configs/models/*.yaml keys) of the reference GPT."""
    return {
        "name": "megatron-deepspeed-gpt",
        "num_layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "heads": cfg.num_attention_heads,
        "query_groups": cfg.num_key_value_heads,
        "vocab": cfg.vocab_size,
        "vocab_divisible_by": cfg.make_vocab_size_divisible_by,
        "max_position_embeddings": cfg.seq_length if cfg.position_embeddings else 0,
        "swiglu": bool(cfg.swiglu),
        "tied_embeddings": bool(cfg.tied),
        "bias": bool(cfg.add_bias_linear),
        "norm": cfg.normalization,
        "param_dtype": "bf16" if cfg.bf16 else "f16" if cfg.fp16 else "f32",
        "optimizer": "adam",
        "qkv_version": 3.0,  # the reference model's fused QKV: [ng, q/ng + 2, hn] rows
        "qkv_order": "interleaved",
        "tp_gt_groups": "refuse",
    }


def canonical_name(live: str, cfg: M.GPTConfig) -> str:
    """Canonical tensor name of a GPTModelPipe parameter name (reshard.integrations.megatron_deepspeed.pipe_canonical_name:
    the reference model's specs are numbered as upstream's)."""
    return RM.pipe_canonical_name(live, cfg.num_layers)


def LiveState(engine, cfg: M.GPTConfig) -> RM.EngineView:
    """This rank's view of the reference trainer's live engine (reshard.integrations.megatron_deepspeed.EngineView), with
    ranks from the PipelineEngine's grid and the model's own tensor-parallel rank. Collective."""
    if not hasattr(engine, "grid"):
        # The trainer's --no-pipeline engine: a plain DeepSpeedEngine on GPTModel (ZeRO 0-3), one
        # pipeline stage, ranks ordered rank = dp_rank * tp + tp_rank.
        rank = dist.get_rank()
        return RM.EngineView(engine, model_config_dict(cfg), tp=cfg.tp, pp=1, dp=cfg.dp, stage=0,
                             dp_rank=rank // cfg.tp, tp_rank=rank % cfg.tp,
                             canonical=lambda n: RM.plain_canonical_name(n, cfg.num_layers))
    grid = engine.grid
    return RM.EngineView(engine, model_config_dict(cfg), tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, stage=grid.get_stage_id(),
                         dp_rank=grid.get_data_parallel_id(), tp_rank=M.TP.rank,
                         canonical=lambda n: canonical_name(n, cfg),
                         dead=lambda c, s: cfg.tied and s > 0 and c == "embedding.position_embeddings.weight")


# ----------------------------------------------------------------------------------------------
# Non-tensor state
# ----------------------------------------------------------------------------------------------


def _global_json(engine, zopt, args) -> dict:
    sched = getattr(engine, "lr_scheduler", None)
    return {
        "writer": "integration.megatron_deepspeed.reshard_hook",
        "loss_scaler": RM.loss_scaler_state(zopt) or {"cur_scale": 1.0, "dynamic": False},
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "global_batch": int(getattr(args, "global_batch", 0)),
        "seed": int(getattr(args, "seed", 0)),
    }


# ----------------------------------------------------------------------------------------------
# Save and load
# ----------------------------------------------------------------------------------------------


def reshard_save(engine, args, root: str, step: str, iteration: int, consumed: int) -> None:
    """Saves the live engine as ROOT/<step> in reshard's native format (collective)."""
    cfg = engine.module.gpt_config
    live = LiveState(engine, cfg)
    layout = live.layout(for_save=True)
    tensors, created = live.buffers(layout, create_missing_state=True, for_save=True)
    state = {"iteration": int(iteration), "consumed_samples": int(consumed), "step": live.optimizer_step(),
             "json": json.dumps(_global_json(engine, live.zopt, args)), "per_rank": {}}
    blobs: List[bytes] = [None] * live.world
    dist.all_gather_object(blobs, reshard.rank_state.capture())
    state["per_rank"] = {r: b for r, b in enumerate(blobs)}
    reshard.save(root, step, layout, tensors, state=state, comm=reshard.communicator())


def reshard_load(engine, args, checkpoint_root: str, step=None, policies: Optional[dict] = None,
                 model: Optional[str] = None, verify: str = reshard.DEFAULT_VERIFY) -> Tuple[int, int, dict]:
    """Loads ``checkpoint_root`` (native or DeepSpeed; ``step`` None = latest) into the live engine,
    resharding weights and optimizer state from the saved layout to this job's. Collective.

    ``policies``: reshard.plan's policies (replicas error|average|first, replica_atol,
    strict_missing, strict_unexpected, memory_budget_bytes, dedup). ``model``: a model YAML (or
    dict) for formats that do not record the model (default: the live GPTConfig's description).

    Returns (iteration, consumed_samples, report); the report is reshard.load's plus
    "rank_peak_rss_bytes" (max over ranks of ru_maxrss, bytes), "hook_seconds", "rng", "bit16_check".
    Raises reshard.Error subclasses on every rank (see reshard.load).
    """
    t0 = time.time()
    cfg = engine.module.gpt_config
    ckpt = reshard.open_checkpoint(checkpoint_root, step=step, model=model_config_dict(cfg) if model is None else model)
    live = LiveState(engine, cfg)
    report, glob = RM.fill_engine(live, ckpt, seed=int(getattr(args, "seed", 0)), policies=policies, verify=verify)
    iteration, consumed = int(ckpt.state["iteration"]), int(ckpt.state["consumed_samples"])
    if consumed < 0:
        consumed = iteration * int(args.global_batch)
        engine.global_samples = consumed
        report["not_carried"].append("consumed samples: not recorded; taken as iteration * global batch")
    report["hook_seconds"] = reshard_all_reduce_float_max(time.time() - t0)
    return iteration, consumed, report


reshard_all_reduce_int = RM.all_reduce_int
reshard_all_reduce_float_max = RM.all_reduce_float_max


def load_from_resume_config(engine, args, path: str) -> Tuple[int, int, dict]:
    """Reads configs/resume/*.yaml (reshard.load_resume_config), checks that its target layout is
    this job's, and calls reshard_load with its checkpoint, step, model, policies and verify."""
    rc = reshard.load_resume_config(path)
    cfg = engine.module.gpt_config
    if rc["target"] == "auto":
        # train.elastic_layout chose the layout this job was built with and the step to read.
        return reshard_load(engine, args, rc["checkpoint"], step=args.load_step, policies=rc["policies"],
                            model=rc["model"] or None, verify=rc["verify"])
    t = rc["target_topology"]
    live = (cfg.tp, cfg.pp, cfg.dp)
    want = (t["tp"], t["pp"], t["dp"])
    zero = int(engine.zero_optimization_stage())
    if want != live or t["vpp"] != 1 or t["zero"] != zero:
        raise reshard.InvalidArgument(
            f"{path}: field target: {rc['target']} but this job runs tp={cfg.tp},pp={cfg.pp},vpp=1,dp={cfg.dp},"
            f"zero={zero}; "
            "start the job with the layout the resume config names, or change the file")
    return reshard_load(engine, args, rc["checkpoint"], step=rc["step"] or None, policies=rc["policies"],
                        model=rc["model"] or None, verify=rc["verify"])
