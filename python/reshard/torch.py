"""reshard.torch: load a checkpoint into a live torch module and its optimizer, in place.

For PyTorch-native jobs: FSDP2 (``fully_shard``) and DTensor meshes (tp/dp), or plain modules.
The target layout is read from the module itself: each parameter's (or persistent buffer's)
global shape and the box of it that each rank holds (DTensor placements, as
``torch.distributed.checkpoint`` computes them); plain tensors are whole on every rank. The
checkpoint is any reshard reads whose tensor names are the module's fully qualified names: a
``torch.distributed.checkpoint`` folder (``dcp.save({"model": ..., "optim": ...})`` with
``get_state_dict``) or a native checkpoint converted from one.

One line replaces ``dcp.load`` + ``set_state_dict``::

    report = reshard.torch.load(model, optimizer, "ckpt/step-100")
"""

from __future__ import annotations

import json as _json
import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch as _torch

import reshard as _r
from reshard import _C

__all__ = ["load", "load_state_dict", "module_layout"]

_NAMES = {v: k for k, v in _r._TORCH_DTYPES.items()}
_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_SUPPORTED_OPTIMIZERS = (_torch.optim.Adam, _torch.optim.AdamW, _torch.optim.RAdam)


def _local_box(fqn: str, t: _torch.Tensor) -> Tuple[_torch.Tensor, List[int], List[int]]:
    """(local tensor, global offsets, local sizes) of ``t`` on this rank."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        DTensor = ()
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t._local_tensor
        if local.numel() == 0 and math.prod(shape) == 0:
            return local, list(offset), list(shape)  # an empty shard (FSDP2 may shape it [0, 0])
        if list(local.shape) != list(shape):
            raise _r.InvalidArgument(f"reshard.torch.load: {fqn}: the local shard has shape {list(local.shape)} but "
                                     f"its placements {t.placements} give {list(shape)} (a padded shard?)")
        return local, list(offset), list(shape)
    return t, [0] * t.dim(), list(t.shape)


def _optimizer_states(model: _torch.nn.Module, optimizer, want: bool) -> Dict[str, Dict[str, _torch.Tensor]]:
    """{fqn: {"exp_avg", "exp_avg_sq", "step"}} of an Adam-family optimizer, creating state a
    fresh optimizer has not made yet (zeros, step 0, as its first step would)."""
    if optimizer is None or not want:
        return {}
    name_of = {id(p): n for n, p in model.named_parameters()}
    out: Dict[str, Dict[str, _torch.Tensor]] = {}
    # Optimizers whose whole per-parameter state is step, exp_avg and exp_avg_sq. NAdam
    # (mu_product) and Adamax (exp_inf) keep more, which a checkpoint of these three cannot
    # restore: refused by name rather than resumed with part of the state the job's own.
    if not isinstance(optimizer, _SUPPORTED_OPTIMIZERS):
        raise _r.InvalidArgument(f"reshard.torch.load: {type(optimizer).__name__} is not supported; reshard carries "
                                 "the state of Adam, AdamW and RAdam (step, exp_avg, exp_avg_sq) only")
    for g in optimizer.param_groups:
        if g.get("amsgrad"):
            raise _r.InvalidArgument("reshard.torch.load: amsgrad=True keeps max_exp_avg_sq, which the checkpoint "
                                     "does not carry; refused rather than resuming with it zeroed")
        on_device = bool(g.get("capturable") or g.get("fused"))
        for p in g["params"]:
            fqn = name_of.get(id(p))
            if fqn is None:
                raise _r.InvalidArgument("reshard.torch.load: the optimizer holds a parameter that is not one of "
                                         "the model's (named_parameters)")
            st = optimizer.state[p]
            if not st:
                st["step"] = (_torch.zeros((), dtype=_torch.float32, device=p.device) if on_device
                              else _torch.tensor(0.0, dtype=_torch.float32))
                st["exp_avg"] = _torch.zeros_like(p, memory_format=_torch.preserve_format)
                st["exp_avg_sq"] = _torch.zeros_like(p, memory_format=_torch.preserve_format)
            missing = [k for k in ("step",) + _ADAM_STATES if k not in st]
            extra = sorted(set(st) - {"step", *_ADAM_STATES})
            if missing or extra:
                raise _r.InvalidArgument(f"reshard.torch.load: the optimizer state of {fqn} "
                                         f"{'lacks ' + str(missing) if missing else 'also holds ' + str(extra)}; "
                                         "reshard carries step, exp_avg and exp_avg_sq")
            out[fqn] = st
    return out


def module_layout(model: _torch.nn.Module, optimizer=None, *, optimizer_states: bool = True,
                  group=None) -> Tuple["_r.Layout", Dict[str, _torch.Tensor]]:
    """The layout of a live module (and its Adam-family optimizer's exp_avg / exp_avg_sq) and this
    rank's tensors for :func:`reshard.load`: ``(layout, {buffer name: local tensor})``.

    Tensors: ``model.state_dict(keep_vars=True)`` (parameters and persistent buffers, by fully
    qualified name) and, with an optimizer, each parameter's exp_avg and exp_avg_sq (made as
    zeros, with step 0, where a fresh optimizer has none yet). A DTensor contributes the box its
    placements give this rank (torch's own ``compute_local_shape_and_global_offset``, what DCP
    records as chunk offsets and sizes), a plain tensor its whole self on every rank. Buffer names:
    ``"<state>/<fqn>"`` (state "weight", "exp_avg", "exp_avg_sq"); empty shards have none.
    Collective over ``group`` (default WORLD) when torch.distributed is initialized: the ranks
    exchange their boxes (one all_gather_object). Raises InvalidArgument: a local shard that is not
    contiguous or not the shape its placements give, a non-Adam optimizer, amsgrad, a parameter of
    the optimizer that the model does not name.
    """
    def entries():
        states = _optimizer_states(model, optimizer, optimizer_states)
        out = []
        for fqn, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, _torch.Tensor):
                continue
            out.append((fqn, "weight", t))
            for s in _ADAM_STATES:
                if fqn in states:
                    out.append((fqn, s, states[fqn][s]))
        return out
    return _gathered_layout(entries, group, "reshard.torch.load")


def _gathered_layout(make_entries, group, what: str):
    """(layout, {buffer name: local tensor}) of the tensors ``make_entries()`` lists as
    ``(name, state, tensor)``: each rank's boxes all-gathered (one all_gather_object, which also
    carries each rank's errors, so that all ranks raise together)."""
    import torch.distributed as dist
    dist_on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if dist_on else 1
    rank = dist.get_rank(group) if dist_on else 0
    arrays, mine, tensors, entries, err = [], [], {}, [], None
    try:
        entries = make_entries()
        for i, (fqn, state, t) in enumerate(entries):
            if t.dim() == 0:
                raise _r.InvalidArgument(f"{what}: {fqn} is a 0-d tensor; reshard loads tensors of 1+ dims (0-d "
                                         "buffers such as BatchNorm's num_batches_tracked are not carried yet)")
            local, off, size = _local_box(fqn, t)
            if not local.is_contiguous():
                raise _r.InvalidArgument(f"{what}: the local shard of {fqn} ({state}) is not contiguous")
            if local.dtype not in _NAMES:
                raise _r.InvalidArgument(f"{what}: {fqn} has dtype {local.dtype}, which reshard does not load")
            arrays.append((fqn, state, list(t.shape)))
            if local.numel() > 0:
                mine.append((i, _NAMES[local.dtype], off, size))
                tensors[f"{state}/{fqn}"] = local
    except Exception as e:  # noqa: BLE001 - agreed across ranks below, then raised
        err = e
    # Every rank learns every rank's boxes, and whether any rank failed its checks (a rank that
    # raised alone would leave the others waiting in the load's first collective).
    own = ("" if err is None else f"[rank {rank}] {err}", mine)
    every = [own]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, own, group=group)
    failed = [m for m, _ in every if m]
    if err is not None:
        raise err
    if failed:
        raise _r.InvalidArgument(f"{what} refused on every rank before anything was read: {'; '.join(failed[:4])}")
    buffers = []
    for r, (_, boxes) in enumerate(every):
        for i, dtype, off, size in boxes:
            fqn, state, _ = entries[i]
            buffers.append((f"{state}/{fqn}", r, dtype, i, off, size))
    return _C.explicit_layout("torch module", f"dp={world},zero=3", arrays, buffers), tensors


def _flatten(sd, prefix=""):
    """DCP's flat keys of a nested state dict: dict keys and list indices joined with '.'."""
    out = {}
    items = sd.items() if isinstance(sd, Mapping) else enumerate(sd)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, _torch.Tensor):
            out[key] = v
        elif isinstance(v, (Mapping, list, tuple)):
            out.update(_flatten(v, key + "."))
    return out


def load_state_dict(state_dict: Mapping, path, *, step=None, comm: Optional["_r.Communicator"] = None,
                    policies: Optional[Mapping] = None, verify: str = _r.DEFAULT_VERIFY,
                    io_threads: Optional[int] = None, progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Fills the tensors of ``state_dict`` in place from ``path``, shaped like
    ``dcp.load(state_dict, checkpoint_id=path)``: a (nested) dict of DTensors and plain tensors,
    keyed as it was saved (``{"model": {...}, "optim": {...}}`` or flat keys). Collective.

    Keys are flattened as DCP flattens them ("optim.state.<fqn>.exp_avg"); the optimizer entries
    the checkpoint's reader recognised map to their parameter's state, step counters
    (``...state.<fqn>.step``, 0-d tensors) are set from the checkpoint after the load, and other
    non-tensor values are left as they are (the checkpoint's are in ``report["state"]["json"]``).
    Errors as in :func:`reshard.load`: a key the checkpoint lacks (``strict_missing``), a
    checkpoint tensor the dict lacks (``strict_unexpected``), shapes that differ, damaged files.
    Returns :func:`reshard.load`'s report.
    """
    ckpt = path if isinstance(path, _r.Checkpoint) else _r.open_checkpoint(str(path), step=step)
    try:
        dcp_state = _json.loads(ckpt.state["json"]).get("dcp", {})
    except (ValueError, AttributeError, TypeError):
        dcp_state = {}
    px = dcp_state.get("prefixes", {})
    model_px, optim_px = px.get("model", ""), px.get("optim", "")
    flat = _flatten(state_dict)
    steps = {}

    def entries():
        out = []
        for key, t in flat.items():
            if optim_px and key.startswith(optim_px):
                fqn, _, kind = key[len(optim_px):].rpartition(".")
                if kind == "step" and t.dim() == 0:
                    steps[fqn] = t
                    continue
                if kind in _ADAM_STATES:
                    out.append((fqn, kind, t))
                    continue
            name = key[len(model_px):] if model_px and key.startswith(model_px) else key
            out.append((name, "weight", t))
        return out
    layout, tensors = _gathered_layout(entries, None, "reshard.torch.load_state_dict")
    with _torch.no_grad():
        report = _r.load(ckpt, layout, tensors, comm=comm, policies=policies, verify=verify, io_threads=io_threads,
                         progress=progress)
        saved = dcp_state.get("param_steps", {})
        for fqn, t in steps.items():
            v = saved.get(fqn, report.get("step", -1))
            if v is not None and v >= 0:
                t.fill_(float(v))
    return report


def load(model: _torch.nn.Module, optimizer, path, *, step=None, comm: Optional["_r.Communicator"] = None,
         policies: Optional[Mapping] = None, verify: str = _r.DEFAULT_VERIFY, io_threads: Optional[int] = None,
         progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Loads ``path`` into ``model`` (and ``optimizer``) in place, resharding from whatever layout
    the checkpoint was saved under to the module's current one (FSDP2 at another dp size, a
    DTensor tp/dp mesh, one process). Collective: every rank of the job calls it alike.

    ``model``: an ``nn.Module`` whose parameters are DTensors (FSDP2, tensor parallel) or plain
    tensors; names are its ``state_dict`` keys. ``optimizer``: an Adam-family torch optimizer over
    the model's parameters (Adam, AdamW or RAdam: exp_avg, exp_avg_sq and step are loaded; state
    is created where a fresh optimizer has none), or None for weights only (the checkpoint's
    optimizer state is then not wanted; a checkpoint weight the module lacks still is an error
    under strict_unexpected). Hyperparameters (lr, betas, ...) stay the
    job's own; the checkpoint's are in ``report["state"]["json"]`` (``dcp.values``).
    ``path``: a checkpoint root or step folder (DCP or native); ``step``: as in
    :func:`reshard.load`. ``comm``, ``policies``, ``verify``, ``io_threads``, ``progress``: as in
    :func:`reshard.load`.

    Every element comes from the checkpoint bitwise (dtype conversion only where the module's
    dtype differs); elements no file holds, missing or truncated files, damaged chunks and
    tensors the module lacks (or the checkpoint lacks) raise before any write, as
    :func:`reshard.load` does. After the load each parameter's optimizer step is the checkpoint's
    (its per-parameter counters where they differ).

    Returns :func:`reshard.load`'s report, plus ``"step_set"`` (the step given to the optimizer,
    or None when the checkpoint records none; then the optimizer's step counters stay 0 and a
    warning says so).
    """
    ckpt = path if isinstance(path, _r.Checkpoint) else _r.open_checkpoint(str(path), step=step)
    pol = dict(policies or {})
    has_optim = any(b["state"] in _ADAM_STATES for b in ckpt.layout.buffers)
    layout, tensors = module_layout(model, optimizer, optimizer_states=has_optim or optimizer is not None)
    saved = {t["name"] for t in ckpt.layout.tensors}
    try:
        saved_steps = _json.loads(ckpt.state["json"]).get("dcp", {}).get("param_steps", {})
    except (ValueError, AttributeError, TypeError):
        saved_steps = {}
    files_missing = any(n.startswith("missing file: ") for n in ckpt.notes)  # the load names what they held
    if optimizer is not None and saved_steps and has_optim and not files_missing:
        # A parameter whose moments load but whose step counter is missing would resume Adam's
        # bias correction from another parameter's count (or from 0): refused before any write.
        name_of = {id(p): n for n, p in model.named_parameters()}
        optimized = {name_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]}
        nostep = sorted(n for n in optimized if n in saved and n not in saved_steps)
        if nostep:
            raise _r.InvalidArgument(f"reshard.torch.load: the checkpoint has no optimizer step counter for "
                                     f"{', '.join(nostep[:8])}{' ...' if len(nostep) > 8 else ''}, whose moments it "
                                     "holds; refused rather than guessing their step")
    with _torch.no_grad():
        report = _r.load(ckpt, layout, tensors, comm=comm, policies=pol, verify=verify, io_threads=io_threads,
                         progress=progress)
    report["step_set"] = None
    try:
        dcp_state = _json.loads(report["state"]["json"]).get("dcp", {})
    except (ValueError, AttributeError, KeyError, TypeError):
        dcp_state = {}
    if dcp_state.get("values"):
        report.setdefault("not_carried", []).append(
            f"{len(dcp_state['values'])} non-tensor entries (optimizer param_groups: lr, betas, ...): the job's "
            "optimizer keeps its own; the checkpoint's are in state json dcp.values")
    if optimizer is not None:
        states = _optimizer_states(model, optimizer, True)
        steps = dcp_state.get("param_steps", {})
        default = report.get("step", -1)
        for fqn, st in states.items():
            v = steps.get(fqn, default if default is not None and default >= 0 else None)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            st["step"].fill_(float(v))
            report["step_set"] = float(v) if report["step_set"] is None else report["step_set"]
        if report["step_set"] is None and states:
            report.setdefault("warnings", []).append("the checkpoint records no optimizer step; the optimizer's step "
                                                     "counters stay 0 (Adam's bias correction restarts)")
    return report
