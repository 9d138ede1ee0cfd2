#!/usr/bin/env python3
"""GPU throughput benchmark: DCP's load into CUDA tensors, and the final table.

Run by benchmarks/gpu_check.sh on the GPU machine, next to build/bin/gpu_load (reshard into
CUDA buffers + the same-run ceilings).

  gpu_bench.py dcp STEP_DIR --work DIR --out dcp.json [--repeats 2]
      Reads every rank file of a native step folder (safetensors) into one state dict
      ("rank/buffer" -> 1-D tensor), saves it with torch.distributed.checkpoint at world size 1,
      then times dcp.load into CUDA tensors of the same shapes (warm page cache).
  gpu_bench.py table --reshard gpu_load.json [--dcp dcp.json] --out results.json
      Prints the short table (GB/s, seconds, sizes; GB = 1e9 bytes) and writes the merged JSON.

No reshard import: this needs only torch (with CUDA) and safetensors.
"""
import argparse
import glob
import json
import os
import shutil
import sys
import time


def cmd_dcp(a):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(a.step_dir, "rank_*.safetensors")))
    if not files:
        sys.exit(f"no rank_*.safetensors in {a.step_dir}")
    t0 = time.perf_counter()
    state = {}
    for f in files:
        rank = os.path.basename(f).split(".")[0]
        for k, v in load_file(f).items():
            state[f"{rank}/{k}"] = v
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    read_s = time.perf_counter() - t0
    path = os.path.join(a.work, "dcp_ckpt")
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(path, thread_count=8)
    dcp.save(state, storage_writer=writer)
    save_s = time.perf_counter() - t0
    shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
    del state
    print(f"dcp: state of {nbytes / 1e9:.2f} GB in {len(shapes)} tensors (read {read_s:.1f} s), saved in {save_s:.1f} s",
          flush=True)
    dest = {k: torch.empty(s, dtype=d, device="cuda") for k, (s, d) in shapes.items()}
    torch.cuda.synchronize()
    runs = []
    for i in range(a.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        runs.append(s)
        print(f"  dcp.load -> cuda: {nbytes / 1e9:.2f} GB in {s:.3f} s = {nbytes / s / 1e9:.2f} GB/s", flush=True)
    # Spot check: one tensor equals the file's.
    k0 = next(iter(shapes))
    rank, name = k0.split("/", 1)
    ref = load_file(os.path.join(a.step_dir, rank + ".safetensors"))[name]
    ok = bool(torch.equal(dest[k0].cpu(), ref))
    out = {
        "dcp_bytes": nbytes,
        "dcp_tensors": len(shapes),
        "dcp_save_seconds": save_s,
        "dcp_load_seconds": runs,
        "dcp_load_best_gbps": nbytes / min(runs) / 1e9,
        "dcp_spot_check_equal": ok,
        "torch": torch.__version__,
        "note": "DCP saved and loaded at world size 1 (same bytes as the reshard checkpoint, no resharding)",
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    if not a.keep:
        shutil.rmtree(path, ignore_errors=True)


def cmd_table(a):
    R = {}
    if a.reshard and os.path.exists(a.reshard):
        with open(a.reshard) as f:
            R.update(json.load(f))
    if a.dcp and os.path.exists(a.dcp):
        with open(a.dcp) as f:
            R.update(json.load(f))
    tb = R.get("target_bytes") or R.get("checkpoint_bytes") or 0
    cb = R.get("checkpoint_bytes") or tb

    def best_run(label_prefix, source):
        rs = [r for r in R.get("runs", []) if r["label"].startswith(label_prefix) and r["source"] == source]
        return min(rs, key=lambda r: r["seconds"]) if rs else None

    rows = []

    def row(name, gbps, secs, gb, note=""):
        rows.append((name, gbps, secs, gb, note))

    for src in ("pread", "mmap"):
        r = best_run("warm", src)
        if r:
            row(f"reshard -> CUDA, warm ({src})", r["gbps"], r["seconds"], r["target_bytes"] / 1e9,
                f"{R.get('source_layout', '?')} -> {R.get('target_layout', '?')}")
    if "dcp_load_best_gbps" in R:
        row("DCP -> CUDA, warm", R["dcp_load_best_gbps"], min(R["dcp_load_seconds"]), R["dcp_bytes"] / 1e9,
            "world 1, no resharding")
    if "ceiling_pagecache_read_gbps" in R:
        row("ceiling: page-cache read, 16 thr", R["ceiling_pagecache_read_gbps"], R["ceiling_pagecache_read_seconds"],
            cb / 1e9, "into one pinned buffer")
    if "pagecache_read_1thread_gbps" in R:
        row("page-cache read, 1 thread", R["pagecache_read_1thread_gbps"], cb / 1e9 / R["pagecache_read_1thread_gbps"],
            cb / 1e9, "")
    if "ceiling_pinned_h2d_gbps" in R:
        row("ceiling: pinned H2D", R["ceiling_pinned_h2d_gbps"], R["ceiling_pinned_h2d_seconds"], cb / 1e9, "one cudaMemcpy")
    if "ceiling_cold_read_gbps" in R:
        row("ceiling: cold read, 16 thr", R["ceiling_cold_read_gbps"], cb / 1e9 / R["ceiling_cold_read_gbps"], cb / 1e9,
            "page cache dropped")
    if "reshard_cold_file_gbps" in R:
        ratio = R["reshard_cold_file_gbps"] / R["ceiling_cold_read_gbps"] if R.get("ceiling_cold_read_gbps") else 0
        R["cold_ratio"] = ratio
        row("reshard -> CUDA, cold (pread)", R["reshard_cold_file_gbps"], cb / 1e9 / R["reshard_cold_file_gbps"], cb / 1e9,
            f"file bytes/s; {ratio:.2f} x cold ceiling")
    best_warm = max([r["gbps"] for r in R.get("runs", []) if r["label"].startswith("warm")] or [0])
    R["reshard_warm_best_gbps"] = best_warm
    if "dcp_load_best_gbps" in R and R["dcp_load_best_gbps"]:
        R["speedup_vs_dcp"] = best_warm / R["dcp_load_best_gbps"]
    print()
    print(f"GPU load throughput on {R.get('device', '?')} (GB = 1e9 bytes)")
    print(f"{'what':36s} {'GB/s':>8s} {'s':>8s} {'GB':>7s}  note")
    for name, g, s, gb, note in rows:
        print(f"{name:36s} {g:8.2f} {s:8.3f} {gb:7.2f}  {note}")
    goals = []
    goals.append(f"warm >= 20 GB/s: {'yes' if best_warm >= 20 else 'no'} ({best_warm:.2f})")
    if "cold_ratio" in R:
        goals.append(f"cold >= 0.9 x ceiling: {'yes' if R['cold_ratio'] >= 0.9 else 'no'} ({R['cold_ratio']:.2f})")
    if "speedup_vs_dcp" in R:
        goals.append(f"vs DCP: {R['speedup_vs_dcp']:.1f}x")
    print("goals: " + "; ".join(goals))
    with open(a.out, "w") as f:
        json.dump(R, f, indent=2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dcp")
    d.add_argument("step_dir")
    d.add_argument("--work", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--keep", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("--reshard")
    t.add_argument("--dcp")
    t.add_argument("--out", required=True)
    a = p.parse_args()
    {"dcp": cmd_dcp, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
