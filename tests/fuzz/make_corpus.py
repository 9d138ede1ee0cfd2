#!/usr/bin/env python3
"""Seed corpora for the libFuzzer targets.

Usage: .venv/bin/python tests/fuzz/make_corpus.py OUTDIR
Writes OUTDIR/zip/*.pt (small torch.save archives, when torch is importable) and
OUTDIR/pickle/*.pkl (their data.pkl records plus standard-library pickles of protocols 0-5).
"""
import argparse
import collections
import enum
import io
import os
import pickle
import random
import sys
import zipfile


class Color(enum.Enum):
    RED = 1


def main():
    out = sys.argv[1]
    zdir, pdir = os.path.join(out, "zip"), os.path.join(out, "pickle")
    os.makedirs(zdir, exist_ok=True)
    os.makedirs(pdir, exist_ok=True)

    random.seed(1)
    shared = [1, 2]
    plain = {
        "ints": [0, 1, -1, 255, 65536, -2**31, 2**31, 2**63 - 1, 2**64, -(2**100)],
        "floats": [0.0, -1.5, 3.25],
        "str": "h\u00e9llo\n'\"",
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"xy"),
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
        "set": {5, 6},
        "frozenset": frozenset({7}),
        "flags": [True, False, None],
        "shared": [shared, shared],
        "od": collections.OrderedDict([("b", 1)]),
        "ns": argparse.Namespace(k=3),
        "color": Color.RED,
    }
    for proto in range(6):
        with open(os.path.join(pdir, f"plain_p{proto}.pkl"), "wb") as f:
            pickle.dump(plain, f, protocol=proto)
    with open(os.path.join(pdir, "rng_state.pkl"), "wb") as f:
        pickle.dump(random.getstate(), f, protocol=2)

    try:
        import torch
    except ImportError:
        print("torch not importable: only pickle seeds written", file=sys.stderr)
        return
    torch.manual_seed(0)
    base = torch.arange(12, dtype=torch.float32)
    objs = {
        "tensors": {"f32": torch.randn(2, 3), "bf16": torch.ones(3, dtype=torch.bfloat16),
                    "i64": torch.arange(4), "b": torch.tensor([True, False]),
                    "u16": torch.tensor([1, 2], dtype=torch.uint16)},
        "views": {"base": base, "t": base.view(3, 4).t(), "off": base[2:8]},
        "state_dict": torch.nn.Linear(2, 2).state_dict(),
        "misc": {"args": argparse.Namespace(lr=0.1, dtype=torch.bfloat16), "size": torch.Size([2, 3]),
                 "set": {"a"}, "p": torch.nn.Parameter(torch.zeros(2)), "big": 2**80, "bytes": b"\x01"},
    }
    for name, obj in objs.items():
        for proto in (2, 4):
            buf = io.BytesIO()
            torch.save(obj, buf, pickle_protocol=proto)
            data = buf.getvalue()
            with open(os.path.join(zdir, f"{name}_p{proto}.pt"), "wb") as f:
                f.write(data)
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                with open(os.path.join(pdir, f"{name}_p{proto}.pkl"), "wb") as f:
                    f.write(z.read("archive/data.pkl"))


if __name__ == "__main__":
    main()
