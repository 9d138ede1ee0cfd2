"""The GPT-style model the benchmark uses, sized to a number of bytes of training state.

One description serves the three writers: the native synth (a model YAML), the DeepSpeed reference
trainer (integration/megatron_deepspeed flags) and PyTorch DCP (tensor names, global shapes and the
dim tensor parallelism splits). State per parameter: bf16 weight (2 B) + fp32 master, exp_avg and
exp_avg_sq (12 B) = 14 B. GB = 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
import json

BYTES_PER_PARAM = 14


@dataclasses.dataclass
class GPT:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int  # a multiple of 512, so no padding at any tp <= 8 (divisible_by 64)
    max_pos: int = 64

    def tensors(self):
        """[(name, global shape, tp split dim or None)] in Megatron naming."""
        H, F = self.hidden, self.ffn
        out = [("embedding.word_embeddings.weight", (self.vocab, H), 0),
               ("embedding.position_embeddings.weight", (self.max_pos, H), None)]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "input_layernorm.weight", (H, ), None), (p + "input_layernorm.bias", (H, ), None),
                    (p + "self_attention.query_key_value.weight", (3 * H, H), 0),
                    (p + "self_attention.query_key_value.bias", (3 * H, ), 0),
                    (p + "self_attention.dense.weight", (H, H), 1), (p + "self_attention.dense.bias", (H, ), None),
                    (p + "post_attention_layernorm.weight", (H, ), None),
                    (p + "post_attention_layernorm.bias", (H, ), None),
                    (p + "mlp.dense_h_to_4h.weight", (F, H), 0), (p + "mlp.dense_h_to_4h.bias", (F, ), 0),
                    (p + "mlp.dense_4h_to_h.weight", (H, F), 1), (p + "mlp.dense_4h_to_h.bias", (H, ), None)]
        out += [("final_layernorm.weight", (H, ), None), ("final_layernorm.bias", (H, ), None)]
        return out

    def params(self) -> int:
        n = 0
        for _, shape, _ in self.tensors():
            k = 1
            for d in shape:
                k *= d
            n += k
        return n

    def state_bytes(self) -> int:
        return self.params() * BYTES_PER_PARAM

    def yaml(self) -> str:
        return "\n".join([
            "# Written by benchmarks/bench.py: the benchmark's GPT-style model (tied embeddings, learned",
            "# positions, GeLU MLP, biases, LayerNorm, bf16 weights + Adam state).",
            "name: bench-gpt", f"num_layers: {self.layers}", f"hidden: {self.hidden}", f"ffn: {self.ffn}",
            f"heads: {self.heads}", f"vocab: {self.vocab}", "vocab_divisible_by: 64",
            f"max_position_embeddings: {self.max_pos}", "swiglu: false", "tied_embeddings: true", "bias: true",
            "norm: layernorm", "param_dtype: bf16", "optimizer: adam", ""
        ])

    def trainer_flags(self):
        """Flags of integration/megatron_deepspeed/train.py for the same model (bf16 + fp32 master)."""
        return ["--layers", str(self.layers), "--hidden", str(self.hidden), "--heads", str(self.heads), "--ffn",
                str(self.ffn), "--vocab-size", str(self.vocab), "--make-vocab-size-divisible-by", "64",
                "--seq-length", str(self.max_pos), "--bf16"]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def size_model(target_bytes: float, layer_multiple: int = 1) -> GPT:
    """A GPT whose training state is close to target_bytes: hidden grows with size, layers fill
    (a multiple of layer_multiple, so every pipeline size used divides them)."""
    if target_bytes < 0.6e9:
        hidden, vocab = 512, 8192
    elif target_bytes < 6e9:
        hidden, vocab = 1024, 32768
    elif target_bytes < 40e9:
        hidden, vocab = 2048, 50176
    else:
        hidden, vocab = 4096, 50176
    best = None
    for layers in range(layer_multiple, 400, layer_multiple):
        g = GPT(layers=layers, hidden=hidden, heads=hidden // 64, ffn=4 * hidden, vocab=vocab)
        if best is None or abs(g.state_bytes() - target_bytes) < abs(best.state_bytes() - target_bytes):
            best = g
        if g.state_bytes() > target_bytes:
            break
    return best


def parse_layout(s: str) -> dict:
    d = {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "zero": 0}
    for kv in s.split(","):
        k, v = kv.split("=")
        d[k.strip()] = int(v)
    d["world"] = d["tp"] * d["pp"] * d["dp"]
    return d


def short_layout(s: str) -> str:
    d = parse_layout(s)
    return f"tp{d['tp']}pp{d['pp']}dp{d['dp']}z{d['zero']}"
