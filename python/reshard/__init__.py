"""reshard: load a distributed-training checkpoint saved under one parallel layout into a job
running under another, resharding weights and optimizer state (fp32 master, exp_avg, exp_avg_sq,
step) on the fly.

Install: ``pip install --no-build-isolation .`` from the repository (torch installed first; the
extension compiles against it), or ``scripts/setup.sh``, which installs it editable into .venv.
Trainer integrations are under :mod:`reshard.integrations` (``reshard.integrations.megatron_deepspeed``).

Vocabulary (include/reshard/*.h):

* A *layout* is a topology ("tp=2,pp=2,vpp=1,dp=2,zero=1"; rank = (pp_rank*dp + dp_rank)*tp +
  tp_rank) plus where every element of every tensor and optimizer state lives: a list of
  *buffers*, each ``{"name", "rank", "dtype", "numel", "state", "group"}``. Buffer names:
  ``weight/<canonical>`` (tp-local tensor, model dtype), ``fp32/group<g>``, ``exp_avg/group<g>``,
  ``exp_avg_sq/group<g>`` (ZeRO-1/2 flat partitions, float32, one per param group) or
  ``fp32/<canonical>`` etc. under ZeRO-0. Canonical tensor names use global layer numbers
  (``layers.3.mlp.dense_h_to_4h.weight``; see include/reshard/model.h).
* Units: bytes unless said otherwise; GB = 1e9 bytes, GiB = 2**30 bytes; seconds.

Errors: every failure is a :class:`Error` subclass named after the C++ ErrorCode
(:class:`InvalidArgument`, :class:`NotFound`, :class:`DataLoss`, :class:`Unsupported`,
:class:`FailedPrecondition`, :class:`Internal`), with the same message as the CLI.
"""

from __future__ import annotations

import json as _json
import logging as _logging
import operator
import os as _os
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch as _torch  # loads libtorch before the extension

try:
    from . import _C
except ImportError as _e:  # an extension built against another torch fails on its symbols
    raise ImportError(f"reshard's C++ extension did not load with torch {torch.__version__} ({_e}); it must be "
                      "built against the torch installed now: reinstall with `pip install --no-build-isolation "
                      "--force-reinstall .`") from _e
from . import rank_state

try:
    from importlib.metadata import PackageNotFoundError as _NoDist, version as _dist_version
    __version__ = _dist_version("reshard")
except _NoDist:  # a source tree on PYTHONPATH
    __version__ = "0+source"

# The package's logger: load progress at DEBUG, a finished load at INFO, its warnings at WARNING.
# No handler is added here (the application configures logging).
_log = _logging.getLogger("reshard")
_log.addHandler(_logging.NullHandler())

__all__ = [
    "Error", "InvalidArgument", "NotFound", "DataLoss", "Unsupported", "FailedPrecondition", "Internal",
    "ModelConfig", "Layout", "Checkpoint", "Communicator", "model_config", "model_tensors", "derive_layout", "build_layout",
    "open_checkpoint", "inspect", "plan", "load", "save", "save_all_ranks", "communicator", "local_communicator",
    "load_resume_config", "parse_topology", "describe_change", "synth_checkpoint", "allocate", "rank_state",
    "DEFAULT_VERIFY", "choose_layout", "plan_batch", "world_size_of_job",
]

#: The checksum mode of every face when the caller names none (``load(verify=)``, the
#: Megatron-DeepSpeed hook, a resume YAML without ``verify:``, the CLI's ``convert``): "full".
#: The C++ library's ``reshard::kDefaultVerify``, read from the extension so there is one value.
DEFAULT_VERIFY: str = _C.DEFAULT_VERIFY

Error = _C.Error
InvalidArgument = _C.InvalidArgument
NotFound = _C.NotFound
DataLoss = _C.DataLoss
Unsupported = _C.Unsupported
FailedPrecondition = _C.FailedPrecondition
Internal = _C.Internal

ModelConfig = _C.ModelConfig
Layout = _C.Layout
Checkpoint = _C.Checkpoint
Communicator = _C.Communicator

# The model presets: configs/models beside the installed extension (the package's built files;
# site-packages in an editable install too), else configs/models of the source tree.
_REPO_CONFIGS = _os.path.join(_os.path.dirname(_os.path.abspath(_C.__file__)), "configs", "models")
if not _os.path.isdir(_REPO_CONFIGS):
    _REPO_CONFIGS = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))),
                                  "configs", "models")

_POLICY_KEYS = ("replicas", "replica_atol", "strict_missing", "strict_unexpected", "memory_budget_bytes", "dedup",
                "compare_replicas", "weights_from_master", "node_local_reads", "vocab_padding")


def model_config(model: Union[str, Mapping, "ModelConfig"]) -> "ModelConfig":
    """Returns a ModelConfig from a YAML file path, a preset name under configs/models
    ("tiny-gpt", "llama2-7b", ...), a dict with the YAML keys (name, num_layers, hidden, ffn, heads,
    query_groups, vocab, vocab_divisible_by, max_position_embeddings, swiglu, tied_embeddings, bias,
    norm, param_dtype, optimizer, qkv_version, tp_gt_groups, rules), or a ModelConfig (returned as is).

    Raises NotFound for a missing file, InvalidArgument naming the field for a bad or unknown key.
    """
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, Mapping):
        import yaml
        return _C.model_from_yaml(yaml.safe_dump(dict(model), sort_keys=False), "<dict>")
    path = str(model)
    if not _os.path.exists(path) and _os.sep not in path:
        preset = _os.path.join(_REPO_CONFIGS, path if path.endswith(".yaml") else path + ".yaml")
        if _os.path.exists(preset):
            path = preset
    return _C.load_model_config(path)


def model_tensors(model, tp: int) -> List[dict]:
    """Every tensor of a model in the trainer's parameter order with its global shape at tensor
    parallel size ``tp`` (vocab rows padded for that tp), split rule, reduction, owner, layer,
    no_weight_decay and real_rows (vocab tensors). Raises InvalidArgument for a rule that matches
    nothing."""
    return _C.model_tensors(model_config(model), int(tp))


def derive_layout(model, topology: str, *, weights_on_dp0_only: bool = False, optimizer: bool = True,
                  align_factor: int = 2) -> "Layout":
    """The layout of a whole job from a model and a topology string ("tp=2,pp=2,dp=4,zero=1"):
    weight buffers per tp-local tensor on every rank that holds it (dp rank 0 only with
    ``weights_on_dp0_only``, as saved checkpoints hold them), and optimizer buffers (ZeRO-0 per
    tensor, ZeRO-1/2 one flat partition per param group [weight decay, no weight decay] padded to a
    multiple of ``align_factor * dp`` elements).

    Raises InvalidArgument when the model does not fit the topology (names the field and rule).
    """
    return _C.build_layout(model_config(model), topology, None, None, weights_on_dp0_only, optimizer, align_factor)


_TORCH_DTYPES = {"F64": _torch.float64, "F32": _torch.float32, "F16": _torch.float16, "BF16": _torch.bfloat16,
                 "I64": _torch.int64, "I32": _torch.int32, "I16": _torch.int16, "I8": _torch.int8, "U8": _torch.uint8,
                 "BOOL": _torch.bool}


def allocate(layout: "Layout", rank: int = 0, *, device="cpu", fill: Optional[float] = None) -> Dict[str, _torch.Tensor]:
    """New 1-D tensors for every buffer of ``layout`` that belongs to ``rank``: ``{buffer name:
    tensor}`` with the buffer's dtype and numel, ready for :func:`load` (scratch, tests, tools;
    a trainer passes its own parameters and optimizer state instead). ``fill``: a value to fill
    them with (NaN makes unwritten elements easy to spot); None leaves them uninitialised.

    Raises InvalidArgument for a rank outside the layout's world size, or when ``layout`` is not a
    Layout (a topology string names no buffers: make one with derive_layout(model, topology))."""
    if not isinstance(layout, Layout):
        raise InvalidArgument(f"allocate needs a Layout (reshard.derive_layout(model, topology) or "
                              f"checkpoint.layout), not {type(layout).__name__} {layout!r:.80}")
    world = parse_topology(layout.topology)["world_size"]
    given = rank
    try:
        rank = None if isinstance(rank, bool) else operator.index(rank)
    except TypeError:
        rank = None
    if rank is None:
        raise InvalidArgument(f"allocate: rank must be an int, got {given!r}")
    if not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} is outside layout {layout.topology} (world size {world})")
    out = {}
    for b in layout.buffers:
        if b["rank"] != rank:
            continue
        t = _torch.empty(b["numel"], dtype=_TORCH_DTYPES[b["dtype"]], device=device)
        if fill is not None:
            try:
                t.fill_(fill)
            except (RuntimeError, TypeError) as e:
                raise InvalidArgument(f"allocate: fill={fill!r} cannot be stored in buffer {b['name']} "
                                      f"({b['dtype']}): {e}") from None
        out[b["name"]] = t
    return out


def build_layout(model, topology: str, *, stages: Optional[Mapping[str, Sequence[int]]] = None,
                 groups: Optional[Sequence[Sequence[Mapping]]] = None, weights_on_dp0_only: bool = False,
                 optimizer: bool = True, align_factor: int = 2) -> "Layout":
    """Like :func:`derive_layout`, with what a live trainer knows:

    * ``stages``: ``{canonical name: [pipeline stages holding it]}`` for tensors placed differently
      from the uniform split (tied embeddings: ``[0, pp-1]``). The stages of the layers' tensors
      (one each, the same for all tensors of a layer) may split the layers unevenly, as
      DeepSpeed's PipelineModule does (4 layers over pp=3); every layer must then be named;
    * ``groups``: the optimizer's param groups per (pp, tp) model shard, ``groups[pp_rank*tp +
      tp_rank]`` = list of ``{"entries": [(canonical, flat_offset, numel), ...], "numel": N,
      "partition_size": P, "no_weight_decay": bool}`` in flat order; offsets and sizes in elements
      of the unpadded flat buffer (gaps allowed); P is this group's per-dp-rank partition length.
      An empty list for a slot means "as derive_layout computes it".

    Raises InvalidArgument naming the tensor or group when the groups disagree with the model
    (unknown tensor, numel mismatch, partition too small), or naming the layer when its tensors
    are given different stages, a stage outside [0, pp), or (uneven split) no stage.
    """
    if stages is not None:
        if not isinstance(stages, Mapping):
            raise InvalidArgument(f"build_layout: stages must be a mapping of tensor name to a list of stage "
                                  f"numbers, got {type(stages).__name__}")
        for k, v in stages.items():
            ok = isinstance(k, str) and isinstance(v, (list, tuple)) and all(
                isinstance(x, int) and not isinstance(x, bool) and -2**31 <= x < 2**31 for x in v)
            if not ok:
                raise InvalidArgument(f"build_layout: stages[{k!r}] must be a list of stage numbers (int), got {v!r}")
    return _C.build_layout(model_config(model), topology, None if stages is None else {k: list(v) for k, v in stages.items()},
                           None if groups is None else [list(g) for g in groups], weights_on_dp0_only, optimizer,
                           align_factor)


def open_checkpoint(path: str, *, step: Optional[Union[str, int]] = None,
                    model: Optional[Union[str, Mapping, "ModelConfig"]] = None) -> "Checkpoint":
    """Opens a checkpoint root or step folder (native or DeepSpeed), reading headers only.

    ``step``: None = the step ``latest`` names; "newest" = the newest complete step (a save that
    did not finish is skipped, with a note naming why; an elastic restart's choice); else a
    folder name ("global_step20", "step-20") or number. A missing step is an error, never a
    fallback. ``model``: the model description for
    formats that do not record the model (DeepSpeed; it must agree with the trainer's ``args``
    recorded there): a model YAML file's path, or a dict of its keys or a ModelConfig (as
    :func:`model_config` takes them; a trainer building it from its live config needs no file).
    Native checkpoints record theirs, and a ``model`` given for one must describe the same model
    (InvalidArgument naming each field that differs, e.g. "hidden 4 vs 8").

    Raises NotFound (path, step), InvalidArgument (a file, an empty or unrecognised folder),
    DataLoss (corrupt metadata), Unsupported (a format or version this build cannot read).
    """
    if model is None or isinstance(model, (str, _os.PathLike)):
        return _C.open_checkpoint(str(path), "" if step is None else str(step), str(model or ""))
    if not isinstance(model, (Mapping, ModelConfig)):
        raise InvalidArgument(f"open_checkpoint: model must be a path, a dict of model keys or a ModelConfig, "
                              f"not {type(model).__name__}")
    return _C.open_checkpoint(str(path), "" if step is None else str(step), "", model_config(model))


def inspect(path: str, *, step: Optional[Union[str, int]] = None, model: Optional[str] = None) -> dict:
    """What a checkpoint holds, from headers only:
    ``{"writer", "path", "layout" (topology string), "topology" {tp, pp, vpp, dp, zero, world_size},
    "model" {...}, "tensors" [{name, shape (global, at the saved tp), split, reduction, owner, layer,
    no_weight_decay, real_rows}], "files", "state_bytes" (bytes of all saved buffers),
    "num_buffers", "state" {iteration, consumed_samples, step, json, per_rank {rank: bytes}},
    "notes"}``. Errors as :func:`open_checkpoint`.
    """
    return open_checkpoint(path, step=step, model=model).inspect()


def _policies(policies: Optional[Mapping]) -> dict:
    if policies is not None and not isinstance(policies, Mapping):
        raise InvalidArgument(f"policies must be a dict such as {{'replicas': 'first'}}, got {policies!r}")
    p = dict(policies or {})
    if "memory_budget_gib" in p:
        if "memory_budget_bytes" in p:
            raise InvalidArgument("policies 'memory_budget_gib' and 'memory_budget_bytes' are both given; give one")
        gib = p.pop("memory_budget_gib")
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < 2**34:
            raise InvalidArgument(f"policy 'memory_budget_gib' must be a positive number of GiB, got {gib!r}")
        p["memory_budget_bytes"] = int(float(gib) * 2**30)
    for k in p:
        if k not in _POLICY_KEYS:
            raise InvalidArgument(f"unknown policy '{k}' (known: {', '.join(_POLICY_KEYS)}, memory_budget_gib)")
    # Types and values (replica policy names, replica_atol >= 0, booleans, the 64 KiB budget
    # minimum) as C++ reads them: here, so that load agrees on them across ranks before its first
    # collective.
    _C.plan_options(p)
    return p


def _open_for(path, step, model, what: str) -> "Checkpoint":
    """``path`` opened with ``step`` and ``model``; a Checkpoint is used as it was opened, so
    ``step`` or ``model`` given with one would be ignored: refused instead."""
    if isinstance(path, Checkpoint):
        if step is not None or model is not None:
            raise InvalidArgument(f"{what}: step= and model= apply when a path is opened; this Checkpoint was opened at "
                                  f"{path.path} (pass the root path, or open_checkpoint(root, step=..., model=...))")
        return path
    return open_checkpoint(path, step=step, model=model)


def _target_layout(ckpt: "Checkpoint", target) -> "Layout":
    if isinstance(target, Layout):
        return target
    return _C.build_layout(ckpt.model, str(target), None, None, False, True, 2)


def plan(path: Union[str, "Checkpoint"], target: Union[str, "Layout"], *, step=None, model: Optional[str] = None,
         policies: Optional[Mapping] = None) -> dict:
    """Dry run: plans loading ``path`` into ``target`` (a Layout, or a topology string for which the
    checkpoint's own model is laid out with :func:`derive_layout`), touching no tensor data.

    Returns ``{"change", "source_layout", "target_layout", "source_world_size", "target_world_size",
    "bytes_to_read", "bytes_needed", "bytes_to_exchange", "target_bytes",
    "peak_staging_bytes_per_rank" (bytes), "read_amplification", "num_waves", "num_fragments",
    "num_replica_compares", "plan_seconds", "notes", "warnings", "live_bytes_per_rank_max",
    "live_bytes_max_rank", "live_bytes_total", "read_bytes_per_rank_max", "read_bytes_max_rank"}``:
    "live_bytes_*" are the target buffers' bytes of the largest rank and of all ranks (what one
    process holding the whole target needs), "read_bytes_*" the source bytes of the busiest
    reader; "warnings" lists what changes a trained model's results (vocab padding rows dropped
    or added).

    ``policies``: replicas ("error" | "average" | "first"), replica_atol (float, absolute),
    strict_missing, strict_unexpected (bool), memory_budget_bytes (int, per rank per wave) or
    memory_budget_gib, dedup, compare_replicas, weights_from_master, node_local_reads (bool; load
    only: ranks of one machine each copy shared bytes out of the page cache instead of exchanging
    them, default on), vocab_padding ("warn", default: a target whose padded vocab has fewer rows
    drops the source's extra padding rows, one with more zero-fills them, and "warnings" says how
    many rows and which vocab_divisible_by keeps them; "refuse": InvalidArgument instead, for
    trainers whose loss normalises over every padded row, as Megatron's vocab-parallel cross
    entropy does).

    Raises DataLoss (elements no file covers, listed per tensor), InvalidArgument (missing or
    unexpected tensors under strictness, shape mismatches, a budget below 64 KiB), and the errors
    of :func:`open_checkpoint`.
    """
    ckpt = _open_for(path, step, model, "reshard.plan")
    return _json.loads(_C.plan(ckpt, _target_layout(ckpt, target), _policies(policies)))


def local_communicator() -> "Communicator":
    """A communicator of one rank: loads and saves from a single process."""
    return _C.local_communicator()


def communicator(group=None) -> "Communicator":
    """A communicator over a torch.distributed process group (default: WORLD; gloo or NCCL), for
    :func:`load` and :func:`save`. Its ranks are the group's ranks, which must equal the layout's
    ranks. Raises FailedPrecondition when torch.distributed is not initialized.

    End the job with ``torch.distributed.destroy_process_group()`` (as torch asks): a script under
    mpirun with gloo that loaded and saved and then exited without it aborted at interpreter exit
    ("terminate called without an active exception", exit 134) in 1 of 15 runs (0 of 12 with it),
    after every rank had finished and the checkpoint was complete: torch's gloo
    teardown without that call (pytorch/pytorch#190489)."""
    from ._comm import ProcessGroupComm
    return _C.torch_communicator(ProcessGroupComm(group))


def _default_comm(comm):
    if comm is not None:
        return comm
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return communicator()
    return local_communicator()


def _tensor_list(layout: "Layout", rank: int, tensors) -> List[Optional[_torch.Tensor]]:
    bufs = layout.buffers
    if isinstance(tensors, Mapping):
        out: List[Optional[_torch.Tensor]] = [None] * len(bufs)
        mine = {}
        for i, b in enumerate(bufs):
            if b["rank"] == rank:
                mine[b["name"]] = i
        for name, t in tensors.items():
            if name not in mine:
                raise InvalidArgument(f"tensor '{name}' is not a buffer of rank {rank} in layout {layout.topology}")
            out[mine[name]] = t
        missing = [n for n, i in mine.items() if out[i] is None]
        if missing:
            raise InvalidArgument(f"rank {rank} has no tensor for buffer(s) {', '.join(sorted(missing)[:8])}"
                                  f"{' ...' if len(missing) > 8 else ''} of layout {layout.topology}")
    else:
        try:
            out = list(tensors)
        except TypeError:
            raise InvalidArgument(f"tensors must be a dict {{buffer name: tensor}} or a list indexed like the layout's "
                                  f"buffers, got {type(tensors).__name__}") from None
        if len(out) != len(bufs):
            raise InvalidArgument(f"got {len(out)} tensors for a layout of {len(bufs)} buffers")
    for i, t in enumerate(out):
        if t is not None and not isinstance(t, _torch.Tensor):
            raise InvalidArgument(f"the tensor for buffer {bufs[i]['name']} is a {type(t).__name__}, not a torch.Tensor")
    return out


_ERROR_CLASSES = {c.__name__: c for c in (InvalidArgument, NotFound, DataLoss, Unsupported, FailedPrecondition,
                                           Internal)}


def _agree(comm: "Communicator", err: Optional[BaseException], what: str) -> None:
    """Collective: every rank says whether its checks before the first collective of ``what``
    failed; if any did, every rank raises (a rank that raised alone would leave its peers waiting
    in the next collective). The failing rank raises its own error; the others raise the first
    failing rank's error class (InvalidArgument for errors that are not reshard's) with each failing
    rank's message."""
    if comm.size == 1:
        if err is not None:
            raise err
        return
    mine = "" if err is None else f"{type(err).__name__}\n[rank {comm.rank}] {err}"
    reports = [bytes(b).decode("utf-8", "replace") for b in comm.all_gather_strings(mine)]
    bad = [r for r in reports if r]
    if not bad:
        return
    if err is not None:
        raise err
    cls = _ERROR_CLASSES.get(bad[0].partition("\n")[0], InvalidArgument)
    msgs = "; ".join(r.partition("\n")[2] for r in bad[:8]) + (f"; ... ({len(bad)} ranks)" if len(bad) > 8 else "")
    raise cls(f"[rank {comm.rank}] {what} refused on every rank before anything was read or written, because "
              f"{'a rank' if len(bad) == 1 else 'ranks'} failed its checks: {msgs}")


def _check_io_threads(io_threads) -> int:
    """io_threads as the C++ load takes it: None -> 0 (the default: $RESHARD_THREADS, else the
    cores up to 8), else an int 1..1024 (InvalidArgument otherwise)."""
    if io_threads is None:
        return 0
    try:
        n = None if isinstance(io_threads, bool) else operator.index(io_threads)
    except TypeError:
        n = None
    if n is None or not 1 <= n <= 1024:
        raise InvalidArgument(f"load option io_threads={io_threads!r} must be an int in 1..1024")
    return n


def load(path: Union[str, "Checkpoint"], target: Union[str, "Layout"], tensors, *, comm: Optional["Communicator"] = None,
         step=None, model: Optional[str] = None, policies: Optional[Mapping] = None, io_threads: Optional[int] = None,
         verify: str = DEFAULT_VERIFY, progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Loads a checkpoint into this rank's live tensors, resharding as needed. Collective over
    ``comm`` (default: torch.distributed WORLD when initialized with more than one rank, else one
    process): every rank calls it with the same path, target layout and policies.

    ``tensors``: ``{buffer name: tensor}`` for every buffer of ``target`` whose rank is this rank
    (or a list indexed like ``target.buffers`` with None for other ranks). Each tensor must be
    contiguous, with the buffer's dtype and numel (shape free: a [out, in] weight or a 1-D flat
    partition), all on one device, and not a lazy negation or conjugation view (``_neg_view``,
    ``.conj()``: its bytes are not its values; InvalidArgument). CPU tensors are written in place and nothing else is allocated
    at their size. CUDA tensors (a trainer on GPUs): the state is loaded into pinned host tensors
    (host memory = this rank's live bytes), exchanged over ``comm`` (the trainer's NCCL group by
    default), then copied to the device tensors once the whole load succeeded; the report adds
    "device", "device_copy_seconds" and "staged_host_bytes", and "seconds"/"gbps" include the copy.

    ``verify``: checksum checks (native pieces: xxh3-64; DeepSpeed zip records: CRC-32); the
    default is :data:`DEFAULT_VERIFY`, the same for every face.
    "full" (the default) reads every unit the load touches whole on one rank and checks it
    before any write (all or nothing; the pass counts in "verify_bytes_read"), then compares the
    checkpoint's 16-bit weights with its fp32 master rounded to their dtype, the ranks sharing
    the tensors (DeepSpeed's optimizers keep them equal in every save; a difference means
    swapped tp layer files, files from different saves or edited weights), holding at most
    min(64 MiB, memory_budget) of weights and masters at a time ("peak_verify_bytes").
    "free" checks every fragment that is exactly one checksummed unit as it is read, at no
    extra read (a fragment copied straight out of the file into this rank's tensors is checked
    in 256 KiB slabs as it is copied; if it fails, its copy in the tensors is overwritten with
    NaN); a unit several ranks of one machine read whole is checked by one of them (the others'
    copies are overwritten with NaN if the load fails); a unit the memory budget cuts into
    several fragments is read whole and checked before any write; units cut between ranks by
    the layout change (tp splits, ZeRO re-cuts, DeepSpeed flat partitions read tensor by tensor)
    are not checked ("bytes_unchecked" counts those bytes, and a "verify=free did not check ..."
    entry in "policies" says so). "off": none. In every mode, ranks that opened different
    checkpoints (another step or save) raise FailedPrecondition before any write.

    ``io_threads``: threads per rank that read, check and copy, 1..1024; None: $RESHARD_THREADS,
    else the machine's cores up to 8 (the one thread setting of the C++ library).

    ``progress``: called on this rank's thread as each step finishes, with ``{"stage", "index",
    "count", "bytes_done", "bytes_total", "seconds"}``: stage "plan" (planned and agreed), then
    "preflight" (checks done, nothing written yet), then "wave" with index 1..count once that
    wave's fragments are in this rank's tensors; bytes are this rank's source bytes of the
    fragments delivered to it, seconds since the load began. An exception it raises is logged
    (logger "reshard", WARNING) and ignored, since a rank that stopped alone would leave its peers
    waiting. The same events are logged at DEBUG on logger "reshard", and a finished load's
    one-line summary at INFO (its warnings at WARNING); the package adds no handler.

    Returns the report: ``{"change", "source_layout", "target_layout", "writer", "path",
    "bytes_read", "bytes_reread_on_node" (part of bytes_read that a second rank of a machine read
    from its page cache), "bytes_needed", "bytes_exchanged", "verify_bytes_read", "target_bytes"
    (bytes, all ranks), "checksums_verified" (checks made), "bytes_verified" (bytes those checks hashed;
    a unit checked by several ranks counts each time), "bytes_unchecked" (bytes read from storage
    that no check covered), "plan_seconds", "seconds" (wall, max over ranks), "gbps"
    (target_bytes / seconds / 1e9), "waves", "peak_staging_bytes", "peak_verify_bytes" (bytes, max over
    ranks), "warnings" (the plan's: vocab padding rows dropped or added), "policies", "not_carried",
    "replica_report", "iteration", "step", "consumed_samples", "state" {iteration, consumed_samples,
    step, json, per_rank {rank: bytes} (only when the layout is identical; pickled blobs are
    removed, listed in per_rank_refused {rank: "pickle"} and named under "not_carried": reshard
    never unpickles; restore a blob with reshard.rank_state.restore_or_reseed)}, "text"}`` and
    this rank's phase
    times in seconds: "preflight_seconds" (checks before any write: plan agreement, files, the
    verify="full" checksum pass, replica comparisons), "read_seconds", "copy_seconds",
    "exchange_seconds", "scatter_seconds".

    Raises, on every rank (each rank's own checks of its arguments, policies, tensors and
    checkpoint folder are agreed before the first collective, and its planning errors right after
    planning, so a bad argument on one rank fails all of them instead of leaving its peers
    waiting). Exception: a target whose world size differs from the communicator's raises
    InvalidArgument at once on the rank that gave it (one process loading alone under
    torch.distributed must pass ``comm=local_communicator()``). Before any tensor is written:
    InvalidArgument (``step``/``model`` given with an opened Checkpoint, tensors
    that do not match the layout, a tensor whose storage is smaller than its size (freed or
    shrunk with ``untyped_storage().resize_()``), two tensors that overlap in memory, tensors on meta,
    strictness, shapes, a model whose vocab differs from the checkpoint's, a verify value other
    than off/free/full, io_threads outside 1..1024), DataLoss
    (this rank's per-rank blob in reshard.rank_state's typed encoding is damaged or oversized, at
    the identical layout: names the rank and field; uncovered elements, missing or short files, replicas that differ under policy "error": names
    the tensor and max |diff|; any checksum mismatch with verify="full", or weights that differ
    from their fp32 master (names tensor, tp rank and element); one checksum mismatch in a piece sent to
    another rank with "free"), InvalidArgument (tensors on several devices), Internal (ranks given
    different ``verify`` values or replica policies, or inputs that plan differently). After live
    tensors were partly written: FailedPrecondition ("free": a checksum mismatch
    found while a piece was copied locally, its copy then overwritten with NaN; a finite value
    that does not fit the target dtype, e.g. a bf16 1e6 into an f16 model, naming the buffer; or a
    peer of the communicator fails): they are then unusable and the trainer must abort. The CPU
    tensors' version counters are bumped as by an in-place write (autograd refuses a backward
    through a graph that saved their old values). CUDA tensors are
    written only after the whole load succeeded, so they are never partly written.
    """
    comm = _default_comm(comm)
    # A target for another number of ranks than the communicator has is raised at once, not
    # agreed: the usual case is one rank loading alone (a tool on rank 0 of a torch.distributed
    # job) with the default communicator, whose peers never call load and would leave it waiting.
    try:
        world, shown = ((target.world_size, target.topology) if isinstance(target, Layout)
                        else (parse_topology(str(target))["world_size"], str(target)))
    except Exception:  # noqa: BLE001 - a bad topology string is reported (and agreed) below
        world, shown = comm.size, ""
    if world != comm.size:
        raise InvalidArgument(f"[rank {comm.rank}/{comm.size}] target layout {shown} has world size {world} but the "
                              f"communicator has {comm.size} ranks (one process loading alone under "
                              f"torch.distributed: pass comm=reshard.local_communicator())")
    # Every other check that needs no peer runs first; the ranks then agree on the outcome, so that
    # a bad argument on one rank fails every rank instead of leaving them waiting in a collective.
    err = None
    try:
        ckpt = _open_for(path, step, model, "reshard.load")
        layout = _target_layout(ckpt, target)
        tlist = _tensor_list(layout, comm.rank, tensors)
        _C.check_buffers(layout, comm.rank, tlist, "reshard.load")
        _check_rank_state(ckpt, layout, comm.rank)
        # Layout.buffers builds a list of every buffer of every rank on each access: read it once.
        bufs = layout.buffers
        devices = {t.device for i, t in enumerate(tlist) if t is not None and bufs[i]["rank"] == comm.rank}
        if len(devices) > 1:
            raise InvalidArgument(f"rank {comm.rank}'s tensors are on several devices "
                                  f"({', '.join(sorted(map(str, devices)))}); give all of them on one device")
        device = next(iter(devices)) if devices else _torch.device("cpu")
        pol = _policies(policies)
        threads = _check_io_threads(io_threads)
        if verify not in ("free", "full", "off"):
            raise InvalidArgument(f"load option verify={verify!r} must be off, free or full")
        if progress is not None and not callable(progress):
            raise InvalidArgument(f"reshard.load: progress must be callable or None, not {type(progress).__name__}")
    except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
        err = e
    _agree(comm, err, "reshard.load")
    events = _progress_sink(progress, comm.rank)
    if device.type != "cpu" or _STAGE_CPU_TENSORS_FOR_TESTS:
        return _logged(_without_pickled_rank_state(_load_staged(ckpt, layout, tlist, comm, device, pol, threads, verify,
                                                                events)), comm.rank)
    try:
        return _logged(_without_pickled_rank_state(_C.load(ckpt, layout, tlist, comm, pol, threads, verify, events)),
                       comm.rank)
    finally:
        # C++ writes through the tensors' memory: bump their version counters as an in-place op
        # would, so autograd refuses a backward through a graph that saved their old values (the
        # staged path's copy_ does the same). Also after a failure: the tensors may be written.
        for i, t in enumerate(tlist):
            if t is not None and bufs[i]["rank"] == comm.rank and not t.is_inference():
                _torch.autograd.graph.increment_version(t)


def _progress_sink(progress, rank: int):
    """The callable reshard._C.load calls per finished step: the user's ``progress`` and the DEBUG
    log line; None when neither wants the events (no callback into Python at all)."""
    debug = _log.isEnabledFor(_logging.DEBUG)
    if progress is None and not debug:
        return None

    def sink(event: dict) -> None:
        if debug:
            _log.debug("[rank %d] load %s %d/%d: %s / %s at %.3f s", rank, event["stage"], event["index"],
                       event["count"], _C.format_bytes(event["bytes_done"]), _C.format_bytes(event["bytes_total"]),
                       event["seconds"])
        if progress is not None:
            progress(event)
    return sink


def _logged(report: dict, rank: int) -> dict:
    """Logs a finished load on logger "reshard" (INFO: the change, bytes and time; WARNING: each
    of the report's warnings) and returns the report."""
    _log.info("[rank %d] loaded %s (%s): %s read, %s written, %.3f s", rank, report.get("path", ""),
              report.get("change", ""), _C.format_bytes(report.get("bytes_read", 0)),
              _C.format_bytes(report.get("target_bytes", 0)), report.get("seconds", 0.0))
    for w in report.get("warnings", ()):
        _log.warning("[rank %d] %s", rank, w)
    return report


def _same_topology(a: str, b: str) -> bool:
    x, y = parse_topology(a), parse_topology(b)
    return all(x[k] == y[k] for k in ("tp", "pp", "vpp", "dp", "zero"))


def _check_rank_state(ckpt, layout, rank: int) -> None:
    """Pre-flight of this rank's per-rank blob, which the load hands over only at the identical
    layout: a blob in the typed encoding (rank_state) must decode exactly, so that a trainer
    restoring it after the load cannot fail with tensors already written. Raises DataLoss naming
    the rank and field (agreed across ranks by load)."""
    if not _same_topology(ckpt.topology, layout.topology):
        return
    blob = ckpt.state["per_rank"].get(rank)
    if blob is not None and rank_state.kind(blob) == "typed":
        rank_state.decode(blob, rank=rank, where=f"{ckpt.path}: per-rank state")


def _without_pickled_rank_state(report: dict) -> dict:
    """Removes per-rank blobs that are pickles from the report (never unpickled: a pickle can run
    any code) and says so under "not_carried"."""
    per_rank = report["state"]["per_rank"]
    pickled = sorted(r for r, b in per_rank.items() if rank_state.kind(b) == "pickle")
    if pickled:
        for r in pickled:
            del per_rank[r]
        report["state"]["per_rank_refused"] = {r: "pickle" for r in pickled}
        shown = ", ".join(map(str, pickled[:8])) + (", ..." if len(pickled) > 8 else "")
        report["not_carried"] = list(report["not_carried"]) + [
            f"per-rank state (RNG, sampler) of {len(pickled)} rank(s) ({shown}): pickled blobs (written before "
            "reshard's typed encoding, docs/format.md), never unpickled; those ranks reseed deterministically "
            "(reshard.rank_state.reseed)"]
    return report


# Tests set this to run the staged path below with CPU tensors (the path GPU tensors take).
_STAGE_CPU_TENSORS_FOR_TESTS = False


def _load_staged(ckpt, layout, tlist, comm, device, policies, io_threads, verify, progress=None) -> dict:
    """Loads into host tensors (pinned when the targets are CUDA tensors), then copies each to its
    device tensor. The exchange runs over ``comm``: on a trainer's NCCL process group the
    torch.distributed communicator moves the bytes through the GPU with NCCL. Device tensors are
    written only after the whole load succeeded, so every error before that leaves them as they
    were. Costs host memory equal to this rank's live bytes."""
    import time
    me = comm.rank
    pin = device.type == "cuda" and _torch.cuda.is_available()
    host: List[Optional[_torch.Tensor]] = [None] * len(tlist)
    staged = 0
    bufs = layout.buffers  # one build of the list (see load)
    for i, t in enumerate(tlist):
        if t is None or bufs[i]["rank"] != me:
            continue
        host[i] = _torch.empty(t.numel(), dtype=t.dtype, pin_memory=pin)
        staged += t.numel() * t.element_size()
    report = _C.load(ckpt, layout, host, comm, policies, io_threads, verify, progress)
    t0 = time.perf_counter()
    try:
        with _torch.no_grad():
            for i, t in enumerate(tlist):
                if host[i] is None:
                    continue
                if t.is_inference():  # made under torch.inference_mode(): writable only inside it
                    with _torch.inference_mode():
                        t.view(-1).copy_(host[i], non_blocking=pin)
                else:
                    t.view(-1).copy_(host[i], non_blocking=pin)
        if pin:
            _torch.cuda.synchronize(device)
    except Exception as e:  # a device error after some tensors were written
        raise FailedPrecondition(f"[rank {me}] copying the loaded state to {device} failed after device tensors were "
                                 f"partly written; the live state is unusable and the trainer must abort: {e}") from e
    copy_s = time.perf_counter() - t0
    report["device"] = str(device)
    report["device_copy_seconds"] = copy_s
    report["staged_host_bytes"] = staged
    report["seconds"] = report["seconds"] + copy_s
    report["gbps"] = report["target_bytes"] / report["seconds"] / 1e9 if report["seconds"] > 0 else 0.0
    report["policies"] = list(report["policies"]) + [
        f"tensors on {device}: loaded into {'pinned ' if pin else ''}host staging ({staged} bytes on this rank), "
        f"then copied to the device ({copy_s:.3f} s)"]
    return report


def save(root: str, step: str, layout: "Layout", tensors, *, state: Optional[Mapping] = None,
         comm: Optional["Communicator"] = None) -> None:
    """Saves one step in the native format (docs/format.md), collectively over ``comm``: ROOT/<step>
    with metadata.json and one rank_NNNNN.safetensors per rank, written to a temporary folder,
    fsynced, renamed, then ``latest`` updated. Use a layout built with ``weights_on_dp0_only=True``
    so dp-replicated weights are written once.

    ``tensors``: as in :func:`load` (this rank's buffers). ``state``: ``{"iteration",
    "consumed_samples", "step" (int >= 0), "json" (str: one JSON object: scheduler, loss scaler,
    ...; a dict is serialised), "per_rank" {rank: bytes} (RNG, sampler; ranks of the layout)}``;
    any other key is refused. ``step`` (the folder name): printable characters, no spaces.

    Raises FailedPrecondition (ranks see different filesystems, or, with more than one rank, any
    rank failed: the message names each failing rank and its error), DataLoss (one rank: the
    filesystem refused the data: no space left, read-only, an I/O error; the message names the
    path and, for a write, the byte range), InvalidArgument (bad step name, tensors that do not
    match the layout, state keys or values of the wrong kind, comm size different from the
    layout's world size, a path the process may not write); like load, a check that fails on one
    rank before the first collective fails every rank. A save that fails with an error removes its
    temporary folder; no step folder appears.
    """
    comm = _default_comm(comm)
    err = None
    try:
        if not isinstance(step, str):
            raise InvalidArgument(f"reshard.save: step must be the step folder's name (a str such as 'step-100'), "
                                  f"got {step!r}")
        st = _state_dict(state, layout)
        tlist = _tensor_list(layout, comm.rank, tensors)
        _C.check_buffers(layout, comm.rank, tlist, "reshard.save")
    except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
        err = e
    _agree(comm, err, "reshard.save")
    _C.save(str(root), str(step), layout, tlist, st, comm)


def _state_dict(state, layout) -> dict:
    """save()'s ``state`` with "json" given as an object serialised and per-rank blobs as bytes;
    checked (unknown keys, types, ranks) by the extension."""
    if state is not None and not isinstance(state, Mapping):
        raise InvalidArgument(f"save: state must be a dict, got {type(state).__name__}")
    st = dict(state or {})
    if "json" in st and not isinstance(st["json"], str):
        st["json"] = _json.dumps(st["json"])
    if isinstance(st.get("per_rank"), Mapping):
        st["per_rank"] = {k: bytes(v) if isinstance(v, (bytearray, memoryview)) else v
                          for k, v in st["per_rank"].items()}
    _C.check_state(st, layout)
    return st


def save_all_ranks(root: str, step: str, layout: "Layout", tensors: Sequence[_torch.Tensor], *,
                   state: Optional[Mapping] = None) -> None:
    """Like :func:`save` from one process that holds every rank's buffers (conversion tools,
    tests): ``tensors`` is indexed like ``layout.buffers`` and every entry must be given. Rank
    files are written one after another; no communicator is needed. Errors as :func:`save` with
    one rank (DataLoss when the filesystem refuses the data)."""
    st = _state_dict(state, layout)
    _C.save_all_ranks(str(root), str(step), layout, list(tensors), st)


def load_resume_config(path: str) -> dict:
    """Reads a resume policy file (configs/resume/*.yaml): ``{"checkpoint" (root), "step" ("" =
    latest, "newest" = the newest complete step), "model" (file or ""), "target" (topology string,
    or "auto": :func:`choose_layout` picks it at restart), "target_topology" {tp, pp, vpp, dp,
    zero} (None for "auto"), "elastic" {policy ("keep" | "list" | "refuse"), allowed [layout
    strings]}, "verify" ("full" | "free" | "off"; load's checksum checks, default :data:`DEFAULT_VERIFY`), "policies"
    {replicas, replica_atol, strict_missing, strict_unexpected, memory_budget_bytes, dedup,
    compare_replicas, weights_from_master, node_local_reads, vocab_padding ("warn" | "refuse")}}``.

    Raises NotFound for a missing file, InvalidArgument naming the field otherwise."""
    return _C.load_resume_config(str(path))


def choose_layout(saved: Union[str, "Checkpoint"], world_size: int, *, policy: str = "keep",
                  allowed: Sequence[str] = (), global_batch: int = 0,
                  model: Optional[Union[str, Mapping, "ModelConfig"]] = None) -> dict:
    """The layout an elastic restart of ``world_size`` ranks takes, from the layout the checkpoint
    was saved under. Reads nothing but what it is given (a Checkpoint's headers are already read).

    ``saved``: an opened Checkpoint (its topology and model are used) or a topology string.
    ``policy``: "keep" (default: tp, pp, vpp and the ZeRO stage stay, dp = world / (tp*pp)),
    "list" (the first of ``allowed`` that runs ``world_size`` ranks and fits; a candidate's
    omitted keys keep the saved values, an omitted dp is derived) or "refuse" (the saved world
    size only). ``global_batch`` > 0 also turns down layouts whose dp does not divide it.
    ``model`` (default: the Checkpoint's) turns down layouts it cannot take (tp must divide the
    heads, pp the layers).

    Returns ``{"target": topology string, "reason": one sentence, "tried": [rejected candidate
    and why]}``. Raises InvalidArgument naming the world size, the policy and every candidate
    tried with its reason when none fits (before anything is read or written), for ``allowed``
    with a policy other than "list", and for a world size or global batch that is not an int."""
    if isinstance(saved, Checkpoint):
        if model is None:
            model = saved.model
        saved = saved.topology
    world_size = _count("choose_layout", "world_size", world_size)
    global_batch = _count("choose_layout", "global_batch", global_batch, low=0)
    allowed = () if allowed is None else allowed
    if isinstance(allowed, str) or not all(isinstance(a, str) for a in allowed):
        raise InvalidArgument(f"choose_layout: allowed is a list of layout strings such as 'tp=2,pp=2', got {allowed!r}")
    if allowed and policy != "list":
        raise InvalidArgument(f"choose_layout: allowed layouts are given with policy '{policy}', which does not read "
                              "them; pass policy='list'")
    return _C.choose_layout(str(saved), world_size, str(policy), list(allowed), global_batch,
                            None if model is None else model_config(model))


def _count(what: str, name: str, v, low: int = 1, high: int = 2**62) -> int:
    """``v`` as a plain int in [low, high]; InvalidArgument naming ``name`` otherwise (bools,
    floats and strings are refused, not converted)."""
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise InvalidArgument(f"{what}: {name} must be an integer in [{low}, {high}], got {v!r}")
    return v


def plan_batch(global_batch: int, micro_batch: int, dp: int) -> dict:
    """Micro-batch and gradient-accumulation steps that keep ``global_batch`` samples per optimizer
    step at ``dp`` data-parallel ranks: ``{"global_batch", "micro_batch", "grad_accum", "reason"}``
    with micro_batch * grad_accum * dp == global_batch. ``micro_batch`` is kept when it divides
    the samples per rank, else the largest smaller one that does ("reason" says so; "" when kept).
    Raises InvalidArgument naming the global batch and dp when dp does not divide it."""
    return _C.plan_batch(_count("plan_batch", "global_batch", global_batch),
                         _count("plan_batch", "micro_batch", micro_batch), _count("plan_batch", "dp", dp))


def world_size_of_job(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The world size the launcher gave this process, before any process group exists: torchrun
    and torch.distributed's env:// (``WORLD_SIZE``), Open MPI (``OMPI_COMM_WORLD_SIZE``), MPICH /
    Intel MPI (``PMI_SIZE``), Slurm (``SLURM_NTASKS``), in that order. None when none is set.
    Raises InvalidArgument naming the variable when its value is not an integer in 1..65536."""
    env = _os.environ if environ is None else environ
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        v = env.get(var)
        if v is None or v == "":
            continue
        s = v.strip()
        if not (s.isascii() and s.isdigit()) or not 1 <= int(s) <= 65536:
            raise InvalidArgument(f"environment variable {var}={v!r} is not a world size (1..65536)")
        return int(v)
    return None


def parse_topology(text: str) -> dict:
    """Parses "tp=2,pp=2,dp=4,zero=1" into {tp, pp, vpp, dp, zero, world_size, text}. Raises
    InvalidArgument naming the key."""
    return _C.parse_topology(text)


def describe_change(source: str, target: str) -> str:
    """The change between two topologies in words ("tp 2->4, dp 4->2, ZeRO-1 partitions re-cut")."""
    return _C.describe_change(source, target)


def synth_checkpoint(root: str, model, topology: str, seed: int, step: str = "step-1") -> None:
    """Writes a synthetic native checkpoint (every value a pure function of seed, tensor, state and
    logical index), for tests and benchmarks."""
    _C.synth_checkpoint(str(root), model_config(model), topology, int(seed), step)
