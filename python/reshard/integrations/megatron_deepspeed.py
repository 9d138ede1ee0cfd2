"""reshard inside Megatron-DeepSpeed trainers: load a checkpoint saved under any layout into the
live DeepSpeed engine in place, resharding weights and optimizer state on the fly.

Upstream Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed, ``pretrain_gpt.py --deepspeed``):
change one line of ``megatron/training.py``'s ``setup_model_and_optimizer``,

    args.iteration = load_checkpoint(model, optimizer, opt_param_scheduler)

to

    from reshard.integrations.megatron_deepspeed import load_checkpoint as reshard_load_checkpoint
    args.iteration = reshard_load_checkpoint(model, optimizer, opt_param_scheduler)

and the job resumes from ``--load`` whatever tp, pp or dp the checkpoint was saved under (see
:func:`load_checkpoint`). Everything the load needs comes from the running trainer: the model's
shape from its ``args``, the ranks from the engine's grid (GPTModelPipe) or Megatron's parallel
state (GPTModel with ``--no-pipeline-parallel``), the parameter names from the module, the fused
QKV row order from the live attention code.

The engine part (:class:`EngineView`, :func:`fill_engine`) is shared with the repository's
reference trainer (integration/megatron_deepspeed/reshard_hook.py). What is filled, for DeepSpeed's
ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer), BF16_Optimizer, ZeRO-3 (DeepSpeedZeroOptimizer_Stage3,
where the weights are each rank's partitions ``param.ds_tensor``; :meth:`EngineView._init_stage3`)
and ZeRO-0 (FP16_Optimizer, FP16_UnfusedOptimizer, or the torch optimizer itself in fp32;
:meth:`EngineView._init_zero0`):

* module weights (the 16-bit copies in the optimizer's flat groups; fp32 runs keep float32 there);
* the flat fp32 partitions (``single_partition_of_fp32_groups``), in the live optimizer's own flat
  order (offsets read from ``bit16_groups_flat``, gaps and alignment padding included);
* exp_avg / exp_avg_sq of the torch optimizer's state per partition (created when the optimizer has
  not stepped yet, attached only after the load succeeded), and step (the checkpoint's value);
* the loss scaler's position (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis:
  :func:`set_loss_scaler`), LR scheduler, the engine's global_steps / global_samples / skipped_steps;
* per-rank RNG state only at an identical layout and only in reshard.rank_state's typed encoding:
  a pickled state (DeepSpeed's and Megatron's own) is never unpickled; every rank reseeds
  deterministically from (seed, iteration, rank) and the report says so.

Errors are reshard.Error subclasses raised on every rank; a planning or pre-flight error leaves
every live tensor untouched.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import reshard

__all__ = ["load_checkpoint", "model_config_from_args", "live_qkv_order", "pipe_canonical_name",
           "plain_canonical_name", "EngineView", "fill_engine", "all_reduce_int", "all_reduce_float_max",
           "loss_scaler_state", "set_loss_scaler"]


# ----------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------


def pipe_canonical_name(live: str, num_layers: int) -> str:
    """Canonical tensor name (include/reshard/model.h) of a GPTModelPipe parameter name. DeepSpeed's
    PipelineModule names local layers by their spec index and tied modules ``tied_modules.<key>``;
    GPTModelPipe's specs are 0 = input cast, 1 = embedding (``tied_modules.embed`` when tied),
    2..L+1 = transformer layers, L+2 = final norm, L+3 = untied head (``lm_head``)
    [MDS megatron/model/gpt_model.py GPTModelPipe.__init__]. Raises InvalidArgument otherwise."""
    L = num_layers
    if live.startswith("tied_modules.embed."):
        return "embedding." + live[len("tied_modules.embed."):]
    head, _, rest = live.partition(".")
    if not head.isdigit():
        raise reshard.InvalidArgument(f"live parameter {live}: not a GPTModelPipe name (expected '<spec index>.<name>' "
                                      "or 'tied_modules.embed.<name>')")
    idx = int(head)
    if idx == 1:
        return "embedding." + rest
    if 2 <= idx < 2 + L:
        return f"layers.{idx - 2}.{rest}"
    if idx == L + 2:
        return "final_layernorm." + rest
    if idx == L + 3 and rest == "lm_head.weight":
        return "lm_head.weight"
    raise reshard.InvalidArgument(f"live parameter {live}: spec index {idx} is not a layer of a {L}-layer GPTModelPipe")


def plain_canonical_name(live: str, num_layers: int) -> str:
    """Canonical tensor name of a GPTModel (no pipeline) parameter name: ``language_model.embedding.*``,
    ``language_model.encoder.layers.N.*``, ``language_model.encoder.final_layernorm.*``,
    ``language_model.output_layer.weight`` [MDS megatron/model/language_model.py]. A leading
    ``module.`` (Megatron's Float16Module wrapper) is dropped. Raises InvalidArgument otherwise."""
    name = live[len("module."):] if live.startswith("module.") else live
    pre = "language_model."
    if name.startswith(pre):
        rest = name[len(pre):]
        if rest.startswith("embedding."):
            return rest
        if rest.startswith("encoder.layers."):
            out = rest[len("encoder."):]
            layer = out.split(".")[1]
            if layer.isdigit() and int(layer) < num_layers:
                return out
        if rest.startswith("encoder.final_layernorm."):
            return rest[len("encoder."):]
        if rest.startswith("encoder.final_norm."):
            return "final_layernorm." + rest[len("encoder.final_norm."):]
        if rest == "output_layer.weight":
            return "lm_head.weight"
    raise reshard.InvalidArgument(f"live parameter {live}: not a {num_layers}-layer GPTModel name (expected "
                                  "language_model.embedding.*, language_model.encoder.layers.N.*, "
                                  "language_model.encoder.final_layernorm.* or language_model.output_layer.weight)")


# ----------------------------------------------------------------------------------------------
# The model, from the trainer's own args and code
# ----------------------------------------------------------------------------------------------


def _padded(vocab: int, divisor: int, tp: int) -> int:
    m = divisor * tp
    return (vocab + m - 1) // m * m


def live_qkv_order(module: torch.nn.Module, args=None) -> Optional[str]:
    """The fused QKV row order the running attention code reads: "blocked" ([Q | K | V] per tp
    rank) or "interleaved" (Megatron's [groups, heads/groups + 2, head_dim]); None when this rank's
    module has no ParallelAttention (a stage without transformer layers).

    Evidence: upstream Megatron-DeepSpeed's FPDT change (676a482c, 2024-12) made
    ParallelAttention.forward cut the projection into thirds, gave the module a
    ``kv_projection_size`` attribute and added the ``--ds-sequence-parallel-fpdt`` argument
    [MDS megatron/model/transformer.py, megatron/arguments.py]; code before it views the rows per
    group. The module and ``args`` (when given) must agree. Raises Unsupported when they do not, or
    when the blocked code runs grouped-query attention (its thirds do not match GQA's sizes)."""
    attns = [m for _, m in module.named_modules() if type(m).__name__ == "ParallelAttention"]
    if not attns:
        return None
    marks = {hasattr(a, "kv_projection_size") for a in attns}
    if len(marks) != 1:
        raise reshard.Unsupported("the live model mixes ParallelAttention modules of two codes (some with "
                                  "kv_projection_size, some without): cannot tell the fused QKV row order")
    blocked = marks.pop()
    if args is not None and hasattr(args, "ds_sequence_parallel_fpdt") != blocked:
        raise reshard.Unsupported(
            "cannot tell the fused QKV row order of the running code: its ParallelAttention "
            f"{'has' if blocked else 'lacks'} kv_projection_size (the blocked split of Megatron-DeepSpeed since "
            f"676a482c) but its args {'lack' if blocked else 'have'} ds_sequence_parallel_fpdt (the argument the same "
            "change added); pass qkv_order='interleaved' or 'blocked' to reshard.integrations.megatron_deepspeed.load_checkpoint")
    if blocked:
        for a in attns:
            nq = getattr(a, "num_attention_heads_per_partition", None)
            nkv = getattr(a, "num_key_value_heads_per_partition", nq)
            if nq is not None and nkv != nq:
                raise reshard.Unsupported(
                    "the running attention splits each tp rank's query_key_value output into three equal thirds "
                    f"(Megatron-DeepSpeed since 676a482c) with grouped-query attention ({nq} query and {nkv} key/value "
                    "heads per rank): the thirds do not match Q, K and V, so there is no right row order to load into")
    return "blocked" if blocked else "interleaved"


def model_config_from_args(args, *, vocab_size: Optional[int] = None, qkv_order: Optional[str] = None) -> dict:
    """reshard's model description (configs/models/*.yaml keys) of the GPT a Megatron(-DeepSpeed)
    trainer builds from its ``args`` Namespace: num_layers, hidden_size, ffn_hidden_size (4 x
    hidden when None), num_attention_heads, num_key_value_heads (Megatron-LM: num_query_groups with
    group_query_attention), swiglu, untie_embeddings_and_output_weights, add_bias_linear,
    normalization, learned absolute positions (add_position_embedding, or Megatron-LM's
    position_embedding_type), padded_vocab_size and make_vocab_size_divisible_by, bf16/fp16.

    ``vocab_size``: the real vocab (the tokenizer's vocab_size, which upstream records as
    universal_checkpoint_info.original_vocab_size); default args.vocab_size, else every padded row
    counts as real. ``qkv_order``: see :func:`live_qkv_order` (default interleaved).
    Raises Unsupported for what the load does not map (MoE experts, fp32 embeddings in a 16-bit run)."""
    def get(k, default=None):
        v = getattr(args, k, default)
        return default if v is None else v

    experts = get("num_experts", [1])
    if any(int(e) > 1 for e in (experts if isinstance(experts, (list, tuple)) else [experts])):
        raise reshard.Unsupported(f"args.num_experts={experts}: mixture-of-experts layers are not mapped by reshard")
    if get("embedding_weights_in_fp32", False) and (get("bf16", False) or get("fp16", False)):
        raise reshard.Unsupported("args.embedding_weights_in_fp32 with a 16-bit model: the embedding's dtype differs "
                                  "from the other weights', which reshard's model description cannot say")
    tp = int(get("tensor_model_parallel_size", 1))
    heads = int(args.num_attention_heads)
    groups = int(get("num_key_value_heads", heads))
    if get("group_query_attention", False):
        groups = int(get("num_query_groups", groups))
    hidden = int(args.hidden_size)
    vp = get("padded_vocab_size")
    V = int(vocab_size if vocab_size is not None else get("vocab_size", vp or 0))
    if not V:
        raise reshard.InvalidArgument("args has neither vocab_size nor padded_vocab_size: cannot size the vocab")
    div = int(get("make_vocab_size_divisible_by", 128))
    if vp is not None and _padded(V, div, tp) != int(vp):
        if int(vp) % tp != 0 or _padded(V, int(vp) // tp, tp) != int(vp):
            raise reshard.InvalidArgument(f"args.padded_vocab_size={vp} is no Megatron padding of vocab {V} at tp={tp}")
        div = int(vp) // tp  # the divisor that reproduces the trainer's own padding
    pos_type = get("position_embedding_type")
    learned = (pos_type == "learned_absolute") if pos_type is not None else bool(get("add_position_embedding", True))
    if get("use_rotary_position_embeddings", False) and pos_type is None:
        learned = bool(get("add_position_embedding", False))
    dtype = "bf16" if get("bf16", False) else "f16" if get("fp16", False) else "f32"
    return {
        "name": "megatron-args",
        "num_layers": int(args.num_layers),
        "hidden": hidden,
        "ffn": int(get("ffn_hidden_size", 4 * hidden)),
        "heads": heads,
        "query_groups": 0 if groups == heads else groups,
        "vocab": V,
        "vocab_divisible_by": div,
        "max_position_embeddings": int(get("max_position_embeddings", 0)) if learned else 0,
        "swiglu": bool(get("swiglu", False)),
        "tied_embeddings": not bool(get("untie_embeddings_and_output_weights", False)),
        "bias": bool(get("add_bias_linear", True)),
        "norm": str(get("normalization", "layernorm")).lower(),
        "param_dtype": dtype,
        "optimizer": "adam",
        "qkv_version": 3.0,
        "qkv_order": qkv_order or "interleaved",
        "tp_gt_groups": "refuse",
    }


# ----------------------------------------------------------------------------------------------
# The live engine
# ----------------------------------------------------------------------------------------------


class _Bf16OptimizerView:
    """DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation) under the attribute names
    read from DeepSpeedZeroOptimizer. The partitioning is the same (facts from
    deepspeed/runtime/bf16_optimizer.py, 0.19): each param group is flattened with alignment
    2 x dp (bf16_groups_flat), cut into dp equal contiguous partitions (bf16_partitioned_groups),
    and this rank keeps an fp32 copy of its partition (fp32_groups_flat_partition), which is the
    parameter the torch optimizer's state is keyed by. BF16 has no loss scaler."""

    def __init__(self, opt):
        self.optimizer = opt.optimizer
        self.bit16_groups = opt.bf16_groups
        self.bit16_groups_flat = opt.bf16_groups_flat
        self.single_partition_of_fp32_groups = opt.fp32_groups_flat_partition
        self.parallel_partitioned_bit16_groups = opt.bf16_partitioned_groups


def _is_stage3(zopt) -> bool:
    return all(hasattr(zopt, a) for a in ("fp16_groups", "fp16_partitioned_groups_flat",
                                          "fp32_partitioned_groups_flat", "sub_group_to_group_id"))


def _zero0_kind(zopt, stage: int) -> Optional[str]:
    """ZeRO stage 0 optimizers (no partitioning: every dp rank holds the whole state of its model
    shard): "fused" = FP16_Optimizer (deepspeed/runtime/fp16/fused_optimizer.py: each param group
    flattened into fp16_groups_flat, its fp32 copy fp32_groups_flat[g] the torch optimizer's one
    parameter), "unfused" = FP16_UnfusedOptimizer (unfused_optimizer.py: one fp32 copy per
    parameter, fp32_groups[g][k]), "torch" = the torch optimizer itself (fp32 training: the module
    weights are the master); None for anything else."""
    if stage != 0:
        return None
    if all(hasattr(zopt, a) for a in ("fp16_groups", "fp16_groups_flat", "fp32_groups_flat", "optimizer")):
        return "fused"
    if all(hasattr(zopt, a) for a in ("fp16_groups", "fp32_groups", "optimizer")):
        return "unfused"
    if isinstance(zopt, torch.optim.Optimizer):
        return "torch"
    return None


def _zero_optimizer(engine):
    """The engine's ZeRO optimizer, its BF16_Optimizer under DeepSpeedZeroOptimizer's names, or a
    ZeRO-0 optimizer (:func:`_zero0_kind`). Raises Unsupported for what the view does not map
    (named: the optimizer's type and stage)."""
    zopt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if _zero0_kind(zopt, stage) is not None:
        return zopt
    if all(hasattr(zopt, a) for a in ("bf16_groups", "bf16_groups_flat", "fp32_groups_flat_partition",
                                      "bf16_partitioned_groups")):
        return _Bf16OptimizerView(zopt)
    if stage == 3 and _is_stage3(zopt):
        if getattr(zopt, "offload_optimizer", False) or getattr(zopt, "offload_param", False):
            raise reshard.Unsupported(
                "ZeRO-3 with offload_optimizer / offload_param: reshard fills the partitions a ZeRO-3 engine keeps "
                "on its own device; start the job without offload to load, or load with DeepSpeed at the same layout")
        if any(f is None for f in zopt.fp16_partitioned_groups_flat):
            raise reshard.Unsupported("ZeRO-3 with parameters on NVMe (a sub-group without a flat buffer) is not "
                                      "filled by reshard")
        return zopt
    needed = ("bit16_groups", "bit16_groups_flat", "single_partition_of_fp32_groups")
    if not all(hasattr(zopt, a) for a in needed) or stage not in (1, 2):
        raise reshard.Unsupported(
            f"reshard fills DeepSpeed's ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer), ZeRO-3 "
            f"(DeepSpeedZeroOptimizer_Stage3), BF16_Optimizer and ZeRO-0 (FP16_Optimizer, FP16_UnfusedOptimizer, "
            f"a torch optimizer); this engine's optimizer is "
            f"{type(zopt).__name__} (ZeRO stage {stage}, bf16 {engine.bfloat16_enabled()})")
    if getattr(zopt, "cpu_offload", False):
        raise reshard.Unsupported(f"ZeRO-{stage} with offload_optimizer: reshard fills the fp32 partitions an "
                                  "engine keeps on its own device; start the job without offload to load")
    return zopt


class EngineView:
    """This rank's view of a live DeepSpeed engine, and the whole job's layout built from every
    rank's (collective: one all_gather_object).

    ``model``: reshard's model description (dict of configs/models/*.yaml keys). ``tp, pp, dp``:
    the job's sizes; ``stage, dp_rank, tp_rank``: this rank's coordinates, which must follow
    rank = (stage * dp + dp_rank) * tp + tp_rank (DeepSpeed's pipe/data/model grid and Megatron's
    default order). ``canonical(live_name)``: the canonical tensor name of a module parameter name.
    ``dead(canonical, stage)``: True for a parameter whose live copy on this stage is unused and not
    saved (the last stage's copy of position_embeddings in a tied GPTModelPipe)."""

    def __init__(self, engine, model: dict, *, tp: int, pp: int, dp: int, stage: int, dp_rank: int, tp_rank: int,
                 canonical: Callable[[str], str], dead: Optional[Callable[[str, int], bool]] = None):
        self.engine = engine
        self.zopt = _zero_optimizer(engine)
        self.z0 = _zero0_kind(self.zopt, engine.zero_optimization_stage())
        self.torch_opt = self.zopt if self.z0 == "torch" else self.zopt.optimizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp, self.pp, self.dp = int(tp), int(pp), int(dp)
        self.stage, self.dp_rank, self.tp_rank = int(stage), int(dp_rank), int(tp_rank)
        if self.tp * self.pp * self.dp != self.world:
            raise reshard.InvalidArgument(f"tp={tp} x pp={pp} x dp={dp} is not the world size {self.world}")
        expect = (self.stage * self.dp + self.dp_rank) * self.tp + self.tp_rank
        if expect != self.rank:
            raise reshard.Unsupported(f"[rank {self.rank}] parallel grid (stage {stage}, dp {dp_rank}, tp {tp_rank}) does "
                                      f"not follow rank = (pp*dp + d)*tp + t = {expect}, the order reshard's layouts use")
        self.zero = (0 if self.z0 else 3 if _is_stage3(self.zopt) else
                     2 if engine.zero_optimization_stage() == 2 else 1)
        self.aliased = False  # the weights are the fp32 master's own memory (fp32 ZeRO-3 and ZeRO-0)
        self.topology = f"tp={self.tp},pp={self.pp},dp={self.dp},zero={self.zero}"
        names = {id(p): n for n, p in engine.module.named_parameters()}
        self.params: Dict[str, torch.nn.Parameter] = {}  # canonical -> live parameter
        self.dead = set()
        self.groups = []  # this shard's param groups: entries (canonical, offset, numel)
        if self.zero == 3:
            self._init_stage3(names, canonical, dead)
        elif self.zero == 0:
            self._init_zero0(names, canonical, dead)
        else:
            self._init_flat(names, canonical, dead)
        # The tensors the torch optimizer's state is keyed by (one per flat partition, or per
        # ZeRO-0 group / parameter).
        if self.zero != 0:
            self.state_keys = list(self.fp32_partitions)
        self.model = reshard.model_config(model)
        mine = {"stage": self.stage, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank, "groups": self.groups,
                "dead": sorted(self.dead)}
        everyone: List[dict] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        self.everyone = everyone

    def _name(self, names, p, g, canonical, dead) -> str:
        live = names.get(id(p))
        if live is None:
            raise reshard.Internal(f"[rank {self.rank}] optimizer group {g} holds a parameter the module does not name")
        canon = canonical(live)
        if canon in self.params:
            raise reshard.InvalidArgument(f"[rank {self.rank}] two live parameters map to {canon} (the second: {live})")
        self.params[canon] = p
        if dead is not None and dead(canon, self.stage):
            self.dead.add(canon)
        return canon

    def _init_flat(self, names, canonical, dead) -> None:
        """ZeRO-1/2 and BF16_Optimizer: each param group is one flat 16-bit buffer (bit16_groups_flat)
        cut into dp equal partitions; this rank's fp32 copy of its partition is the parameter the
        torch optimizer's state is keyed by (deepspeed/runtime/zero/stage_1_and_2.py)."""
        self.fp32_partitions = list(self.zopt.single_partition_of_fp32_groups)
        for g, params in enumerate(self.zopt.bit16_groups):
            flat = self.zopt.bit16_groups_flat[g]
            base, es = flat.data_ptr(), flat.element_size()
            entries = []
            for p in params:
                canon = self._name(names, p, g, canonical, dead)
                off = (p.data_ptr() - base) // es
                if not (0 <= off and off + p.numel() <= flat.numel()):
                    raise reshard.Internal(f"[rank {self.rank}] {names[id(p)]} does not lie in its group's flat buffer")
                entries.append((canon, int(off), int(p.numel())))
            entries.sort(key=lambda e: e[1])
            n = max([o + k for _, o, k in entries] or [0])
            wd = float(self.torch_opt.param_groups[g].get("weight_decay", 0.0))
            self.groups.append({"entries": entries, "numel": n,
                                "partition_size": int(self.fp32_partitions[g].numel()),
                                "no_weight_decay": wd == 0.0})

    def _init_stage3(self, names, canonical, dead) -> None:
        """ZeRO-3 (DeepSpeedZeroOptimizer_Stage3, deepspeed/runtime/zero/stage3.py and
        partition_parameters.py): every parameter is cut into dp equal partitions of
        ceil(numel / dp) elements (``param.ds_tensor``, the last one padded); a sub-group's partitions
        lie side by side in one flat 16-bit buffer (``fp16_partitioned_groups_flat``), whose fp32 copy
        (``fp32_partitioned_groups_flat``) is the parameter the torch optimizer's state is keyed by.
        Offsets are each ds_tensor's place in its flat buffer; the weight decay is the one of the
        sub-group's param group (``sub_group_to_group_id``). A parameter held gathered (inside
        GatheredParameters, or mid-forward) is refused: filling its partition would not reach the
        gathered copy. Persistent parameters (kept gathered by design) are gathered again after the
        load (:meth:`after_write`)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        zopt = self.zopt
        self.fp32_partitions = list(zopt.fp32_partitioned_groups_flat)
        for g, params in enumerate(zopt.fp16_groups):
            flat = zopt.fp16_partitioned_groups_flat[g]
            base, es = flat.data_ptr(), flat.element_size()
            if self.fp32_partitions[g].data_ptr() == base and self.fp32_partitions[g].numel():
                self.aliased = True
            entries = []
            for p in params:
                canon = self._name(names, p, g, canonical, dead)
                live = names[id(p)]
                if p.ds_status == ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False):
                    raise reshard.FailedPrecondition(
                        f"[rank {self.rank}] ZeRO-3 parameter {live} is gathered (inside deepspeed.zero."
                        "GatheredParameters, or a forward is in progress); load before gathering it: its partition "
                        "would be filled and the gathered copy left stale")
                part, numel = p.ds_tensor, int(p.ds_numel)
                if part.numel() != -(-numel // self.dp):
                    raise reshard.Internal(f"[rank {self.rank}] {live}: its ZeRO-3 partition holds {part.numel()} "
                                           f"elements, not ceil({numel} / dp {self.dp})")
                off = (part.data_ptr() - base) // es
                if not (0 <= off and off + part.numel() <= flat.numel()):
                    raise reshard.Internal(f"[rank {self.rank}] {live}: its partition does not lie in sub-group {g}'s "
                                           "flat buffer")
                entries.append((canon, int(off), numel))
            entries.sort(key=lambda e: e[1])
            pg = zopt.sub_group_to_group_id[g]
            wd = float(self.torch_opt.param_groups[pg].get("weight_decay", 0.0))
            self.groups.append({"entries": entries, "numel": sum(k for _, _, k in entries),
                                "partition_size": int(self.fp32_partitions[g].numel()),
                                "no_weight_decay": wd == 0.0})

    def _init_zero0(self, names, canonical, dead) -> None:
        """ZeRO-0 (see :func:`_zero0_kind`): no partitioning; each parameter's fp32 master and
        moments are its own range of its group's state: ``self.z0_state[canon] = (state key index,
        element offset, numel)``, where state key k is the tensor ``torch_opt.state`` is keyed by
        (fused: the group's flat fp32 copy; unfused: the parameter's fp32 copy; torch: the
        parameter itself, whose memory is then both weight and master)."""
        zopt, kind = self.zopt, self.z0
        self.state_keys, self.z0_state = [], {}
        self.fp32_partitions = []  # no flat partitions: the masters are per tensor (_zero0_master)
        if kind == "torch":
            self.aliased = True
            groups = [list(g["params"]) for g in self.torch_opt.param_groups]
        else:
            groups = [list(g) for g in zopt.fp16_groups]
        for g, params in enumerate(groups):
            entries, at = [], 0
            if kind == "fused":
                self.state_keys.append(zopt.fp32_groups_flat[g])
            for k, p in enumerate(params):
                canon = self._name(names, p, g, canonical, dead)
                n = int(p.numel())
                if kind == "fused":
                    self.z0_state[canon] = (len(self.state_keys) - 1, at, n)
                else:
                    self.state_keys.append(zopt.fp32_groups[g][k] if kind == "unfused" else p)
                    self.z0_state[canon] = (len(self.state_keys) - 1, 0, n)
                entries.append((canon, at, n))
                at += n
            if kind == "fused" and at != zopt.fp32_groups_flat[g].numel():
                raise reshard.Internal(f"[rank {self.rank}] FP16_Optimizer group {g}: {at} parameter elements but its "
                                       f"flat fp32 copy holds {zopt.fp32_groups_flat[g].numel()}")
            wd = float(self.torch_opt.param_groups[g].get("weight_decay", 0.0))
            self.groups.append({"entries": entries, "numel": at, "partition_size": at, "no_weight_decay": wd == 0.0})

    def _zero0_master(self, canon: str) -> torch.Tensor:
        ki, off, n = self.z0_state[canon]
        return self.state_keys[ki].data.view(-1).narrow(0, off, n)

    def weight_tensor(self, canon: str) -> torch.Tensor:
        """The live tensor that holds this rank's weights of ``canon``, flat: the module parameter
        (ZeRO-1/2), or its ZeRO-3 partition (``ds_tensor``, ceil(numel / dp) elements)."""
        p = self.params[canon]
        return p.ds_tensor.data.view(-1) if self.zero == 3 else p.data.view(-1)

    def after_write(self) -> None:
        """After every tensor was written: ZeRO-3's persistent parameters (kept gathered) are released
        and gathered again from their new partitions, and DeepSpeed's secondary (hpZ) partitions are
        invalidated -- what DeepSpeed's own ZeRO-3 load does after it copies partitions
        (stage3.py load_state_dict, checkpoint_event_epilogue). Collective."""
        if self.zero != 3:
            return
        persistent = list(getattr(self.zopt, "persistent_parameters", []) or [])
        if persistent:
            persistent[0].partition(persistent)
        self.zopt.checkpoint_event_epilogue()

    def bit16_mismatches(self, scratch: Optional[Dict[str, torch.Tensor]] = None) -> int:
        """Elements of this rank's 16-bit weights that differ from its fp32 master downcast (what
        DeepSpeed's own step writes). ``scratch``: for an fp32 ZeRO-3 run (weights and master are one
        buffer), the weights the load wrote aside, compared with the master's elements."""
        n = 0
        if self.zero == 0:
            for canon in self.params:
                if not self.aliased:
                    w = self.weight_tensor(canon)
                    n += int((w.float() != self._zero0_master(canon).to(w.dtype).float()).sum())
            for canon, w in (scratch or {}).items():
                n += int((w != self.weight_tensor(canon)).sum())
            return n
        if self.zero == 3:
            for g, params in enumerate(self.zopt.fp16_groups):
                flat, master = self.zopt.fp16_partitioned_groups_flat[g], self.fp32_partitions[g]
                if not self.aliased:
                    n += int((flat.float() != master.data.to(flat.dtype).float()).sum())
            for canon, w in (scratch or {}).items():
                n += int((w != self.weight_tensor(canon)).sum())
            return n
        for g, part in enumerate(self.fp32_partitions):
            mine = self.zopt.parallel_partitioned_bit16_groups[g][self.dp_rank]
            lo = mine.numel()
            n += int((mine.float() != part.data[:lo].to(mine.dtype).float()).sum())
        return n

    def _recipe(self, include_dead: bool):
        slots = [None] * (self.pp * self.tp)
        stages: Dict[str, set] = {}
        for info in self.everyone:
            slot = info["stage"] * self.tp + info["tp_rank"]
            dead = set(info["dead"]) if not include_dead else set()
            groups = []
            for g in info["groups"]:
                gg = dict(g)
                gg["entries"] = [e for e in g["entries"] if e[0] not in dead]
                groups.append(gg)
            if slots[slot] is None:
                slots[slot] = groups
            elif info["dp_rank"] != 0 and slots[slot] != groups and include_dead:
                raise reshard.Internal(f"dp ranks of (pp {info['stage']}, tp {info['tp_rank']}) disagree on the "
                                       "optimizer's param groups")
            for g in groups:
                for name, _, _ in g["entries"]:
                    stages.setdefault(name, set()).add(info["stage"])
        return {k: sorted(v) for k, v in stages.items()}, slots

    def layout(self, for_save: bool = False):
        """The job's layout (reshard.build_layout). ``for_save``: dead copies left out and weights
        on dp rank 0 only (what reshard.save writes)."""
        stages, slots = self._recipe(include_dead=not for_save)
        return reshard.build_layout(self.model, self.topology, stages=stages, groups=slots,
                                    weights_on_dp0_only=for_save)

    def buffers(self, layout, create_missing_state: bool, for_save: bool = False):
        """({buffer name: live tensor} for this rank's buffers, created): optimizer state entries
        missing from the torch optimizer are created as new tensors, keyed (group, kind) in
        ``created`` and attached by the caller; an fp32 ZeRO-3 run's weights (the master's own
        memory) get tensors aside, keyed ("weight", canonical), compared by :meth:`bit16_mismatches`
        (``for_save``: copies of the live values)."""
        out, created = {}, {}
        for b in layout.buffers:
            if b["rank"] != self.rank:
                continue
            name, kind = b["name"], b["state"]
            if kind == "weight":
                canon = name[len("weight/"):]
                if canon not in self.params:
                    raise reshard.Internal(f"[rank {self.rank}] layout buffer {name} has no live parameter")
                w = self.weight_tensor(canon)
                if self.aliased:
                    # fp32 ZeRO-3 / ZeRO-0 torch optimizer: the weights are the master's memory;
                    # written aside, compared after.
                    w = torch.empty_like(w) if not for_save else w.clone()
                    created[("weight", canon)] = w
                out[name] = w
                continue
            if self.zero == 0:  # per-tensor buffers "<kind>/<canonical>"
                canon = name[len(kind) + 1:]
                if canon not in self.z0_state:
                    raise reshard.Internal(f"[rank {self.rank}] layout buffer {name} has no live parameter")
                ki, off, n = self.z0_state[canon]
                if kind == "fp32":
                    out[name] = self._zero0_master(canon)
                    continue
                key = self.state_keys[ki]
                t = self.torch_opt.state.get(key, {}).get(kind)
                if t is None:
                    t = created.get((ki, kind))
                if t is None:
                    if not create_missing_state:
                        raise reshard.FailedPrecondition(f"[rank {self.rank}] optimizer has no {kind} for {canon}")
                    t = torch.zeros_like(key.data, memory_format=torch.contiguous_format)
                    created[(ki, kind)] = t
                out[name] = t.view(-1).narrow(0, off, n)
                continue
            g = b["group"]
            part = self.fp32_partitions[g]
            if kind == "fp32":
                out[name] = part.data
                continue
            st = self.torch_opt.state.get(part, {})
            t = st.get(kind)
            if t is None:
                if not create_missing_state:
                    raise reshard.FailedPrecondition(f"[rank {self.rank}] optimizer has no {kind} for group {g}")
                t = torch.zeros_like(part.data, memory_format=torch.contiguous_format)
                created[(g, kind)] = t
            out[name] = t
        return out, created

    def optimizer_step(self) -> int:
        steps = set()
        for part in self.state_keys:
            st = self.torch_opt.state.get(part, {})
            if "step" in st:
                s = st["step"]
                steps.add(int(s.item()) if torch.is_tensor(s) else int(s))
        if len(steps) > 1:
            raise reshard.DataLoss(f"[rank {self.rank}] optimizer groups have different steps {sorted(steps)}")
        return steps.pop() if steps else 0


_LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _live_loss_scaler(zopt):
    """The object holding the live loss scaler's state: DeepSpeedZeroOptimizer / Stage3's
    ``loss_scaler`` (a DynamicLossScaler or LossScaler), FP16_Optimizer / FP16_UnfusedOptimizer's
    ``loss_scale_config`` (DeepSpeed 0.19); None for optimizers without one (BF16, fp32)."""
    for attr in ("loss_scale_config", "loss_scaler"):
        obj = getattr(zopt, attr, None)
        if obj is not None and hasattr(obj, "cur_scale"):
            return obj
    return None


def loss_scaler_state(zopt) -> Optional[dict]:
    """The live loss scaler's position, as saved by reshard_save: cur_scale, and where the scaler
    has them cur_iter, last_overflow_iter, cur_hysteresis (ints) and dynamic (bool); None without
    a loss scaler."""
    obj = _live_loss_scaler(zopt)
    if obj is None:
        return None
    out = {"cur_scale": float(obj.cur_scale)}
    for k in _LOSS_SCALER_FIELDS[1:]:
        if hasattr(obj, k):
            out[k] = int(getattr(obj, k))
    out["dynamic"] = bool(getattr(obj, "dynamic", getattr(obj, "dynamic_loss_scale", getattr(zopt, "dynamic_loss_scale",
                                                                                            False))))
    return out


def set_loss_scaler(zopt, saved) -> dict:
    """Sets the live loss scaler's position from a checkpoint's: ``saved`` is the global JSON's
    ``loss_scaler`` (DeepSpeed's pickled DynamicLossScaler, read as {"state": {...}}; FP16
    optimizers' cur_scale / cur_iter / last_overflow_iter fields; reshard_save's dict). Each of
    cur_scale, cur_iter, last_overflow_iter, cur_hysteresis that both sides have is carried; the
    scaler's configuration (scale_window, scale_factor, min_scale) stays the running job's.
    Returns {field: value} carried ({} when either side has no loss scaler)."""
    if isinstance(saved, dict) and isinstance(saved.get("state"), dict):  # a pickled LossScaler object
        saved = saved["state"]
    obj = _live_loss_scaler(zopt)
    if not isinstance(saved, dict) or obj is None or "cur_scale" not in saved:
        return {}
    out = {}
    for k in _LOSS_SCALER_FIELDS:
        v = saved.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and hasattr(obj, k):
            setattr(obj, k, type(getattr(obj, k))(v) if k != "cur_scale" else float(v))
            out[k] = getattr(obj, k)
    return out


def _collective_device() -> torch.device:
    """Where small collective tensors live: the current CUDA device on an NCCL group, else CPU."""
    if str(dist.get_backend()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_int(v: int, op: str = "sum") -> int:
    """Sum (op "sum") or max (op "max") of an int over every rank (collective)."""
    t = torch.tensor([int(v)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_float_max(v: float) -> float:
    """Max of a float over every rank (collective)."""
    t = torch.tensor([float(v)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _check_scheduler_state(sched, state, path: str) -> None:
    """Loads `state` into a shallow copy of the LR scheduler, before any tensor is written: a
    scheduler that refuses it (upstream's OptimizerParamScheduler asserts that the checkpoint's
    warmup / decay iterations equal the job's) fails the load while the job is untouched. The
    optimizer's lr / weight_decay, which a scheduler's step sets, are put back afterwards."""
    opt = getattr(sched, "optimizer", None)
    groups = list(getattr(opt, "param_groups", []) or [])
    saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in groups]
    try:
        copy.copy(sched).load_state_dict(copy.deepcopy(state))
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        raise reshard.InvalidArgument(
            f"{path}: the LR scheduler ({type(sched).__name__}) refuses the checkpoint's state: {e or type(e).__name__}. "
            "Start the job with the schedule it was saved with (upstream: the same --train-iters / --lr-decay-iters / "
            "--lr-warmup-iters), or let it choose (--override-opt_param-scheduler, "
            "--use-checkpoint-opt_param-scheduler); nothing was loaded") from None
    finally:
        for g, s in zip(groups, saved):
            g.update(s)


def fill_engine(view: EngineView, ckpt, *, seed: int, lr_scheduler=None, policies: Optional[dict] = None,
                verify: str = reshard.DEFAULT_VERIFY) -> Tuple[dict, dict]:
    """Loads the opened checkpoint ``ckpt`` (reshard.open_checkpoint) into the engine of ``view``:
    every tensor through reshard.load, then optimizer step, loss scale, ``lr_scheduler`` (default the
    engine's), engine.global_steps / global_samples / skipped_steps and the per-rank RNG state.
    Collective.

    Returns (report, global_state): reshard.load's report plus "rng", "bit16_check",
    "rank_peak_rss_bytes", "source_writer"; global_state is the checkpoint's global JSON (DeepSpeed
    files: iteration, tokens, the trainer's args, lr_scheduler, ...). Raises DataLoss when the
    checkpoint records no optimizer step or no iteration, and reshard.load's errors."""
    src_state = ckpt.state
    if src_state["step"] < 0:
        raise reshard.DataLoss(f"{ckpt.path}: the checkpoint records no optimizer step; refusing to load optimizer "
                               "moments without the step that their bias correction needs")
    if int(src_state["iteration"]) < 0:
        raise reshard.DataLoss(f"{ckpt.path}: the checkpoint records no iteration")
    engine, zopt, opt = view.engine, view.zopt, view.torch_opt
    glob = json.loads(src_state["json"] or "{}")
    if not isinstance(glob, dict):
        glob = {}
    sched = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler", None)
    if sched is not None and glob.get("lr_scheduler") is not None:
        _check_scheduler_state(sched, glob["lr_scheduler"], ckpt.path)
    layout = view.layout(for_save=False)
    tensors, created = view.buffers(layout, create_missing_state=True)
    report = reshard.load(ckpt, layout, tensors, comm=reshard.communicator(), policies=policies, verify=verify)

    # Only now, after every tensor was written: attach new state, set step and global state.
    view.after_write()
    step_value = int(src_state["step"])
    for g, part in enumerate(view.state_keys):
        st = opt.state[part]
        for (gg, kind), t in created.items():
            if gg == g:
                st[kind] = t
        # The step in the optimizer's own type: torch's optimizers keep a tensor, DeepSpeed's
        # (FusedAdam, DeepSpeedCPUAdam) a Python int per tensor (deepspeed/ops/adam).
        old = st.get("step")
        if torch.is_tensor(old):
            st["step"] = torch.tensor(float(step_value), dtype=old.dtype, device=old.device)
        elif isinstance(old, (int, float)) and not isinstance(old, bool):
            st["step"] = type(old)(step_value)
        elif type(opt).__module__.startswith("torch.optim"):
            st["step"] = torch.tensor(float(step_value))
        else:
            st["step"] = int(step_value)
    carried = set_loss_scaler(zopt, glob.get("loss_scaler"))
    if carried:
        report["loss_scaler"] = carried
    if sched is not None and glob.get("lr_scheduler") is not None:
        sched.load_state_dict(glob["lr_scheduler"])
    elif sched is not None:
        report["not_carried"].append("LR scheduler: the checkpoint records none; the scheduler starts fresh")
    iteration, consumed = int(src_state["iteration"]), int(src_state["consumed_samples"])
    engine.global_steps = iteration
    if consumed >= 0:
        engine.global_samples = consumed
    if "skipped_steps" in glob:
        engine.skipped_steps = int(glob["skipped_steps"])

    # The blob is data (reshard.rank_state): a typed one was checked before any write, a pickle
    # was removed by the load and is never unpickled.
    rank = view.rank
    st = report["state"]
    report["rng"] = reshard.rank_state.restore_or_reseed(st["per_rank"].get(rank), seed, iteration, rank,
                                                         refused=st.get("per_rank_refused", {}).get(rank))

    # The module's 16-bit copy must be what the fp32 master gives (what DeepSpeed's own step
    # writes): compare this rank's partition of each flat bit16 group with its fp32 partition.
    aside = {k[1]: t for k, t in created.items() if k[0] == "weight"}
    total_mismatch = all_reduce_int(view.bit16_mismatches(aside))
    report["bit16_check"] = ("module weights equal the fp32 master (downcast) on every rank" if total_mismatch == 0 else
                             f"{total_mismatch} module weight element(s) differ from the downcast fp32 master")
    report["rank_peak_rss_bytes"] = all_reduce_int(_peak_rss_bytes(), op="max")
    report["source_writer"] = ckpt.writer
    del report["state"]
    return report, glob


# ----------------------------------------------------------------------------------------------
# Upstream Megatron-DeepSpeed
# ----------------------------------------------------------------------------------------------


def _megatron():
    """Upstream's get_args, get_tokenizer, update_num_microbatches and mpu (megatron/__init__.py,
    megatron/core)."""
    try:
        import megatron
        from megatron.core import mpu
    except ImportError as e:
        raise reshard.FailedPrecondition(f"reshard.integrations.megatron_deepspeed.load_checkpoint runs inside a Megatron-DeepSpeed trainer "
                                         f"(import megatron failed: {e})") from None
    return megatron, mpu


def _view_of_upstream(engine, args, mpu, qkv_order: Optional[str]) -> Tuple[EngineView, dict]:
    L = int(args.num_layers)
    if qkv_order not in (None, "interleaved", "blocked"):
        raise reshard.InvalidArgument(f"qkv_order={qkv_order!r}: expected 'interleaved' or 'blocked'")
    order = qkv_order or live_qkv_order(engine.module, args)
    orders: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(orders, order)
    known = sorted({o for o in orders if o is not None})
    if len(known) != 1:
        raise reshard.Unsupported(f"the ranks' attention code reads the fused QKV rows in {known or 'no'} order(s); "
                                  "cannot load one order into every rank")
    try:
        vocab = int(megatron_tokenizer_vocab())
    except Exception:  # no tokenizer built (a trainer without one): args' vocab_size, else padded rows
        vocab = None
    model = model_config_from_args(args, vocab_size=vocab, qkv_order=known[0])
    if hasattr(engine, "grid"):  # GPTModelPipe on DeepSpeed's PipelineEngine
        grid = engine.grid
        tied = model["tied_embeddings"]
        return EngineView(engine, model, tp=grid.get_slice_parallel_world_size(),
                          pp=grid.get_pipe_parallel_world_size(), dp=grid.get_data_parallel_world_size(),
                          stage=grid.get_stage_id(), dp_rank=grid.get_data_parallel_id(),
                          tp_rank=grid.get_slice_parallel_rank(),
                          canonical=lambda n: pipe_canonical_name(n, L),
                          # TiedLayerSpec builds the whole embedding on the last stage too; only the
                          # word embedding is used there, its position table is dead.
                          dead=lambda c, s: tied and s > 0 and c == "embedding.position_embeddings.weight"), model
    if mpu.get_pipeline_model_parallel_world_size() != 1:
        raise reshard.Unsupported("a GPTModel engine (no PipelineEngine) with pipeline_model_parallel_size > 1")
    return EngineView(engine, model, tp=mpu.get_tensor_model_parallel_world_size(), pp=1,
                      dp=mpu.get_data_parallel_world_size(), stage=0, dp_rank=mpu.get_data_parallel_rank(),
                      tp_rank=mpu.get_tensor_model_parallel_rank(),
                      canonical=lambda n: plain_canonical_name(n, L)), model


def megatron_tokenizer_vocab() -> int:
    """The running trainer's tokenizer vocab size (megatron.get_tokenizer().vocab_size), the real
    vocab that upstream pads to args.padded_vocab_size."""
    megatron, _ = _megatron()
    return megatron.get_tokenizer().vocab_size


def load_checkpoint(model, optimizer=None, opt_param_scheduler=None, args=None, *, load_arg: str = "load",
                    step=None, policies: Optional[dict] = None, verify: str = reshard.DEFAULT_VERIFY, qkv_order: Optional[str] = None,
                    log: bool = True) -> int:
    """Drop-in for upstream Megatron-DeepSpeed's ``megatron.checkpointing.load_checkpoint`` on its
    DeepSpeed path: loads ``args.<load_arg>`` (the ``latest`` step, or ``step``) into the live engine
    ``model[0]`` (or ``model``) in place, whatever tp/pp/dp/ZeRO layout it was saved under, and
    returns the iteration. Collective: every rank calls it.

    Reads DeepSpeed checkpoints (upstream's own saves, ``global_stepN/``) and reshard's native ones.
    Sets what upstream's load sets: ``args.consumed_train_samples`` (and the micro-batch calculator),
    ``args.consumed_valid_samples``, ``args.consumed_train_tokens``, the LR scheduler
    (``opt_param_scheduler``, else the engine's), the engine's global_steps / global_samples, the
    loss scale, Megatron's checkpoint version. ``optimizer`` is unused (the engine holds it).
    ``policies``, ``verify``: as reshard.load (e.g. ``{"vocab_padding": "refuse"}``). ``qkv_order``:
    the fused QKV row order the running code reads ("interleaved" or "blocked"), only where
    :func:`live_qkv_order` cannot tell it. ``log``: print the load report's summary, warnings and
    what was not carried on rank 0; the whole report is ``load_checkpoint.last_report`` (None
    when nothing was loaded: a first start from an empty ``--load`` folder).

    A ``--load`` folder that does not exist or is empty starts the job from iteration 0 (the first
    start of a job run with ``--save X --load X``), as upstream does. Raises reshard.Error subclasses
    on every rank: Unsupported for ``--finetune`` / ``--no-load-optim`` (not mapped), other ZeRO
    stages, MoE, or a QKV order that cannot be told; reshard.load's errors otherwise."""
    t0 = time.time()
    megatron, mpu = _megatron()
    if args is None:
        args = megatron.get_args()
    engine = model[0] if isinstance(model, (list, tuple)) else model
    load_dir = getattr(args, load_arg, None)
    rank = dist.get_rank()
    for flag in ("finetune", "no_load_optim", "universal_checkpoint"):
        if getattr(args, flag, False):
            raise reshard.Unsupported(f"args.{flag} is set: reshard.integrations.megatron_deepspeed.load_checkpoint loads the whole training "
                                      f"state; use upstream's load_checkpoint for --{flag.replace('_', '-')}")
    if not load_dir:
        raise reshard.InvalidArgument(f"args.{load_arg} is not set: nothing to load")
    load_checkpoint.last_report = None
    if not os.path.isdir(load_dir) or not os.listdir(load_dir):
        if rank == 0:
            print(f"reshard: {load_dir} holds no checkpoint (missing or empty folder): starting from iteration 0",
                  flush=True)
        return 0
    view, model_dict = _view_of_upstream(engine, args, mpu, qkv_order)
    # The target's description goes to the reader too: DeepSpeed files are read with their own
    # `args`, a native checkpoint records its model; a file is only needed for formats without one.
    ckpt = reshard.open_checkpoint(load_dir, step=step)
    report, glob = fill_engine(view, ckpt, seed=int(getattr(args, "seed", 0)), lr_scheduler=opt_param_scheduler,
                               policies=policies, verify=verify)
    iteration = int(ckpt.state["iteration"])
    ckpt_args = glob.get("args", {})
    ckpt_args = ckpt_args.get("state", ckpt_args) if isinstance(ckpt_args, dict) else {}
    consumed = int(ckpt.state["consumed_samples"])
    if consumed < 0:
        consumed = int(ckpt_args.get("consumed_train_samples", -1))
    if consumed < 0:
        raise reshard.DataLoss(f"{ckpt.path}: the checkpoint records no consumed train samples; the data order "
                               "cannot resume where it stopped")
    args.consumed_train_samples = consumed
    if hasattr(megatron, "update_num_microbatches"):
        megatron.update_num_microbatches(consumed_samples=consumed)
    if "consumed_valid_samples" in ckpt_args:
        args.consumed_valid_samples = int(ckpt_args["consumed_valid_samples"])
    else:
        report["not_carried"].append("consumed valid samples: not recorded; starts at 0")
    tokens = glob.get("tokens", ckpt_args.get("consumed_train_tokens"))
    if tokens is not None:
        args.consumed_train_tokens = int(tokens)
    else:
        report["not_carried"].append("consumed train tokens: not recorded; starts at 0")
    try:  # the rows are already in the running code's order: nothing may re-order them after us
        from megatron.checkpointing import set_checkpoint_version
        set_checkpoint_version(3.0)
    except ImportError:
        pass
    report["hook_seconds"] = all_reduce_float_max(time.time() - t0)
    if log and rank == 0:
        print(f"reshard: loaded {ckpt.path} ({report['change']}) at iteration {iteration} in "
              f"{report['hook_seconds']:.2f} s; consumed samples {consumed}, tokens {args.consumed_train_tokens}; "
              f"QKV rows {model_dict['qkv_order']}; {report['bit16_check']}", flush=True)
        for w in report.get("warnings", []):
            print(f"reshard: WARNING: {w}", flush=True)
        for n in report.get("not_carried", []):
            print(f"reshard: not carried: {n}", flush=True)
    load_checkpoint.last_report = report
    return iteration


load_checkpoint.last_report = None  # set by each call; None until a checkpoint was loaded
