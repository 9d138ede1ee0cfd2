"""Reference trainer: a tiny Megatron-DeepSpeed-style GPT trained with real DeepSpeed on CPU.

Launch (one process per rank; world size = tp * pp * dp):

    DS_ACCELERATOR=cpu mpirun --oversubscribe --allow-run-as-root -np 8 \\
        .venv/bin/python -m integration.megatron_deepspeed.train --tp 2 --pp 2 --dp 2 --steps 5 \\
        --log-json /tmp/loss.json

Under torchrun (elastic agents, --nnodes=MIN:MAX) the same command runs as is; with --elastic
--load ROOT --save ROOT every (re)start picks its layout from the newest complete checkpoint and
the world size it was given, and reshards it (docs/elastic.md, elastic_demo.py).

mpirun's OMPI_COMM_WORLD_* variables are mapped to RANK/WORLD_SIZE/LOCAL_RANK; MASTER_ADDR defaults
to 127.0.0.1 and MASTER_PORT to 29500 (set it to run several jobs at once). A single process can also
be started directly (world size 1).

Data: the Debian fortunes corpus, byte-level tokens (ids 0..255; 0 separates fortunes), fixed-length
samples chosen by a seeded permutation. Sample i of the run is a pure function of i, and step s uses
global samples [s*G, (s+1)*G) (G = global batch) in Megatron's order (micro-step m, dp rank d gets
[m*mb*dp + d*mb, +mb)), so every layout and every resumed run sees the same batches.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import hashlib
import json
import os
import random
import sys
import time
import warnings

import numpy as np


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _setup_env_from_mpi():
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env:
        env.setdefault("RANK", env["OMPI_COMM_WORLD_RANK"])
        env.setdefault("WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE"])
        env.setdefault("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        env.setdefault("LOCAL_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    env.setdefault("DS_ACCELERATOR", "cpu")
    # One compute thread per rank: ranks are oversubscribed on small machines.
    env.setdefault("OMP_NUM_THREADS", "1")
    # DeepSpeed's CPU shm allreduce op (deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize) creates
    # /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (about 69 MB) per rank and never
    # unlinks it: every run would leave its world size x 69 MB in a tmpfs. Each rank removes its own
    # at exit (every rank opened its peers' buffers at init, so none is needed by then).
    atexit.register(_unlink, f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env['MASTER_ADDR']}_"
                    f"{env['MASTER_PORT']}_{env['RANK']}")
    warnings.filterwarnings("ignore", message=r".*c10d::broadcast_.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*all_gather_into_tensor.*")


_setup_env_from_mpi()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from . import model as M  # noqa: E402

FORTUNES_DIR = "/usr/share/games/fortunes"
EOS = 0


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def corpus_files(root: str = FORTUNES_DIR):
    files = []
    for p in sorted(glob.glob(os.path.join(root, "*"))):
        name = os.path.basename(p)
        if "." in name or not os.path.isfile(p) or os.path.islink(p):
            continue
        files.append(p)
    return files


class FortuneData:
    """Byte-level token stream of the fortunes corpus; sample(i) -> (tokens[seq], labels[seq])."""

    def __init__(self, seq_length: int, seed: int, root: str = FORTUNES_DIR):
        files = corpus_files(root)
        if not files:
            raise FileNotFoundError(f"no fortune files under {root} (apt-get install fortunes fortunes-min)")
        pieces = []
        h = hashlib.sha256()
        for p in files:
            raw = open(p, "rb").read()
            h.update(os.path.basename(p).encode() + b"\0" + raw)
            for entry in raw.split(b"\n%\n"):
                entry = entry.strip(b"%\n").replace(b"\0", b" ")
                if entry:
                    pieces.append(entry + bytes([EOS]))
        stream = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.int64)
        self.stream = torch.from_numpy(stream)
        self.seq = seq_length
        self.num_chunks = (len(stream) - 1) // seq_length
        self.perm = np.random.RandomState(seed).permutation(self.num_chunks)
        self.corpus_sha256 = h.hexdigest()
        self.num_files = len(files)

    def sample(self, i: int):
        c = int(self.perm[i % self.num_chunks])
        s = c * self.seq
        window = self.stream[s:s + self.seq + 1]
        return window[:-1], window[1:]

    def micro_batch(self, step: int, micro: int, dp_rank: int, mb: int, dp: int, global_batch: int):
        base = step * global_batch + micro * mb * dp + dp_rank * mb
        toks, labs = zip(*(self.sample(base + j) for j in range(mb)))
        return torch.stack(toks), torch.stack(labs)


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


class _ResumeConfigAction(argparse.Action):
    """--resume-config also marks the run as resuming (main() loads when args.load is set)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if getattr(namespace, "load", None) is None:
            namespace.load = values


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parallel")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--dp", type=int, default=None, help="default: world_size / (tp*pp)")
    g.add_argument("--zero", type=int, default=1, help="ZeRO stage (pipeline: 0 or 1; --no-pipeline: 0..3)")
    g.add_argument("--round-robin-gradients", action="store_true",
                   help="ZeRO-1/2: DeepSpeed's round_robin_gradients (reorders each group's parameters over dp)")
    g.add_argument("--no-contiguous-gradients", dest="contiguous_gradients", action="store_false", default=True,
                   help="ZeRO-1/2/3: contiguous_gradients off")
    g.add_argument("--param-persistence-threshold", type=int, default=None,
                   help="ZeRO-3: stage3_param_persistence_threshold (parameters with fewer elements stay gathered; "
                        "DeepSpeed's default keeps every parameter of the small test models gathered)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO 1-3: DeepSpeed's offload_optimizer to the CPU (reshard refuses to fill it)")
    g.add_argument("--no-pipeline", action="store_true",
                   help="plain DeepSpeed engine on the non-pipeline GPTModel (pp=1, any tp)")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=64)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--query-groups", "--num-key-value-heads", dest="query_groups", type=int, default=None,
                   help="GQA query groups (default: = heads, i.e. MHA)")
    g.add_argument("--ffn", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    t = g.add_mutually_exclusive_group()
    t.add_argument("--tied", dest="tied", action="store_true", default=True)
    t.add_argument("--untied", dest="tied", action="store_false")
    g.add_argument("--no-bias", dest="bias", action="store_false", default=True)
    g.add_argument("--normalization", choices=["layernorm", "rmsnorm"], default="layernorm")
    g.add_argument("--no-position-embeddings", dest="position_embeddings", action="store_false", default=True)
    g.add_argument("--vocab-size", type=int, default=256)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=64)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="DeepSpeed fp16 with its dynamic loss scaler (--no-pipeline only): ZeRO-0 runs "
                        "FP16_UnfusedOptimizer, ZeRO 1-3 their own fp16 paths. DeepSpeed's CPU accelerator "
                        "reports fp16 only where oneDNN has fp16 kernels; torch's CPU fp16 kernels run this "
                        "model, so the trainer declares fp16 support to DeepSpeed on such a CPU")
    g.add_argument("--initial-scale-power", type=int, default=8, help="fp16: initial loss scale 2^N")
    g.add_argument("--grad-accum-dtype", choices=["fp32", "bf16", "default"], default="fp32",
                   help="bf16 only: DeepSpeed data_types.grad_accum_dtype (fp32 -> BF16_Optimizer under ZeRO-1)")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=5, help="train until this iteration (absolute)")
    g.add_argument("--micro-batch", type=int, default=2)
    g.add_argument("--global-batch", type=int, default=8)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--optimizer", choices=["adamw", "fused-adam"], default="adamw",
                   help="torch's AdamW, or DeepSpeed's FusedAdam in AdamW mode (its CPU build here; with --fp16 at "
                        "ZeRO-0 DeepSpeed then runs FP16_Optimizer, else FP16_UnfusedOptimizer)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=0.0)
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=0, help="0: only at the end")
    g.add_argument("--load", default=None)
    g = p.add_argument_group("reshard (load a checkpoint saved under any layout)")
    g.add_argument("--load-with", choices=["deepspeed", "reshard"], default="deepspeed",
                   help="loader for --load: DeepSpeed's own (same layout only) or reshard (any layout)")
    g.add_argument("--load-step", default=None, help="reshard: step to load (default: latest)")
    g.add_argument("--resume-config", default=None, action=_ResumeConfigAction,
                   help="configs/resume/*.yaml: checkpoint, target layout and policies; loads with reshard")
    g.add_argument("--reshard-replicas", choices=["error", "average", "first"], default=None,
                   help="reshard: policy for tp/pipeline replicas that differ (default error)")
    g.add_argument("--reshard-report", default=None, help="reshard: write the load report (JSON) here (rank 0)")
    g.add_argument("--log-json", default=None)
    g = p.add_argument_group("elastic resume (a restart at another world size: torchrun --nnodes=MIN:MAX, mpirun)")
    g.add_argument("--elastic", action="store_true",
                   help="choose tp/pp/dp from the newest complete checkpoint under --load and the job's world size "
                        "(--elastic-policy), recompute the micro-batch for the saved global batch, load with reshard; "
                        "with no checkpoint yet, start at --tp/--pp. A resume config with target: auto does the same")
    g.add_argument("--elastic-policy", choices=["keep", "list", "refuse"], default="keep",
                   help="keep: tp and pp stay, dp = world/(tp*pp) (default); list: the first --elastic-allowed that fits; "
                        "refuse: only the saved world size")
    g.add_argument("--elastic-allowed", action="append", default=[], metavar="LAYOUT",
                   help="policy list: a candidate layout such as tp=2,pp=2 (repeat, in order of preference)")
    g.add_argument("--loss-log", default=None,
                   help="append one JSON line per step (rank 0): step, loss, world size, layout, restart count")
    g.add_argument("--die-in-save", type=int, default=None, help=argparse.SUPPRESS)  # tests: SIGKILL a rank mid-save
    g = p.add_argument_group("output")
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--verbose", action="store_true", help="DeepSpeed INFO logging")
    return p


def config_from_args(args, world: int) -> M.GPTConfig:
    if args.dp is None:
        args.dp = world // (args.tp * args.pp)
    if args.tp * args.pp * args.dp != world:
        raise SystemExit(f"tp*pp*dp = {args.tp * args.pp * args.dp} != world size {world}")
    return M.GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       num_key_value_heads=args.query_groups or args.heads, ffn_hidden_size=args.ffn,
                       swiglu=args.swiglu, tied=args.tied, add_bias_linear=args.bias,
                       normalization=args.normalization, vocab_size=args.vocab_size,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                       seq_length=args.seq_length, position_embeddings=args.position_embeddings,
                       bf16=args.bf16, fp16=args.fp16, seed=args.seed, tp=args.tp, pp=args.pp, dp=args.dp)


def make_optimizer(args, groups):
    """The client optimizer DeepSpeed wraps: torch AdamW or DeepSpeed's FusedAdam (AdamW mode), with
    the same hyperparameters."""
    kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    if args.optimizer == "fused-adam":
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam(groups, adam_w_mode=True, **kw)
    return torch.optim.AdamW(groups, **kw)


def ds_config(args, gas: int) -> dict:
    cfg = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": args.clip_grad,
        "zero_optimization": {"stage": args.zero, "round_robin_gradients": bool(args.round_robin_gradients),
                              "contiguous_gradients": bool(args.contiguous_gradients)},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(args.bf16)},
        "fp16": {"enabled": bool(args.fp16), "initial_scale_power": args.initial_scale_power,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.param_persistence_threshold is not None:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = args.param_persistence_threshold
    if args.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # the trainer's torch AdamW, offloaded as is
    if args.bf16 and args.grad_accum_dtype != "default":
        cfg["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    return cfg


# ----------------------------------------------------------------------------------------------
# Checkpoint client state (Megatron-DeepSpeed save_checkpoint)
# ----------------------------------------------------------------------------------------------


def get_rng_state():
    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),  # CPU accelerator: the CPU generator
        "rng_tracker_states": {},
    }]


def client_state(cfg: M.GPTConfig, args, iteration: int, consumed: int, uc_info: dict) -> dict:
    ns = M.megatron_args_namespace(cfg, {
        "iteration": iteration,
        "train_iters": args.steps,
        "consumed_train_samples": consumed,
        "consumed_valid_samples": 0,
        "micro_batch_size": args.micro_batch,
        "global_batch_size": args.global_batch,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "clip_grad": args.clip_grad,
        "zero_stage": args.zero,
        "no_pipeline_parallel": bool(args.no_pipeline),
        "save": args.save,
        "load": args.load,
        "tokenizer_type": "ByteLevel",
    })
    info = dict(uc_info)
    info.update({
        "original_vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size,
        "universal_checkpoint_version": 0.2,
    })
    return {
        "args": ns,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "tokens": consumed * cfg.seq_length,
        "universal_checkpoint_info": info,
        "rng_state": get_rng_state(),
    }


def save_checkpoint(engine, cfg, args, iteration, consumed, uc_info, no_pipeline: bool):
    if args.die_in_save == iteration and dist.get_rank() == dist.get_world_size() - 1:
        # A node lost during a save (tests of the elastic restart): this rank is killed (SIGKILL)
        # when DeepSpeed asks it to write its first file of the step, after the collective tag
        # check, so the others write theirs (given a few seconds); this rank's files never appear
        # and `latest` keeps naming the previous step.
        import signal

        def die(*_args, **_kwargs):
            time.sleep(5)
            os.kill(os.getpid(), signal.SIGKILL)

        engine.checkpoint_engine.save = die
    state = client_state(cfg, args, iteration, consumed, uc_info)
    # A folder of this step from an earlier run (a save that did not finish, or one a restart from
    # an older step now redoes) goes first: DeepSpeed writes file by file into it, and stale files
    # of another layout would mix with the new ones.
    stale = os.path.join(args.save, f"global_step{iteration}")
    if dist.get_rank() == 0 and os.path.isdir(stale):
        import shutil
        shutil.rmtree(stale)
    dist.barrier()
    module = engine.module
    if no_pipeline:
        # Megatron-DeepSpeed (--no-pipeline-parallel) saves the nested Megatron state dict.
        original = module.state_dict
        module.state_dict = lambda destination=None, prefix="", keep_vars=False: \
            module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
    try:
        engine.save_checkpoint(args.save, client_state=state)
    finally:
        if no_pipeline:
            module.state_dict = original
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def elastic_layout(args, world: int):
    """--elastic or a resume config with ``target: auto``: sets args.tp, args.pp, args.dp and
    args.micro_batch for a job of ``world`` ranks from the newest complete checkpoint (reshard's
    chooser, the policy given) and makes the load read that step with reshard. Returns what was
    decided, for the log (None when neither asks for it). The chosen ZeRO stage replaces --zero
    (policy keep: the saved one). With no checkpoint yet (the root is missing or empty, or no
    save ever finished: no latest_checkpointed_iteration.txt, no native step), the job starts at
    --tp/--pp with dp = world/(tp*pp).
    Raises reshard.InvalidArgument when no layout fits (naming the world size and each layout tried)
    and reshard.NotFound when the root holds steps but none is complete."""
    import reshard
    if args.resume_config:
        rc = reshard.load_resume_config(args.resume_config)
        if rc["target"] != "auto":
            return None
        root, step = rc["checkpoint"], rc["step"] or "newest"
        policy, allowed, model = rc["elastic"]["policy"], rc["elastic"]["allowed"], rc["model"] or None
        if model:  # a path or a preset name under configs/models, as the CLI takes it
            model = reshard.model_config(model)
    elif args.elastic:
        if not args.load:
            raise SystemExit("--elastic needs --load ROOT (where the job saves: --save ROOT)")
        root, step = args.load, args.load_step or "newest"
        policy, allowed, model = args.elastic_policy, args.elastic_allowed, None
        if allowed and policy != "list":
            raise SystemExit("--elastic-allowed is read by --elastic-policy list only")
    else:
        return None
    info = {"world_size": world, "policy": policy, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    def first_start(why):
        args.dp = world // (args.tp * args.pp) if world % (args.tp * args.pp) == 0 else None
        info.update(checkpoint=None, reason=f"{why}: starting at tp={args.tp},pp={args.pp}")
        args.load = None
        return info

    if not os.path.isdir(root) or not any(not n.startswith(".") for n in os.listdir(root)):
        return first_start(f"no checkpoint under {root} yet")
    try:
        ckpt = reshard.open_checkpoint(root, step=step, model=model)
    except (reshard.NotFound, reshard.InvalidArgument, reshard.DataLoss) as e:
        # A finished save leaves latest_checkpointed_iteration.txt (this trainer and Megatron write
        # it after every rank's files); native saves are atomic. With neither, no save ever
        # finished, and what is there is the first one, cut short: starting over is what a kill a
        # moment earlier would have left. DeepSpeed's own `latest` proves nothing: its rank 0
        # writes it without waiting for the other ranks' files.
        finished = os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt")) or \
            any(os.path.isfile(os.path.join(root, n, "metadata.json")) for n in os.listdir(root))
        if finished:
            raise
        return first_start(f"no save under {root} ever finished (the first was cut short: {e})")
    choice = reshard.choose_layout(ckpt, world, policy=policy, allowed=allowed, global_batch=args.global_batch)
    t = reshard.parse_topology(choice["target"])
    if t["vpp"] != 1:
        raise reshard.InvalidArgument(f"elastic resume chose {choice['target']}; this trainer runs vpp=1 only")
    args.tp, args.pp, args.dp, args.zero = t["tp"], t["pp"], t["dp"], t["zero"]
    batch = reshard.plan_batch(args.global_batch, args.micro_batch, args.dp)
    args.micro_batch = batch["micro_batch"]
    args.load, args.load_step, args.load_with = root, os.path.basename(ckpt.path), "reshard"
    info.update(checkpoint=ckpt.path, saved=ckpt.topology, target=choice["target"], reason=choice["reason"],
                tried=choice["tried"], micro_batch=batch["micro_batch"], grad_accum=batch["grad_accum"],
                batch_reason=batch["reason"], notes=[n for n in ckpt.notes if n.startswith(("newest complete step", "skipped step"))])
    return info


def load_with(engine, args):
    """Hook point: load a checkpoint into the engine and return (iteration, consumed_samples).

    --resume-config FILE or --load-with reshard: reshard reads the checkpoint (native or DeepSpeed,
    any saved layout) and fills the live engine in place (reshard_hook.reshard_load); otherwise
    DeepSpeed's own same-layout load_checkpoint.
    """
    if args.resume_config or args.load_with == "reshard":
        from . import reshard_hook as RH
        if args.resume_config:
            iteration, consumed, report = RH.load_from_resume_config(engine, args, args.resume_config)
        else:
            policies = {"replicas": args.reshard_replicas} if args.reshard_replicas else None
            iteration, consumed, report = RH.reshard_load(engine, args, args.load, step=args.load_step,
                                                          policies=policies)
        if dist.get_rank() == 0:
            if not args.quiet:
                print(report["text"], end="", flush=True)
                print(f"  rng: {report['rng']}; {report['bit16_check']}", flush=True)
            if args.reshard_report:
                with open(args.reshard_report, "w") as f:
                    json.dump({**{k: v for k, v in report.items() if k != "text"},
                               "elastic": getattr(args, "elastic_choice", None)}, f, indent=1)
        return iteration, consumed
    path, cs = engine.load_checkpoint(args.load, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {args.load}")
    iteration = int(cs["iteration"])
    consumed = int(getattr(cs["args"], "consumed_train_samples", iteration * args.global_batch))
    return iteration, consumed


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    args = build_parser().parse_args(argv)
    t0 = time.time()
    import deepspeed
    import logging
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.INFO if args.verbose else logging.WARNING)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    elastic = args.elastic_choice = elastic_layout(args, world)
    if elastic and rank == 0 and not args.quiet:
        print(f"[elastic] {elastic['reason']}", flush=True)
        if elastic.get("checkpoint"):
            print(f"[elastic] step {os.path.basename(elastic['checkpoint'])}: {elastic['saved']} -> {elastic['target']}; "
                  f"micro-batch {elastic['micro_batch']} x {elastic['grad_accum']} accumulation steps x dp {args.dp} = "
                  f"global batch {args.global_batch}" + (f" ({elastic['batch_reason']})" if elastic["batch_reason"] else ""),
                  flush=True)
            for n in elastic["notes"]:
                print(f"[elastic] note: {n}", flush=True)
    cfg = config_from_args(args, world)
    if args.no_pipeline:
        if cfg.pp != 1:
            raise SystemExit("--no-pipeline runs one pipeline stage (pp=1); tp and dp are free")
    elif args.zero > 1:
        raise SystemExit("DeepSpeed's PipelineEngine supports ZeRO stage 0/1 only; use --no-pipeline")
    elif args.fp16:
        raise SystemExit("--fp16 runs the plain engine only; add --no-pipeline")
    if args.fp16 and args.bf16:
        raise SystemExit("--fp16 and --bf16 exclude each other")
    if args.fp16:
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if acc.device_name() == "cpu" and not acc.is_fp16_supported():
            type(acc).is_fp16_supported = lambda self: True  # see --fp16's help
    mb, dp = args.micro_batch, cfg.dp
    if args.global_batch % (mb * dp):
        raise SystemExit("global batch must be a multiple of micro_batch * dp")
    gas = args.global_batch // (mb * dp)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    data = FortuneData(cfg.seq_length, args.seed)

    mpu = None
    if args.no_pipeline:
        # One stage; DeepSpeed's grid over the same topology is the engine's mpu, so ZeRO partitions
        # over the data-parallel group of each tp rank (rank = dp_rank * tp + tp_rank).
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid
        topo = PipeModelDataParallelTopology(num_pp=1, num_mp=cfg.tp, num_dp=cfg.dp)
        M.init_tensor_parallel(topo)
        net = M.GPTModel(cfg)
        uc_info = M.gpt_universal_checkpoint_info(cfg)
        dp_rank = topo.get_coord(rank).data
        if cfg.tp > 1:
            mpu = PipelineParallelGrid(topology=topo)
    else:
        topo = PipeModelDataParallelTopology(num_pp=cfg.pp, num_mp=cfg.tp, num_dp=cfg.dp)
        M.init_tensor_parallel(topo)
        net = M.build_gpt_pipe(cfg, topo)
        uc_info = M.pipe_universal_checkpoint_info(cfg)
        dp_rank = topo.get_coord(rank).data

    groups = M.get_param_groups(net, args.weight_decay)
    opt = make_optimizer(args, groups)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=ds_config(args, gas), mpu=mpu)

    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = load_with(engine, args)
        if consumed != iteration * args.global_batch:
            raise SystemExit(f"consumed samples {consumed} != iteration*global_batch; global batch changed?")

    log = {"config": {**cfg.to_dict(), "zero": args.zero, "no_pipeline": args.no_pipeline,
                      "global_batch": args.global_batch, "micro_batch": mb, "gas": gas, "lr": args.lr,
                      "corpus_sha256": data.corpus_sha256, "start_iteration": iteration},
           "elastic": elastic, "steps": []}
    if args.save and rank == 0:
        os.makedirs(args.save, exist_ok=True)

    while iteration < args.steps:
        step = iteration
        batches = [data.micro_batch(step, m, dp_rank, mb, dp, args.global_batch) for m in range(gas)]
        if args.no_pipeline:
            total = 0.0
            for toks, labs in batches:
                loss = engine(toks, labs)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            lt = torch.tensor([total / gas], dtype=torch.float64)
            dist.all_reduce(lt)  # every tp rank of a dp rank holds the same loss
            loss_val = float(lt) / world
        else:
            loss = engine.train_batch(data_iter=iter(batches))
            loss_val = float(loss.detach().double()) if torch.is_tensor(loss) else float(loss)
        iteration += 1
        consumed += args.global_batch
        if rank == 0:
            log["steps"].append({"step": iteration, "loss": loss_val, "consumed_samples": consumed})
            if not args.quiet:
                print(f"[train] step {iteration} loss {loss_val:.8f}", flush=True)
            if args.log_json:
                with open(args.log_json, "w") as f:
                    json.dump(log, f, indent=1)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"step": iteration, "loss": loss_val, "world_size": world,
                                        "layout": f"tp={cfg.tp},pp={cfg.pp},dp={cfg.dp}", "micro_batch": mb, "gas": gas,
                                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                        "start_iteration": log["config"]["start_iteration"]}) + "\n")
        if args.save and args.save_interval and iteration % args.save_interval == 0 and iteration < args.steps:
            save_checkpoint(engine, cfg, args, iteration, consumed, uc_info, args.no_pipeline)

    if args.save:
        save_checkpoint(engine, cfg, args, iteration, consumed, uc_info, args.no_pipeline)
    if rank == 0 and not args.quiet:
        print(f"[train] done in {time.time() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
