"""DeepSpeed Universal Checkpointing (UCP) peer of the benchmark: the universal load half.

    mpirun -np K python -m benchmarks.ds_worker ROOT --target tp=1,pp=1,dp=2,zero=1 TRAINER_FLAGS...

ROOT holds a DeepSpeed save written by integration/megatron_deepspeed/train.py and, after
`python -m deepspeed.checkpoint.ds_to_universal`, a universal folder named by ROOT/latest_universal.
Builds the reference trainer's engine (PipelineModule, bf16 + BF16_Optimizer; ZeRO-2/3 targets: the
plain DeepSpeedEngine on GPTModel) at the target layout
with checkpoint.load_universal = true and times engine.load_checkpoint (weights, fp32 master,
exp_avg, exp_avg_sq, LR scheduler). Rank 0 prints one JSON line: seconds, peak RSS (max over ranks).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    root = argv.pop(0)
    i = argv.index("--target")
    target = argv[i + 1]
    del argv[i:i + 2]
    from integration.megatron_deepspeed import train as T  # sets the MPI / CPU environment
    import deepspeed
    import logging
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    M = T.M
    ds_logger.setLevel(logging.WARNING)
    d = dict(kv.split("=") for kv in target.split(","))
    tp, pp, dp, zero = int(d.get("tp", 1)), int(d.get("pp", 1)), int(d.get("dp", 1)), int(d.get("zero", 1))
    plain = zero >= 2  # ZeRO-2/3 run the plain DeepSpeedEngine on GPTModel (pp=1)
    args = T.build_parser().parse_args(argv + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--zero", str(zero),
                                              "--global-batch", str(2 * dp), "--micro-batch", "2"] +
                                       (["--no-pipeline"] if plain else []))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = T.config_from_args(args, world)
    topo = PipeModelDataParallelTopology(num_pp=cfg.pp, num_mp=cfg.tp, num_dp=cfg.dp)
    M.init_tensor_parallel(topo)
    mpu = None
    if plain:
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid
        net = M.GPTModel(cfg)
        mpu = PipelineParallelGrid(topology=topo) if cfg.tp > 1 else None
    else:
        net = M.build_gpt_pipe(cfg, topo)
    groups = M.get_param_groups(net, args.weight_decay)
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    conf = T.ds_config(args, 1)
    conf["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=conf, mpu=mpu)
    # This rank's 16-bit weights (ZeRO-3: its partitions), fp32 master partitions and moments.
    live = sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size()
               for p in engine.module.parameters())
    for attr in ("fp32_groups_flat_partition", "fp32_partitioned_groups_flat"):  # BF16_Optimizer, ZeRO-3
        for g in getattr(engine.optimizer, attr, []) or []:
            live += 3 * g.numel() * g.element_size()
    def rchar():
        with open("/proc/self/io") as f:
            return int(next(l for l in f if l.startswith("rchar:")).split()[1])

    dist.barrier()
    r0 = rchar()
    t0 = time.perf_counter()
    path, _ = engine.load_checkpoint(root, load_optimizer_states=True, load_lr_scheduler_states=True)
    dist.barrier()
    secs = time.perf_counter() - t0
    nread = rchar() - r0
    if path is None:
        raise SystemExit(f"UCP load found nothing under {root}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = torch.tensor([float(rss), float(rss - live), float(live)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    tot = torch.tensor([float(live), float(nread)], dtype=torch.float64)
    dist.all_reduce(tot)
    if rank == 0:
        print(json.dumps({"seconds": secs, "peak_rss_bytes": int(t[0]), "rss_above_live_bytes": int(t[1]),
                          "live_bytes_max_rank": int(t[2]), "target_bytes": int(tot[0]), "bytes_read": int(tot[1]), "ranks": world,
                          "path": path}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # The result is out. Skip interpreter teardown: in one measurement a rank aborted there
    # ("terminate called without an active exception", a thread still alive at exit) after
    # reporting, and the bench counted the finished load as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
