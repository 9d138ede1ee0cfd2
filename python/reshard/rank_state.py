"""Per-rank state (random generators, sampler positions, anything a trainer adds) as typed data.

A checkpoint is data: reshard never turns a per-rank blob into code or arbitrary objects (no
pickle). A trainer captures its rank's state with :func:`capture`, hands the bytes to
:func:`reshard.save` as ``state["per_rank"][rank]``, and on resume at the identical layout
gives the blob :func:`reshard.load` returns to :func:`restore_or_reseed`. The encoding
(docs/format.md, "Per-rank state") is UTF-8 JSON::

    {"format": "reshard.rank_state", "version": 1,
     "python_random": {"version": 3, "state": [625 ints], "gauss_next": null | float},
     "numpy": {"bit_generator": "MT19937", "key": [624 ints], "pos": int, "has_gauss": 0 | 1,
               "cached_gaussian": float},
     "torch_cpu": "<base64 of torch.get_rng_state(), a uint8 tensor>",
     "torch_cuda": ["<base64 per device>", ...] | null,
     "extra": {...}}                    # JSON values only: the trainer's own positions and counters

written compactly with ``format`` first, so every blob in this encoding begins with the bytes
:data:`MAGIC`. Such a blob must decode exactly (types, lengths, ranges) or it is refused as
damaged; it is never partly applied. Limits: at most :data:`MAX_BYTES` bytes and
:data:`MAX_DEPTH` levels of nesting in ``extra``.

Blobs of other kinds are recognised by :func:`kind` and never decoded into objects: ``"pickle"``
(what this project's trainer hook wrote before the typed encoding, and what many trainers write:
it can run any code when unpickled, so it is not read at all), ``"json"`` (the JSON rendering of
a DeepSpeed/Megatron ``rng_state`` that reshard's DeepSpeed reader gives; plain data), and
``"bytes"`` (anything else: handed to the caller as bytes, never interpreted here).

Errors: :class:`reshard.DataLoss` for a damaged or oversized typed blob (names the rank and the
field), :class:`reshard.Unsupported` for a typed blob of a newer version.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np
import torch

from . import _C

FORMAT = "reshard.rank_state"
VERSION = 1
MAGIC = b'{"format":"reshard.rank_state"'
#: Largest typed blob accepted (bytes). The generators take about 25 KB; the rest is ``extra``.
MAX_BYTES = 4 << 20
#: Deepest nesting of lists and objects accepted anywhere in a typed blob.
MAX_DEPTH = 32
_PY_STATE_LEN = 625  # CPython's Mersenne Twister: 624 words and the index (random.getstate()[1])
_NP_KEY_LEN = 624  # numpy's legacy MT19937: 624 uint32 words
_U32 = 1 << 32
_KEYS = ("format", "version", "python_random", "numpy", "torch_cpu", "torch_cuda", "extra")


@dataclass
class RankState:
    """A decoded per-rank blob: every field checked, nothing applied yet."""
    python_random: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    torch_cuda: Optional[List[torch.Tensor]]
    extra: Any = field(default_factory=dict)


def kind(blob: bytes) -> str:
    """What a per-rank blob is, from its first bytes only: "typed" (this encoding), "pickle" (a
    pickle of protocol 2 or later: never unpickled), "json" (another JSON object or list, such as
    the DeepSpeed reader's rendering of Megatron's rng_state) or "bytes"."""
    b = bytes(blob[:len(MAGIC)])
    if b.startswith(MAGIC):
        return "typed"
    if len(b) >= 2 and b[0] == 0x80 and 2 <= b[1] <= 5:  # PROTO opcode (pickle protocols 2-5)
        return "pickle"
    if b[:1] in (b"{", b"["):
        return "json"
    return "bytes"


def capture(extra: Any = None, *, cuda: Optional[bool] = None) -> bytes:
    """This process's generators (python ``random``, numpy's global legacy generator, torch's CPU
    generator and, when ``cuda`` is true or None with CUDA initialised, every CUDA device's) plus
    ``extra`` (JSON values: a dict of the trainer's own positions and counters) as one typed blob.

    Raises InvalidArgument when ``extra`` is not JSON data or the blob would exceed MAX_BYTES."""
    pv, pstate, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if cuda is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    doc = {
        "format": FORMAT, "version": VERSION,
        "python_random": {"version": int(pv), "state": [int(x) for x in pstate], "gauss_next": gauss},
        "numpy": {"bit_generator": str(name), "key": [int(x) for x in key], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if cuda else None,
        "extra": {} if extra is None else extra,
    }
    try:
        blob = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise _C.InvalidArgument(f"rank_state.capture: extra must be JSON data (dicts, lists, str, int, finite "
                                 f"float, bool, None): {e}") from None
    if len(blob) > MAX_BYTES:
        raise _C.InvalidArgument(f"rank_state.capture: the blob is {len(blob)} bytes, more than the limit of "
                                 f"{MAX_BYTES}; keep large trainer state in tensors, not in extra")
    return blob


def decode(blob: bytes, *, rank: int, where: str = "per-rank state") -> RankState:
    """Checks and decodes a typed blob (``kind(blob) == "typed"``) without applying it.

    Raises DataLoss naming ``where``, ``rank`` and the field for anything that is not exactly this
    encoding (size over MAX_BYTES, bad UTF-8 or JSON, a missing, unknown or ill-typed field, a list
    of the wrong length, a value out of range, a torch state of another size than this torch's
    generator), Unsupported for a version newer than VERSION."""
    def bad(what: str):
        return _C.DataLoss(f"[rank {rank}] {where}: {what}; the blob is damaged or was not written by "
                           "reshard.rank_state.capture (nothing of it was applied)")

    if len(blob) > MAX_BYTES:
        raise bad(f"{len(blob)} bytes, more than the limit of {MAX_BYTES}")
    if not bytes(blob[:len(MAGIC)]) == MAGIC:
        raise bad("it does not begin with the typed encoding's magic " + MAGIC.decode())
    try:
        doc = json.loads(bytes(blob).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not UTF-8 JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(doc, dict):
        raise bad("not a JSON object")
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(repr, unknown))}")
    missing = [k for k in _KEYS if k not in doc]
    if missing:
        raise bad(f"missing field(s) {', '.join(map(repr, missing))}")
    if doc["format"] != FORMAT:
        raise bad(f"field format={doc['format']!r}, not {FORMAT!r}")
    v = doc["version"]
    if not _is_int(v) or v < 1:
        raise bad(f"field version={v!r} is not a positive integer")
    if v > VERSION:
        raise _C.Unsupported(f"[rank {rank}] {where}: typed encoding version {v}, newer than this reshard's "
                             f"{VERSION}; upgrade reshard to restore it")
    if _depth(doc["extra"]) > MAX_DEPTH:
        raise bad(f"field extra nests deeper than {MAX_DEPTH} levels")

    pr = doc["python_random"]
    if not isinstance(pr, dict) or set(pr) != {"version", "state", "gauss_next"}:
        raise bad("field python_random must be an object with version, state, gauss_next")
    if pr["version"] != 3 or not _is_int(pr["version"]):
        raise bad(f"field python_random.version={pr['version']!r}, not 3 (CPython's Mersenne Twister)")
    st = pr["state"]
    if not (isinstance(st, list) and len(st) == _PY_STATE_LEN and all(_is_int(x) and 0 <= x < _U32 for x in st)):
        raise bad(f"field python_random.state must be {_PY_STATE_LEN} integers in [0, 2^32)")
    if st[-1] > 624:
        raise bad(f"field python_random.state: index {st[-1]} > 624")
    g = pr["gauss_next"]
    if g is not None and not (_is_float(g) and math.isfinite(g)):
        raise bad(f"field python_random.gauss_next={g!r} is neither null nor a finite number")

    nd = doc["numpy"]
    if not isinstance(nd, dict) or set(nd) != {"bit_generator", "key", "pos", "has_gauss", "cached_gaussian"}:
        raise bad("field numpy must be an object with bit_generator, key, pos, has_gauss, cached_gaussian")
    if nd["bit_generator"] != "MT19937":
        raise bad(f"field numpy.bit_generator={nd['bit_generator']!r}, not 'MT19937'")
    key = nd["key"]
    if not (isinstance(key, list) and len(key) == _NP_KEY_LEN and all(_is_int(x) and 0 <= x < _U32 for x in key)):
        raise bad(f"field numpy.key must be {_NP_KEY_LEN} integers in [0, 2^32)")
    if not (_is_int(nd["pos"]) and 0 <= nd["pos"] <= 624):
        raise bad(f"field numpy.pos={nd['pos']!r} is not an integer in [0, 624]")
    if nd["has_gauss"] not in (0, 1) or not _is_int(nd["has_gauss"]):
        raise bad(f"field numpy.has_gauss={nd['has_gauss']!r} is not 0 or 1")
    cg = nd["cached_gaussian"]
    if not (_is_float(cg) and math.isfinite(cg)):
        raise bad(f"field numpy.cached_gaussian={cg!r} is not a finite number")

    want = torch.get_rng_state().numel()
    cpu = _unb64(doc["torch_cpu"], want, "torch_cpu", bad)
    cuda = doc["torch_cuda"]
    if cuda is not None:
        if not isinstance(cuda, list) or len(cuda) > 4096:
            raise bad("field torch_cuda must be null or a list of base64 strings (one per device)")
        cuda = [_unb64(s, None, f"torch_cuda[{i}]", bad) for i, s in enumerate(cuda)]
    return RankState(python_random=(3, tuple(st), g),
                     numpy=("MT19937", np.asarray(key, dtype=np.uint32), int(nd["pos"]), int(nd["has_gauss"]),
                            float(cg)),
                     torch_cpu=cpu, torch_cuda=cuda, extra=doc["extra"])


def restore(state: RankState) -> str:
    """Sets this process's generators from a decoded blob; returns what was restored, in words.
    CUDA generators are restored when the blob has them and this process sees the same number of
    devices; otherwise the words say they were not."""
    random.setstate(state.python_random)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch_cpu)
    done = "python, numpy and torch CPU generators"
    if state.torch_cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state.torch_cuda):
            torch.cuda.set_rng_state_all(state.torch_cuda)
            done += f" and {len(state.torch_cuda)} CUDA generator(s)"
        else:
            done += (f"; the {len(state.torch_cuda)} CUDA generator(s) saved were not restored (this process sees "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} device(s))")
    return done


def reseed(seed: int, iteration: int, rank: int) -> int:
    """Seeds python, numpy and torch deterministically from (seed, iteration, rank); returns the
    seed used: (seed * 1000003 + iteration * 7919 + rank) mod (2^31 - 1)."""
    s = (int(seed) * 1_000_003 + int(iteration) * 7919 + int(rank)) % (2**31 - 1)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    return s


def restore_or_reseed(blob: Optional[bytes], seed: int, iteration: int, rank: int,
                      refused: Optional[str] = None) -> str:
    """What a trainer calls on resume with this rank's blob from ``reshard.load``'s
    ``report["state"]["per_rank"]`` (None when the layout changed or the save had none): restores
    a typed blob, restores python ``random`` from a DeepSpeed/Megatron rng_state rendered as JSON
    (its numpy and torch states reference tensor storages the reader does not hand over, so those
    two reseed), and reseeds every generator deterministically otherwise, including for a pickle,
    which is never unpickled. ``refused``: why the load withheld this rank's blob (its
    ``report["state"]["per_rank_refused"].get(rank)``, e.g. "pickle"), said in the words returned.
    Returns what was done, for the load report.

    Raises as :func:`decode` for a damaged typed blob (reshard.load already refused one before
    writing any tensor)."""
    k = kind(blob) if blob is not None else refused
    if k == "typed" and blob is not None:
        return "restored (identical layout): " + restore(decode(blob, rank=rank))
    s = reseed(seed, iteration, rank)
    how = f"reseeded deterministically (seed*1000003 + iteration*7919 + rank = {s})"
    if k is None:
        return how
    if k == "pickle":
        return (f"identical layout, but this rank's per-rank state is a pickle (written before reshard's typed "
                f"encoding, or by another tool): never unpickled, {how}")
    if k == "json" and blob is not None:
        try:
            d = json.loads(bytes(blob[:MAX_BYTES + 1]).decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError):
            d = None
        if isinstance(d, list):
            d = d[0] if d else None
        st = d.get("random_rng_state") if isinstance(d, dict) else None
        if (isinstance(st, list) and len(st) == 3 and st[0] == 3 and isinstance(st[1], list)
                and len(st[1]) == _PY_STATE_LEN and all(_is_int(x) and 0 <= x < _U32 for x in st[1])
                and st[1][-1] <= 624 and (st[2] is None or (_is_float(st[2]) and math.isfinite(st[2])))):
            random.setstate((3, tuple(st[1]), st[2]))
            return ("identical layout: python random restored from the checkpoint's rng_state; numpy and torch "
                    f"{how} (the DeepSpeed per-rank state references tensor storages)")
    return f"identical layout, but this rank's per-rank state is not in a form reshard restores: {how}"


# -- helpers -------------------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii")


def _unb64(s, want: Optional[int], name: str, bad) -> torch.Tensor:
    if not isinstance(s, str) or len(s) > MAX_BYTES:
        raise bad(f"field {name} must be a base64 string")
    try:
        raw = base64.b64decode(s.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise bad(f"field {name} is not valid base64") from None
    if want is not None and len(raw) != want:
        raise bad(f"field {name} holds {len(raw)} bytes, but this torch's generator state is {want} bytes")
    if want is None and len(raw) == 0:
        raise bad(f"field {name} is empty")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _no_constant(name):
    raise ValueError(f"{name} is not JSON data")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _depth(x, d: int = 0) -> int:
    if d > MAX_DEPTH:
        return d
    if isinstance(x, dict):
        return max([_depth(v, d + 1) for v in x.values()] or [d + 1])
    if isinstance(x, list):
        return max([_depth(v, d + 1) for v in x] or [d + 1])
    return d
