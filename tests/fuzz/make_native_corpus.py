#!/usr/bin/env python3
"""Seed corpora for fuzz_safetensors and fuzz_metadata: real files written by reshard itself.

Usage: PYTHONPATH=python .venv/bin/python tests/fuzz/make_native_corpus.py OUTDIR
Writes OUTDIR/safetensors/*.safetensors (the rank files of small synth checkpoints cut to their
header plus 64 data bytes, and files from the `safetensors` package when installed: every dtype,
__metadata__, empty tensors) and OUTDIR/metadata/*.json (metadata.json of synth checkpoints of
several models and layouts: ZeRO 0/1/2/3, tp, pp, vpp, GQA, tied embeddings, padded vocab).
Needs the installed reshard package (scripts/setup.sh).
"""
import json
import os
import shutil
import struct
import sys
import tempfile

import reshard

BASE = dict(name="seed", num_layers=2, hidden=8, ffn=16, heads=2, query_groups=2, vocab=20, vocab_divisible_by=8,
            max_position_embeddings=16, swiglu=False, tied_embeddings=False, bias=True, norm="layernorm",
            param_dtype="bf16", optimizer="adam", qkv_version=3.0, tp_gt_groups="refuse")
CASES = [
    ({"num_layers": 1, "hidden": 4, "ffn": 8, "vocab": 8}, "tp=1,pp=1,dp=1,zero=0"),
    ({}, "tp=1,pp=1,dp=1,zero=0"),
    ({}, "tp=2,pp=1,dp=2,zero=1"),
    ({"swiglu": True, "bias": False, "norm": "rmsnorm"}, "tp=2,pp=2,dp=1,zero=1"),
    ({"tied_embeddings": True}, "tp=1,pp=2,dp=2,zero=1"),
    ({"heads": 4, "query_groups": 1, "tp_gt_groups": "replicate_kv", "hidden": 16}, "tp=2,pp=1,dp=1,zero=3"),
    ({"num_layers": 4}, "tp=1,pp=2,vpp=2,dp=1,zero=0"),
    ({"vocab": 17, "param_dtype": "fp16"}, "tp=2,pp=1,dp=1,zero=1"),
]


def main():
    out = sys.argv[1]
    sdir, mdir = os.path.join(out, "safetensors"), os.path.join(out, "metadata")
    os.makedirs(sdir, exist_ok=True)
    os.makedirs(mdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="native_corpus_")
    try:
        for i, (change, topo) in enumerate(CASES):
            m = dict(BASE, **change)
            root = os.path.join(tmp, f"c{i}")
            try:
                reshard.synth_checkpoint(root, m, topo, i)
            except reshard.Error as e:
                print(f"skip case {i} ({topo}): {e}")
                continue
            step = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
            shutil.copy(os.path.join(step, "metadata.json"), os.path.join(mdir, f"meta_{i}.json"))
            for f in sorted(os.listdir(step)):
                if f.endswith(".safetensors"):
                    data = open(os.path.join(step, f), "rb").read()
                    n = struct.unpack("<Q", data[:8])[0]
                    open(os.path.join(sdir, f"c{i}_{f}"), "wb").write(data[: 8 + n + 64])
                    break
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Hand-made headers: __metadata__, an empty tensor, a 0-d tensor, a 4-bit dtype.
    hand = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [16, 16]},
        "s": {"dtype": "I64", "shape": [], "data_offsets": [16, 24]},
        "f4": {"dtype": "F4", "shape": [4], "data_offsets": [24, 26]},
    }
    body = json.dumps(hand).encode()
    body += b" " * ((8 - (8 + len(body)) % 8) % 8)
    open(os.path.join(sdir, "hand.safetensors"), "wb").write(struct.pack("<Q", len(body)) + body + bytes(26))
    try:
        import torch
        from safetensors.torch import save
        ts = {f"t_{str(d).split('.')[-1]}": torch.zeros(3, 2, dtype=d)
              for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64, torch.bool,
                        torch.float64)}
        open(os.path.join(sdir, "st_dtypes.safetensors"), "wb").write(save(ts, metadata={"k": "v"}))
    except Exception as e:  # the package is optional
        print(f"no safetensors-package seeds: {e}")
    print(f"{len(os.listdir(sdir))} safetensors seeds, {len(os.listdir(mdir))} metadata seeds in {out}")


if __name__ == "__main__":
    main()
