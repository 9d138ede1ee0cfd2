"""Dump and consolidate the live training state of the reference trainer (tests and the demo).

    mpirun ... python -m integration.megatron_deepspeed.state_dump --dump-dir D --dump-at load|save \\
        <train.py arguments>

runs train.py and, right after its load step (--dump-at load: then exits) or at each save point
(--dump-at save), writes D/rank<r>.pt per rank: module weights by canonical name (tp-local), the
ZeRO fp32 partitions, exp_avg, exp_avg_sq, step, and the flat-group description. `consolidate(D)`
turns a dump of any layout into full (tp-merged, dp-gathered) tensors per canonical name, so
dumps of different layouts can be compared value by value.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch


def dump_engine(engine, path: str, extra: dict = None):
    import torch.distributed as dist
    from .reshard_hook import LiveState
    live = LiveState(engine, engine.module.gpt_config)
    d = {"stage": live.stage, "tp_rank": live.tp_rank, "dp_rank": live.dp_rank, "tp": live.tp, "pp": live.pp,
         "dp": live.dp, "zero": live.zero, "groups": live.groups, "dead": sorted(live.dead),
         "fp32": [p.detach().clone() for p in live.fp32_partitions],
         "exp_avg": [], "exp_avg_sq": [], "step": []}
    if live.zero == 3:  # this rank's partition of each weight, and the weights' shapes
        d["weight_parts"] = {k: live.weight_tensor(k).detach().clone() for k in live.params}
        d["weight"] = {k: torch.empty(tuple(p.ds_shape), dtype=p.ds_tensor.dtype) for k, p in live.params.items()}
    else:
        d["weight"] = {k: p.detach().clone() for k, p in live.params.items()}
    if live.zero == 0:  # per-parameter state, laid side by side in group-entry order
        d["fp32"] = [torch.cat([live._zero0_master(c).detach().clone() for c, _, _ in g["entries"]])
                     for g in live.groups]
        for kind in ("exp_avg", "exp_avg_sq"):
            for g in live.groups:
                views = []
                for c, _, _ in g["entries"]:
                    ki, off, n = live.z0_state[c]
                    t = live.torch_opt.state.get(live.state_keys[ki], {}).get(kind)
                    views.append(None if t is None else t.view(-1).narrow(0, off, n).clone())
                d[kind].append(None if any(v is None for v in views) else torch.cat(views))
    for part in live.state_keys:
        st = live.torch_opt.state.get(part, {})
        if live.zero != 0:
            d["exp_avg"].append(st["exp_avg"].clone() if "exp_avg" in st else None)
            d["exp_avg_sq"].append(st["exp_avg_sq"].clone() if "exp_avg_sq" in st else None)
        s = st.get("step")
        d["step"].append(None if s is None else float(s))
    import reshard.integrations.megatron_deepspeed as RM
    d["loss_scaler"] = RM.loss_scaler_state(live.zopt)
    d["global_steps"] = int(engine.global_steps)
    d["global_samples"] = int(engine.global_samples)
    d.update(extra or {})
    os.makedirs(path, exist_ok=True)
    torch.save(d, os.path.join(path, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


def load_dump(path: str):
    """Test tool: reads back the dumps this module wrote in the same test (docs/reliability.md)."""
    return [torch.load(f, weights_only=False) for f in sorted(glob.glob(os.path.join(path, "rank*.pt")),
                                                              key=lambda f: int(f.split("rank")[-1][:-3]))]


def consolidate(path_or_dumps, model_dict: dict, include_dead: bool = False):
    """{"weight"|"fp32"|"exp_avg"|"exp_avg_sq": {canonical: full tensor}, "step": sorted set of
    steps, "replica_diffs": {(kind, name): max |diff| between tp replicas or stage copies}}."""
    import reshard
    dumps = load_dump(path_or_dumps) if isinstance(path_or_dumps, str) else path_or_dumps
    tp = dumps[0]["tp"]
    splits = {t["name"]: t["split"] for t in reshard.model_tensors(reshard.model_config(model_dict), tp)}
    # Per (kind, name, stage, tp_rank): the tp-local tensor (weights: as is; states: gathered over dp).
    local = {}
    for d in dumps:
        if d.get("zero") == 3:  # weights: the dp ranks' partitions side by side, padding cut
            if d["dp_rank"] == 0:
                parts = sorted((e for e in dumps if e["stage"] == d["stage"] and e["tp_rank"] == d["tp_rank"]),
                               key=lambda e: e["dp_rank"])
                for name, w in d["weight"].items():
                    flat = torch.cat([e["weight_parts"][name] for e in parts])[:w.numel()]
                    local[("weight", name, d["stage"], d["tp_rank"])] = flat.float().reshape(w.shape)
        elif d["dp_rank"] == 0:
            for name, w in d["weight"].items():
                if name in d["dead"] and not include_dead:
                    continue
                local[("weight", name, d["stage"], d["tp_rank"])] = w.float().reshape(w.shape)
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        for d in dumps:
            shapes = {n: w.shape for n, w in d["weight"].items()}
            if d.get("zero") == 0 and d["dp_rank"] != 0:
                continue  # ZeRO-0: every dp rank holds the whole state; dp rank 0's is the one
            for g, grp in enumerate(d["groups"]):
                part = d[kind][g]
                if part is None:
                    continue
                P = grp["partition_size"]
                lo_p = 0 if d.get("zero") == 0 else d["dp_rank"] * P
                for name, off, n in grp["entries"]:
                    if name in d["dead"] and not include_dead:
                        continue
                    key = (kind, name, d["stage"], d["tp_rank"])
                    if key not in local:
                        local[key] = torch.full((n, ), float("nan"))
                    if d.get("zero") == 3:  # elements [r*q, (r+1)*q) of the tensor, at off in the partition
                        q = -(-n // d["dp"])
                        lo, hi = min(n, d["dp_rank"] * q), min(n, (d["dp_rank"] + 1) * q)
                        local[key][lo:hi] = part[off:off + hi - lo].float()
                        continue
                    lo, hi = max(off, lo_p), min(off + n, lo_p + P)
                    if lo < hi:
                        local[key][lo - off:hi - off] = part[lo - lo_p:hi - lo_p].float()
    # reshape states to the weight shapes
    shapes = {}
    for d in dumps:
        for name, w in d["weight"].items():
            shapes[(name, d["stage"], d["tp_rank"])] = w.shape
    out = {k: {} for k in ("weight", "fp32", "exp_avg", "exp_avg_sq")}
    diffs = {}
    names = sorted({k[1] for k in local})
    for kind in out:
        for name in names:
            stages = sorted({k[2] for k in local if k[0] == kind and k[1] == name})
            if not stages:
                continue
            per_stage = []
            for s in stages:
                parts = []
                for t in range(tp):
                    x = local.get((kind, name, s, t))
                    if x is None:
                        parts = None
                        break
                    parts.append(x.reshape(shapes[(name, s, t)]))
                if parts is None:
                    continue
                split = splits.get(name, "replicated")
                if split in ("column", "vocab", "qkv"):
                    full = torch.cat(parts, 0)
                elif split == "row":
                    full = torch.cat(parts, 1)
                elif split == "swiglu":
                    halves = [p.chunk(2, 0) for p in parts]
                    full = torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
                else:
                    full = parts[0]
                    for t in range(1, tp):
                        diff = float((parts[t] - parts[0]).abs().max()) if parts[0].numel() else 0.0
                        diffs[(kind, name, f"tp{t}")] = max(diffs.get((kind, name, f"tp{t}"), 0.0), diff)
                per_stage.append(full)
            for i in range(1, len(per_stage)):
                diffs[(kind, name, f"stage{stages[i]}")] = float((per_stage[i] - per_stage[0]).abs().max())
            out[kind][name] = per_stage[0]
    steps = sorted({s for d in dumps for s in d["step"] if s is not None})
    return {**out, "step": steps, "replica_diffs": diffs,
            "global_steps": sorted({d["global_steps"] for d in dumps}),
            "global_samples": sorted({d["global_samples"] for d in dumps})}


def scramble(engine):
    """Overwrites every tensor a load must fill (module weights, fp32 partitions, moments, step)
    with NaN/-1, so a dump after a load proves that the load wrote every element."""
    from .reshard_hook import LiveState
    live = LiveState(engine, engine.module.gpt_config)
    with torch.no_grad():
        for k, p in live.params.items():
            live.weight_tensor(k).fill_(float("nan"))
        masters = live.fp32_partitions if live.zero != 0 else [live._zero0_master(c) for c in live.params]
        for m in masters:
            m.data.fill_(float("nan"))
        for part in live.state_keys:
            st = live.torch_opt.state.get(part, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    st[k].fill_(float("nan"))
            if "step" in st:  # in the optimizer's own type (DeepSpeed's FusedAdam keeps an int)
                st["step"] = -1 if isinstance(st["step"], int) else torch.tensor(-1.0)


def eval_logits(engine, args):
    """Loss and this rank's (vocab-parallel) logits on a fixed batch: samples [8000, 8000+mb) of the
    corpus order, the same under every layout. Logits only on the last stage (else None)."""
    from . import train
    cfg = engine.module.gpt_config
    data = train.FortuneData(cfg.seq_length, args.seed)
    toks, labs = zip(*(data.sample(8000 + j) for j in range(args.micro_batch)))
    batch = (torch.stack(toks), torch.stack(labs))
    loss, logits = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    return float(loss), (logits.detach().clone() if torch.is_tensor(logits) else None)


def gather_logits(path_or_dumps):
    """Full logits [mb, seq, Vp] of the last stage (dp rank 0), concatenated over tp."""
    dumps = load_dump(path_or_dumps) if isinstance(path_or_dumps, str) else path_or_dumps
    last = [d for d in dumps if d["stage"] == d["pp"] - 1 and d["dp_rank"] == 0]
    last.sort(key=lambda d: d["tp_rank"])
    return torch.cat([d["logits"].float() for d in last], dim=-1)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--scramble", action="store_true", help="scramble the live state before loading")
    p.add_argument("--eval", action="store_true", help="also record loss and logits on a fixed batch after the load")
    p.add_argument("--deepspeed-load", default=None,
                   help="after the dump, scramble and load this DeepSpeed folder with engine.load_checkpoint; dump "
                        "again to DUMP_DIR/deepspeed")
    p.add_argument("--deepspeed-tag", default=None, help="tag (step folder) for --deepspeed-load (default: latest)")
    p.add_argument("--exit-after-load", action="store_true")
    p.add_argument("--load-gathered", action="store_true",
                   help="ZeRO-3: run the load inside deepspeed.zero.GatheredParameters over every parameter")
    p.add_argument("--dump-on-error", action="store_true",
                   help="dump the live state before the load (DUMP_DIR/before); when the load raises a reshard "
                        "error, dump it again (DUMP_DIR/after), write DUMP_DIR/error-rank<r>.txt and exit 3")
    p.add_argument("--dump-at-save", action="store_true", help="dump at each save point to DUMP_DIR/it<N>")
    ours, rest = p.parse_known_args(argv)
    from . import train, train_reshard
    import torch.distributed as dist
    native, rest = train_reshard.parse(rest)
    if native.save_native:
        train_reshard.install(native.save_native, not native.no_deepspeed_save)
    original = train.load_with

    def load_and_dump(engine, args):
        if ours.scramble:
            scramble(engine)
        def load():
            if ours.load_gathered:
                import deepspeed
                with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                    return original(engine, args)
            return original(engine, args)

        if ours.dump_on_error:
            import reshard

            def failed(e, dump_after):
                if dump_after:
                    dump_engine(engine, os.path.join(ours.dump_dir, "after"))
                with open(os.path.join(ours.dump_dir, f"error-rank{dist.get_rank()}.txt"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
                dist.barrier()
                dist.destroy_process_group()
                sys.exit(3)

            try:  # an engine the view refuses (offload) fails here, before any load
                dump_engine(engine, os.path.join(ours.dump_dir, "before"))
            except reshard.Error as e:
                os.makedirs(ours.dump_dir, exist_ok=True)
                failed(e, False)
            try:
                it, consumed = load()
            except reshard.Error as e:
                failed(e, True)
        else:
            it, consumed = load()
        extra = {"iteration": it, "consumed": consumed}
        if ours.eval:
            extra["eval_loss"], extra["logits"] = eval_logits(engine, args)
        dump_engine(engine, os.path.join(ours.dump_dir, "load"), extra)
        if ours.deepspeed_load:
            scramble(engine)
            path, cs = engine.load_checkpoint(ours.deepspeed_load, tag=ours.deepspeed_tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
            assert path is not None, ours.deepspeed_load
            extra = {"iteration": int(cs["iteration"]), "consumed": int(cs["args"].consumed_train_samples)}
            if ours.eval:
                extra["eval_loss"], extra["logits"] = eval_logits(engine, args)
            dump_engine(engine, os.path.join(ours.dump_dir, "deepspeed"), extra)
        if ours.exit_after_load:
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)
        return it, consumed

    train.load_with = load_and_dump
    if ours.dump_at_save:
        original_save = train.save_checkpoint

        def save_and_dump(engine, cfg, args, iteration, consumed, uc_info, no_pipeline):
            original_save(engine, cfg, args, iteration, consumed, uc_info, no_pipeline)
            extra = {"iteration": iteration}
            if ours.eval:
                extra["eval_loss"], extra["logits"] = eval_logits(engine, args)
            dump_engine(engine, os.path.join(ours.dump_dir, f"it{iteration}"), extra)

        train.save_checkpoint = save_and_dump
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
