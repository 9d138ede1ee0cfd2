"""A small Megatron-style GPT for producing real Megatron-DeepSpeed-shaped checkpoints.

Two front ends share the same layer code:

* ``build_gpt_pipe``: a DeepSpeed ``PipelineModule`` laid out like Megatron-DeepSpeed's
  ``GPTModelPipe`` (spec 0 = cast fn, 1 = embedding (``TiedLayerSpec('embed')`` when tied),
  2..L+1 = transformer layers, L+2 = final norm, L+3 = head (tied: the embedding again with a
  ``forward_fn``; untied: ``LMHeadPipe`` with ``lm_head.weight``), then an fp32 cast fn when bf16).
* ``GPTModel``: the non-pipeline variant with Megatron's module names
  (``language_model.embedding.word_embeddings.weight``, ``language_model.encoder.layers.N.*``,
  ``language_model.encoder.final_layernorm.*``, ``language_model.output_layer.weight``), used for
  ZeRO-2/3 on the plain DeepSpeed engine. Its ``state_dict_for_save_checkpoint`` gives Megatron's
  nested dict.

Tensor parallelism is real: column/row-parallel linears, a vocab-parallel embedding and a
vocab-parallel cross entropy, communicating over torch.distributed (gloo) groups built from the
DeepSpeed topology's ``model`` axis.

Every parameter is initialised from a *global* view: the full tensor is generated from the seed and
a stable per-parameter key, then the local TP shard is sliced out. The same seed therefore gives the
same global model under every (tp, pp, dp) layout.
"""

from __future__ import annotations

import argparse
import math
import zlib
from dataclasses import dataclass, asdict, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 8  # query groups; == heads means plain MHA
    ffn_hidden_size: int = 128
    swiglu: bool = False
    tied: bool = True  # tied input embedding / output head
    add_bias_linear: bool = True
    normalization: str = "layernorm"  # or "rmsnorm"
    layernorm_epsilon: float = 1e-5
    vocab_size: int = 256  # original (tokenizer) vocab
    make_vocab_size_divisible_by: int = 64
    seq_length: int = 64
    position_embeddings: bool = True  # learned absolute position embeddings
    init_method_std: float = 0.02
    bf16: bool = False
    fp16: bool = False  # DeepSpeed's fp16 (the engine casts the module to float16)
    seed: int = 1234
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, self.tp)

    def validate(self):
        assert self.hidden_size % self.num_attention_heads == 0
        assert self.num_attention_heads % self.num_key_value_heads == 0
        assert self.num_key_value_heads % self.tp == 0, "query groups must be divisible by tp"
        assert self.ffn_hidden_size % self.tp == 0
        assert self.normalization in ("layernorm", "rmsnorm")
        assert self.padded_vocab_size % self.tp == 0

    def to_dict(self):
        d = asdict(self)
        d["padded_vocab_size"] = self.padded_vocab_size
        return d


def padded_vocab_size(orig: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: smallest multiple of divisible_by * tp that is >= orig."""
    multiple = divisible_by * tp
    return ((orig + multiple - 1) // multiple) * multiple


# ----------------------------------------------------------------------------------------------
# Tensor-parallel state (a tiny stand-in for Megatron's mpu)
# ----------------------------------------------------------------------------------------------


class _TPState:
    group = None
    rank = 0
    size = 1


TP = _TPState()


def init_tensor_parallel(topology=None):
    """Create one gloo group per 'model' axis list of the DeepSpeed topology (all ranks call this
    in the same order) and remember this rank's group. With no topology / tp == 1 nothing is made."""
    TP.group, TP.rank, TP.size = None, 0, 1
    if topology is None:
        return
    tp = topology.get_dim("model")
    if tp == 1:
        return
    me = dist.get_rank()
    for ranks in topology.get_axis_comm_lists("model"):
        g = dist.new_group(ranks=ranks, backend="gloo")
        if me in ranks:
            TP.group, TP.size, TP.rank = g, len(ranks), ranks.index(me)


def set_tensor_parallel_for_test(rank: int, size: int, group=None):
    TP.group, TP.rank, TP.size = group, rank, size


def _all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place-ish all-reduce over the TP group; bf16/fp16 are reduced in fp32 (gloo)."""
    if TP.size == 1:
        return t
    if t.dtype in (torch.bfloat16, torch.float16):
        buf = t.float()
        dist.all_reduce(buf, op=op, group=TP.group)
        return buf.to(t.dtype)
    t = t.contiguous()
    dist.all_reduce(t, op=op, group=TP.group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone())


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, g):
        return g


def copy_to_tp(x):
    return _CopyToTP.apply(x) if TP.size > 1 else x


def reduce_from_tp(x):
    return _ReduceFromTP.apply(x) if TP.size > 1 else x


# ----------------------------------------------------------------------------------------------
# Deterministic global initialisation
# ----------------------------------------------------------------------------------------------


def _key_seed(seed: int, key: str) -> int:
    return zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF


def global_normal(seed: int, key: str, shape, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_key_seed(seed, key))
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def _tp_rows(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(TP.size, dim=0)[TP.rank].clone()


def _tp_cols(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(TP.size, dim=1)[TP.rank].clone()


def _mark_tp(p: nn.Parameter, partition_dim: int):
    # Megatron's attribute names (DeepSpeed also looks at tensor_model_parallel / model_parallel).
    p.tensor_model_parallel = True
    p.model_parallel = True
    p.partition_dim = partition_dim
    p.partition_stride = 1
    return p


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """Plain LayerNorm computed in fp32 (names: weight, bias)."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.normalization == "layernorm":
        return LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class FinalNorm(nn.Module):
    """Final LayerNorm/RMSNorm as its own pipeline layer (parameters named weight[, bias])."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm_is_ln = cfg.normalization == "layernorm"
        self.eps = cfg.layernorm_epsilon
        self.hidden = cfg.hidden_size
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        if self.norm_is_ln:
            self.bias = nn.Parameter(torch.zeros(cfg.hidden_size))

    def forward(self, x):
        xf = x.float()
        if self.norm_is_ln:
            y = F.layer_norm(xf, (self.hidden, ), self.weight.float(), self.bias.float(), self.eps)
        else:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features): weight [out/tp, in], bias [out/tp]."""

    def __init__(self, weight: torch.Tensor, bias: bool, local: bool = False):
        """weight: the global [out, in] tensor (sliced here), or this rank's rows if local."""
        super().__init__()
        w = weight.clone() if local else _tp_rows(weight)
        self.weight = _mark_tp(nn.Parameter(w), 0)
        if bias:
            self.bias = _mark_tp(nn.Parameter(torch.zeros(w.shape[0])), 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        x = copy_to_tp(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features): weight [out, in/tp]; bias [out]
    replicated and added after the all-reduce."""

    def __init__(self, global_weight: torch.Tensor, bias: bool):
        super().__init__()
        self.weight = _mark_tp(nn.Parameter(_tp_cols(global_weight)), 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(global_weight.shape[0]))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows [r*Vp/tp, (r+1)*Vp/tp) on TP rank r: mask, look up, all-reduce."""

    def __init__(self, cfg: GPTConfig, key: str = "word_embeddings"):
        super().__init__()
        vp = cfg.padded_vocab_size
        full = global_normal(cfg.seed, key, (cfg.vocab_size, cfg.hidden_size), cfg.init_method_std)
        if vp > cfg.vocab_size:
            pad = global_normal(cfg.seed, f"{key}.pad{vp}", (vp - cfg.vocab_size, cfg.hidden_size),
                                cfg.init_method_std)
            full = torch.cat([full, pad], 0)
        self.per_rank = vp // TP.size
        self.start = TP.rank * self.per_rank
        self.weight = _mark_tp(nn.Parameter(_tp_rows(full)), 0)

    def forward(self, ids):
        if TP.size > 1:
            mask = (ids < self.start) | (ids >= self.start + self.per_rank)
            local = (ids - self.start).masked_fill(mask, 0)
            out = F.embedding(local, self.weight)
            out = out.masked_fill(mask.unsqueeze(-1), 0.0)
            return reduce_from_tp(out)
        return F.embedding(ids, self.weight)


def parallel_lm_logits(hidden, weight):
    """Logits for this rank's vocab slice: [..., Vp/tp] (kept vocab-parallel)."""
    return F.linear(copy_to_tp(hidden), weight)


class _VocabParallelCE(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target):
        # logits [N, V/tp] float32; target [N] global ids
        vlocal = logits.shape[-1]
        start = TP.rank * vlocal
        lmax = logits.max(dim=-1)[0]
        lmax = _all_reduce(lmax, op=dist.ReduceOp.MAX)
        logits = logits - lmax.unsqueeze(-1)
        mask = (target < start) | (target >= start + vlocal)
        local_t = (target - start).masked_fill(mask, 0)
        picked = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(mask, 0.0)
        picked = _all_reduce(picked)
        exp = logits.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1))
        loss = torch.log(sum_exp) - picked
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, mask, local_t)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, mask, local_t = ctx.saved_tensors
        grad = softmax.clone()
        upd = (~mask).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -upd.unsqueeze(-1))
        return grad * g.unsqueeze(-1), None


def vocab_parallel_cross_entropy(logits, target):
    """Per-token loss; logits [..., V/tp] (cast to fp32), target [...]."""
    shape = target.shape
    loss = _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]).float().contiguous(), target.reshape(-1))
    return loss.view(shape)


def cross_entropy_loss(output, labels):
    """Pipeline loss_fn: mean token loss over the micro-batch (all tokens count)."""
    return vocab_parallel_cross_entropy(output, labels).mean()


class ParallelAttention(nn.Module):
    """Causal self-attention with a fused, grouped QKV (checkpoint_version 3.0 layout):
    global rows = [ng, nq/ng + 2, hn] (per group: its query heads, one K head, one V head);
    TP rank r holds groups [r*ng/tp, (r+1)*ng/tp)."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        H, nq, ng, hn = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qpg = nq // ng
        self.ng_local = ng // TP.size
        self.hn = hn
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        rows = ng * (self.qpg + 2) * hn
        qkv = global_normal(cfg.seed, f"layers.{layer}.qkv", (rows, H), std)
        self.query_key_value = ColumnParallelLinear(qkv, cfg.add_bias_linear)
        dense = global_normal(cfg.seed, f"layers.{layer}.dense", (H, nq * hn), out_std)
        self.dense = RowParallelLinear(dense, cfg.add_bias_linear)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.ng_local, self.qpg + 2, self.hn)
        q = qkv[:, :, :, :self.qpg, :].reshape(b, s, self.ng_local * self.qpg, self.hn)
        k = qkv[:, :, :, self.qpg, :]
        v = qkv[:, :, :, self.qpg + 1, :]
        if self.qpg > 1:
            k = k.repeat_interleave(self.qpg, dim=2)
            v = v.repeat_interleave(self.qpg, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hn]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx = ctx.transpose(1, 2).reshape(b, s, -1)
        return self.dense(ctx)


class ParallelMLP(nn.Module):
    """dense_h_to_4h (column-parallel; SwiGLU: per rank [gate_r; up_r]) and dense_4h_to_h (row)."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        H, ffn = cfg.hidden_size, cfg.ffn_hidden_size
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        self.swiglu = cfg.swiglu
        if cfg.swiglu:
            gate = global_normal(cfg.seed, f"layers.{layer}.gate", (ffn, H), std)
            up = global_normal(cfg.seed, f"layers.{layer}.up", (ffn, H), std)
            w = torch.cat([_tp_rows(gate), _tp_rows(up)], 0)  # local [gate_r; up_r]
            self.dense_h_to_4h = ColumnParallelLinear(w, cfg.add_bias_linear, local=True)
        else:
            w = global_normal(cfg.seed, f"layers.{layer}.h_to_4h", (ffn, H), std)
            self.dense_h_to_4h = ColumnParallelLinear(w, cfg.add_bias_linear)
        w2 = global_normal(cfg.seed, f"layers.{layer}.4h_to_h", (H, ffn), out_std)
        self.dense_4h_to_h = RowParallelLinear(w2, cfg.add_bias_linear)

    def forward(self, x):
        h = self.dense_h_to_4h(x)
        if self.swiglu:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h)
        return self.dense_4h_to_h(h)


class ParallelTransformerLayer(nn.Module):

    def __init__(self, cfg: GPTConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = make_norm(cfg)
        self.self_attention = ParallelAttention(cfg, layer_number)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = ParallelMLP(cfg, layer_number)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """Pipeline spec class (name contains 'Transformer' for partition_method='type:transformer')."""


class EmbeddingPipe(nn.Module):
    """word_embeddings [Vp/tp, H] (+ position_embeddings [seq, H]); hidden out [b, s, H]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg)
        if cfg.position_embeddings:
            self.position_embeddings = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(
                    global_normal(cfg.seed, "position_embeddings", (cfg.seq_length, cfg.hidden_size),
                                  cfg.init_method_std))
        else:
            self.position_embeddings = None

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        h = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            pos = torch.arange(ids.shape[1], device=ids.device)
            h = h + self.position_embeddings(pos).unsqueeze(0)
        return h


class LMHeadPipe(nn.Module):
    """Untied output head: lm_head.weight column-parallel [Vp/tp, H]; returns vocab-parallel logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        vp = cfg.padded_vocab_size
        full = global_normal(cfg.seed, "lm_head", (cfg.vocab_size, cfg.hidden_size), cfg.init_method_std)
        if vp > cfg.vocab_size:
            pad = global_normal(cfg.seed, f"lm_head.pad{vp}", (vp - cfg.vocab_size, cfg.hidden_size),
                                cfg.init_method_std)
            full = torch.cat([full, pad], 0)
        self.lm_head = ColumnParallelLinear(full, bias=False)

    def forward(self, h):
        return self.lm_head(h)


def _to_float16_fn(bf16: bool):

    def _to_float16(inputs):
        # Megatron casts floating inputs only; token ids stay integer.
        if bf16 and torch.is_tensor(inputs) and inputs.is_floating_point():
            return inputs.bfloat16()
        return inputs

    return _to_float16


def float16_to_fp32(x):
    return x.float() if torch.is_tensor(x) and x.dtype in (torch.bfloat16, torch.float16) else x


def _logits_helper(embedding, lm_output):
    return parallel_lm_logits(lm_output, embedding.word_embeddings_weight)


# ----------------------------------------------------------------------------------------------
# Pipeline model (GPTModelPipe)
# ----------------------------------------------------------------------------------------------


def build_gpt_pipe(cfg: GPTConfig, topology):
    """Build the PipelineModule. init_tensor_parallel(topology) must have been called."""
    from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
    cfg.validate()
    specs = [_to_float16_fn(cfg.bf16)]
    if cfg.tied:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, cfg, tied_weight_attr="word_embeddings_weight"))
    else:
        specs.append(LayerSpec(EmbeddingPipe, cfg))
    for i in range(cfg.num_layers):
        specs.append(LayerSpec(ParallelTransformerLayerPipe, cfg, layer_number=i))
    specs.append(LayerSpec(FinalNorm, cfg))
    if cfg.tied:
        specs.append(
            TiedLayerSpec("embed", EmbeddingPipe, cfg, forward_fn=_logits_helper,
                          tied_weight_attr="word_embeddings_weight"))
    else:
        specs.append(LayerSpec(LMHeadPipe, cfg))
    if cfg.bf16:
        specs.append(float16_to_fp32)
    module = PipelineModule(layers=specs, loss_fn=cross_entropy_loss, topology=topology,
                            activation_checkpoint_interval=0, partition_method="type:transformer")
    module.gpt_config = cfg
    return module


def pipe_universal_checkpoint_info(cfg: GPTConfig) -> dict:
    """Megatron-DeepSpeed-style regex lists for the pipeline names, restricted to patterns that
    match a parameter of this configuration (ds_to_universal's strict mode rejects unused ones)."""
    L0 = 2  # first transformer spec index
    emb = "tied_modules.embed" if cfg.tied else r"\d+"
    vocab = [rf"{emb}.word_embeddings.weight"]
    if not cfg.tied:
        vocab.append(r"\d+.lm_head.weight")
    pipe_repl = []
    if cfg.tied:
        pipe_repl.append(r"tied_modules.embed.word_embeddings.weight")
        if cfg.position_embeddings:
            pipe_repl.append(r"tied_modules.embed.position_embeddings.weight")
    tp_repl = []
    if cfg.position_embeddings:
        tp_repl.append(rf"{emb}.position_embeddings.weight")
    tp_repl += [r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight"]
    if cfg.normalization == "layernorm":
        tp_repl += [r"\d+.input_layernorm.bias", r"\d+.post_attention_layernorm.bias"]
    if cfg.add_bias_linear:
        tp_repl += [r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias"]
    tp_repl.append(r"\d+.weight")
    if cfg.normalization == "layernorm":
        tp_repl.append(r"\d+.bias")
    info = {
        "vocabulary_parameter_patterns": vocab,
        "pipeline_replicated_parameter_patterns": pipe_repl,
        "tp_replicated_parameter_patterns": tp_repl,
        "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
    }
    if cfg.swiglu:
        sw = [r"\d+.mlp.dense_h_to_4h.weight"]
        if cfg.add_bias_linear:
            sw.append(r"\d+.mlp.dense_h_to_4h.bias")
        info["parameter_with_2_sub_params_cat_dim_0"] = sw
    del L0
    return info


# ----------------------------------------------------------------------------------------------
# Non-pipeline model (GPTModel with Megatron's module names)
# ----------------------------------------------------------------------------------------------


class _Embedding(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg)
        if cfg.position_embeddings:
            self.position_embeddings = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(
                    global_normal(cfg.seed, "position_embeddings", (cfg.seq_length, cfg.hidden_size),
                                  cfg.init_method_std))
        else:
            self.position_embeddings = None

    def forward(self, ids):
        h = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            h = h + self.position_embeddings(torch.arange(ids.shape[1], device=ids.device)).unsqueeze(0)
        return h


class _Encoder(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([ParallelTransformerLayer(cfg, i) for i in range(cfg.num_layers)])
        self.final_layernorm = FinalNorm(cfg)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.final_layernorm(h)


class _LanguageModel(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.embedding = _Embedding(cfg)
        self.encoder = _Encoder(cfg)
        if not cfg.tied:
            self.output_layer = LMHeadPipe(cfg).lm_head  # ColumnParallelLinear, weight [Vp/tp, H]

    def forward(self, ids):
        return self.encoder(self.embedding(ids))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class GPTModel(nn.Module):
    """Non-pipeline GPT with Megatron-DeepSpeed's names; forward(ids, labels) -> mean loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.validate()
        assert cfg.pp == 1, "the non-pipeline model runs one pipeline stage"
        self.gpt_config = cfg
        self.language_model = _LanguageModel(cfg)

    def forward(self, ids, labels):
        h = self.language_model(ids)
        if self.gpt_config.tied:
            w = self.language_model.embedding.word_embeddings.weight
        else:
            w = self.language_model.output_layer.weight
        logits = parallel_lm_logits(h, w)
        return vocab_parallel_cross_entropy(logits, labels).mean()

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """Megatron's nested layout: {'language_model': {'embedding': {'word_embeddings': {...},
        'position_embeddings': {...}}, 'encoder': {flat names}, 'output_layer': {...}}}."""
        lm = self.language_model
        emb = {"word_embeddings": lm.embedding.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)}
        if lm.embedding.position_embeddings is not None:
            emb["position_embeddings"] = lm.embedding.position_embeddings.state_dict(prefix=prefix,
                                                                                     keep_vars=keep_vars)
        out = {"embedding": emb, "encoder": lm.encoder.state_dict(prefix=prefix, keep_vars=keep_vars)}
        if not self.gpt_config.tied:
            out["output_layer"] = lm.output_layer.state_dict(prefix=prefix, keep_vars=keep_vars)
        return {"language_model": out}

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Accepts the nested Megatron layout or the flat torch layout."""
        if "language_model" in state_dict and isinstance(state_dict["language_model"], dict):
            state_dict = _flatten(state_dict)
        return super().load_state_dict(state_dict, strict=strict)


def gpt_universal_checkpoint_info(cfg: GPTConfig) -> dict:
    """Regex lists of the non-pipeline (GPTModel) names for Universal Checkpointing."""
    pre = r"language_model.encoder.layers.\d+"
    vocab = [r"language_model.embedding.word_embeddings.weight"]
    if not cfg.tied:
        vocab.append(r"language_model.output_layer.weight")
    tp_repl = [rf"{pre}.input_layernorm.weight", rf"{pre}.post_attention_layernorm.weight",
               r"language_model.encoder.final_layernorm.weight"]
    if cfg.position_embeddings:
        tp_repl.append(r"language_model.embedding.position_embeddings.weight")
    if cfg.normalization == "layernorm":
        tp_repl += [rf"{pre}.input_layernorm.bias", rf"{pre}.post_attention_layernorm.bias",
                    r"language_model.encoder.final_layernorm.bias"]
    if cfg.add_bias_linear:
        tp_repl += [rf"{pre}.self_attention.dense.bias", rf"{pre}.mlp.dense_4h_to_h.bias"]
    info = {
        "vocabulary_parameter_patterns": vocab,
        "pipeline_replicated_parameter_patterns": [],
        "tp_replicated_parameter_patterns": tp_repl,
        "parameter_with_row_parallelism_patterns": [rf"{pre}.mlp.dense_4h_to_h.weight", rf"{pre}.self_attention.dense.weight"],
    }
    if cfg.swiglu:
        sw = [rf"{pre}.mlp.dense_h_to_4h.weight"]
        if cfg.add_bias_linear:
            sw.append(rf"{pre}.mlp.dense_h_to_4h.bias")
        info["parameter_with_2_sub_params_cat_dim_0"] = sw
    return info


# ----------------------------------------------------------------------------------------------
# Megatron-style parameter groups and checkpoint client state
# ----------------------------------------------------------------------------------------------


def get_param_groups(module: nn.Module, weight_decay: float):
    """Megatron's split: 2-D weights decay; biases and 1-D (norm) params do not. Only non-empty
    groups are returned, in Megatron's order (wd_no_scale_lr, no_wd_no_scale_lr)."""
    wd, no_wd = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith(".bias") or p.dim() == 1:
            no_wd.append(p)
        else:
            wd.append(p)
    groups = []
    if wd:
        groups.append({"name": "wd_no_scale_lr", "params": wd, "wd_mult": 1.0, "lr_mult": 1.0,
                       "weight_decay": weight_decay})
    if no_wd:
        groups.append({"name": "no_wd_no_scale_lr", "params": no_wd, "wd_mult": 0.0, "lr_mult": 1.0,
                       "weight_decay": 0.0})
    return groups


def megatron_args_namespace(cfg: GPTConfig, extra: Optional[dict] = None) -> argparse.Namespace:
    """The argparse.Namespace Megatron-DeepSpeed stores under 'args' (model / parallel subset)."""
    ns = argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        group_query_attention=cfg.num_key_value_heads != cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.seq_length,
        position_embedding_type="learned_absolute" if cfg.position_embeddings else "none",
        swiglu=cfg.swiglu,
        untie_embeddings_and_output_weights=not cfg.tied,
        add_bias_linear=cfg.add_bias_linear,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=cfg.padded_vocab_size,
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        data_parallel_size=cfg.dp,
        world_size=cfg.tp * cfg.pp * cfg.dp,
        params_dtype=torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        init_method_std=cfg.init_method_std,
        seed=cfg.seed,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        deepspeed=True,
        no_pipeline_parallel=False,
    )
    for k, v in (extra or {}).items():
        setattr(ns, k, v)
    return ns
