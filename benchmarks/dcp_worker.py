"""PyTorch Distributed Checkpoint (DCP) peer of the benchmark. Run under mpirun (gloo on CPU):

    mpirun -np N python benchmarks/dcp_worker.py save DIR --model-json J --layout tp=2,pp=1,dp=2,zero=1
    mpirun -np K python benchmarks/dcp_worker.py load DIR --model-json J --layout tp=1,pp=1,dp=2,zero=1 [--cold]

The state dict holds DTensors on a (dp, tp) device mesh, like the layout: bf16 weights sharded on
their tp dim and replicated over dp; fp32 master, exp_avg and exp_avg_sq sharded on the tp dim and
on dim 0 over dp (ZeRO-1 style). `load` builds an empty state dict sharded like the target layout
and times dcp.load (DCP's own load with resharding). Rank 0 prints one JSON line. Pipeline
parallelism is not expressed (pp must be 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpt_shapes import GPT, parse_layout  # noqa: E402


def init():
    import torch.distributed as dist
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def build_state(model: GPT, layout: dict, fill: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    import torch.distributed.tensor as dt
    if layout["pp"] != 1:
        raise SystemExit("dcp_worker: pipeline layouts are not expressed (pp must be 1)")
    mesh = init_device_mesh("cpu", (layout["dp"], layout["tp"]), mesh_dim_names=("dp", "tp"))
    sd = {}
    live = 0
    gen = torch.Generator().manual_seed(1234 + int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    for name, shape, split in model.tensors():
        tp_pl = Shard(split) if split is not None else Replicate()
        kinds = [("model." + name, torch.bfloat16, [Replicate(), tp_pl])]
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            # dp shards dim 0 (for a dim-0 tp split: the tp shard is cut again by dp).
            kinds.append((f"optim.{k}.{name}", torch.float32, [Shard(0), tp_pl]))
        for key, dtype, pl in kinds:
            t = dt.empty(*shape, dtype=dtype, device_mesh=mesh, placements=pl)
            loc = t.to_local()
            if fill:
                loc.uniform_(-1, 1, generator=gen)
            else:
                loc.zero_()  # touch the pages: live tensors of a trainer exist before the load
            live += loc.numel() * loc.element_size()
            sd[key] = t
    return sd, live


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def rchar() -> int:
    """Bytes this process read through read(2)-family calls (page cache hits included)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("dir")
    ap.add_argument("--model-json", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--cold", action="store_true", help="evict DIR's files from the page cache first")
    ap.add_argument("--reshard-bin", default=None, help="reshard binary (for `bench evict` with --cold)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--loader", choices=["dcp", "reshard"], default="dcp",
                    help="load mode: dcp.load, or reshard.torch.load_state_dict into the same state dict")
    a = ap.parse_args()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = init()
    layout = parse_layout(a.layout)
    if layout["world"] != world:
        raise SystemExit(f"layout {a.layout} has world size {layout['world']} but {world} ranks run")
    with open(a.model_json) as f:
        model = GPT(**json.load(f))
    if a.loader == "reshard":
        import reshard.torch as reshard_torch
    rss0 = peak_rss()
    if a.mode == "save":
        sd, live = build_state(model, layout, fill=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=a.dir)
        dist.barrier()
        secs = time.perf_counter() - t0
        out = {"mode": "save", "seconds": secs}
    else:
        sd, live = build_state(model, layout, fill=False)
        times, resident, nread = [], None, 0
        for _ in range(a.repeat):
            if a.cold and rank == 0:
                files = [os.path.join(a.dir, f) for f in sorted(os.listdir(a.dir))]
                r = subprocess.run([a.reshard_bin, "bench", "evict"] + files, capture_output=True, text=True, check=True)
                resident = json.loads(r.stdout)["resident_fraction_after"]
            dist.barrier()
            r0 = rchar()
            t0 = time.perf_counter()
            if a.loader == "dcp":
                dcp.load(sd, checkpoint_id=a.dir)
            else:
                rep = reshard_torch.load_state_dict(sd, a.dir)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            # reshard reads through file mappings (not counted by rchar): its report counts the
            # bytes every rank read, once (rank 0 contributes it to the sum below).
            nread = rchar() - r0 if a.loader == "dcp" else (
                rep["bytes_read"] - rep.get("bytes_reread_on_node", 0) if rank == 0 else 0)
        t = torch.tensor([float(peak_rss()), float(peak_rss() - live), float(live), float(rss0)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        tot = torch.tensor([float(live), float(nread)], dtype=torch.float64)
        dist.all_reduce(tot)
        out = {"mode": "load", "seconds_all": times, "seconds": median(times),
               "peak_rss_bytes": int(t[0]), "rss_above_live_bytes": int(t[1]), "live_bytes_max_rank": int(t[2]),
               "rss_before_bytes": int(t[3]), "target_bytes": int(tot[0]), "bytes_read": int(tot[1]), "ranks": world, "cold": a.cold}
        if resident is not None:
            out["resident_fraction_after_evict"] = resident
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
