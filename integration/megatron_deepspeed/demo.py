"""The main job: train at tp=2,pp=2,dp=2, save, restart at other layouts with reshard resharding
weights and optimizer state on the fly, train on, and compare with the uninterrupted run.

    PYTHONPATH=python:. .venv/bin/python -m integration.megatron_deepspeed.demo --out demo_out

1. Source + baseline: one uninterrupted run at tp=2,pp=2,dp=2 for K+N iterations (fp32, no
   dropout), saving at iteration K (DeepSpeed's own format, plus reshard's native format written
   from the live engine by train_reshard.py). Its losses after K are the uninterrupted baseline.
2. For each target layout (tp=1,pp=2,dp=4 and tp=4,pp=1,dp=2 on the PipelineEngine with ZeRO-1,
   and ZeRO-3 at dp=4 on the plain DeepSpeedEngine): a new job starts at that layout, reshard_load
   fills the live DeepSpeed engine from the checkpoint (the DeepSpeed folder when this build can
   read it, else the native one), and it trains N more iterations.
3. Prints both curves and the reshard reports; writes OUT/report.json and OUT/loss_curves.png.

Comparable by construction: same global batch, data order driven by consumed samples, heads and
groups divisible by 4, padded vocab 256 at tp 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from integration.megatron_deepspeed.launch import mpirun_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--layers", "4", "--hidden", "64", "--heads", "8", "--query-groups", "4", "--ffn", "128", "--seq-length",
         "32", "--micro-batch", "2", "--global-batch", "8", "--lr", "1e-3"]


def run(name, tp, pp, dp, module, extra, out, timeout):
    world = tp * pp * dp
    log = os.path.join(out, f"{name}.json")
    t0 = time.time()
    print(f"[demo] {name}: tp={tp},pp={pp},dp={dp} ({world} ranks)", flush=True)
    r, cmd = mpirun_module(module, tp, pp, dp, list(extra) + ["--log-json", log, "--quiet"] + MODEL, timeout)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + r.stdout + "\n--- stderr\n" + r.stderr)
    if r.returncode != 0:
        tail = "\n".join(l for l in r.stderr.splitlines() if "rank0]" in l or "Error" in l)[-4000:]
        raise SystemExit(f"[demo] {name} failed (exit {r.returncode}); see {out}/{name}.log\n{tail}")
    with open(log) as f:
        steps = {s["step"]: s["loss"] for s in json.load(f)["steps"]}
    print(f"[demo] {name}: {len(steps)} iterations in {time.time() - t0:.0f} s", flush=True)
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo_out")
    p.add_argument("--save-at", type=int, default=24, help="iteration K at which the source run saves")
    p.add_argument("--after", type=int, default=20, help="iterations N trained after the restart")
    p.add_argument("--source", default="2,2,2", help="tp,pp,dp of the source run")
    p.add_argument("--targets", default="1,2,4;4,1,2;1,1,4,3",
                   help="tp,pp,dp[,zero] of each restart, ';'-separated; zero 2 or 3 runs the plain DeepSpeedEngine "
                        "(GPTModel, pp=1), else the PipelineEngine with ZeRO-1")
    p.add_argument("--checkpoint-format", choices=["auto", "deepspeed", "native"], default="auto",
                   help="what the restarts read: auto = DeepSpeed's folder when this build reads it, else native")
    p.add_argument("--timeout", type=int, default=420, help="seconds per training job")
    args = p.parse_args(argv)
    t_start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.join(out, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    K, N = args.save_at, args.after
    src = tuple(int(x) for x in args.source.split(","))
    targets = []
    for t in args.targets.split(";"):
        v = [int(x) for x in t.split(",")]
        if len(v) not in (3, 4) or (len(v) == 4 and v[3] > 1 and v[1] != 1):
            raise SystemExit(f"--targets: {t!r} is not tp,pp,dp[,zero] (zero 2 or 3 needs pp=1)")
        targets.append((v[0], v[1], v[2], v[3] if len(v) == 4 else 1))

    # 1. Source run, which is also the uninterrupted baseline.
    base = run("baseline", *src, "train_reshard",
               ["--save-native", os.path.join(ckpt, "native"), "--save", os.path.join(ckpt, "deepspeed"),
                "--save-interval", str(K), "--steps", str(K + N)], out, args.timeout)

    import reshard
    fmt = args.checkpoint_format
    if fmt == "auto":
        try:
            reshard.inspect(os.path.join(ckpt, "deepspeed"), step=str(K))
            fmt = "deepspeed"
        except reshard.Error as e:
            print(f"[demo] reading the DeepSpeed folder directly is not available in this build ({type(e).__name__}: "
                  f"{e}); restarting from the native checkpoint the source run also wrote", flush=True)
            fmt = "native"
    load_root = os.path.join(ckpt, fmt)

    results = []
    curves = {}
    for (tp, pp, dp, zero) in targets:
        label = f"tp={tp},pp={pp},dp={dp}" + (f",zero={zero}" if zero != 1 else "")
        name = f"resume_tp{tp}_pp{pp}_dp{dp}" + (f"_zero{zero}" if zero != 1 else "")
        rep_path = os.path.join(out, f"{name}.reshard.json")
        # The restart is driven by a resume config (configs/resume/*.yaml format), as a trainer
        # would be on a real restart.
        rc_path = os.path.join(out, f"{name}.resume.yaml")
        with open(rc_path, "w") as f:
            f.write(f"checkpoint:\n  root: {load_root}\n  step: \"{K}\"\n"
                    f"target: tp={tp},pp={pp},dp={dp},zero={zero}\n"
                    "verify: full\n"  # every checksummed record read is checked before any write
                    "policies:\n  replicas: error\n  strict_missing: true\n  strict_unexpected: true\n"
                    "  memory_budget_gib: 1\n")
        engine = ["--no-pipeline", "--zero", str(zero)] if zero > 1 else []
        losses = run(name, tp, pp, dp, "train",
                     engine + ["--resume-config", rc_path, "--reshard-report", rep_path, "--steps", str(K + N)], out,
                     args.timeout)
        with open(rep_path) as f:
            rep = json.load(f)
        after = [s for s in sorted(losses) if s > K]
        rel = [abs(losses[s] - base[s]) / abs(base[s]) for s in after]
        curves[label] = losses
        results.append({
            "layout": label,
            "source_layout": f"tp={src[0]},pp={src[1]},dp={src[2]}",
            "change": rep["change"],
            "checkpoint_format": fmt,
            "loss_before_save": base[K],
            "first_loss_after_resume": losses[K + 1],
            "baseline_loss_same_step": base[K + 1],
            "first_step_rel_diff": rel[0],
            "max_rel_loss_diff_vs_uninterrupted": max(rel),
            "steps_compared": len(after),
            "reshard_seconds": rep["seconds"],
            "reshard_hook_seconds": rep["hook_seconds"],
            "reshard_gbps": rep["gbps"],
            "bytes_read": rep["bytes_read"],
            "bytes_exchanged": rep["bytes_exchanged"],
            "bytes_verified": rep["bytes_verified"],
            "target_bytes": rep["target_bytes"],
            "peak_rss_bytes": rep["rank_peak_rss_bytes"],
            "peak_staging_bytes": rep["peak_staging_bytes"],
            "rng": rep["rng"],
            "bit16_check": rep["bit16_check"],
            "not_carried": rep["not_carried"],
            "policies": rep["policies"],
        })

    # Side by side.
    cols = list(curves)
    print("\n iter  uninterrupted " + " ".join(f"{c:>22}" for c in cols))
    for s in range(K - 2, K + N + 1):
        row = f"{s:5d}  {base[s]:13.8f} " + " ".join(
            f"{curves[c][s]:22.8f}" if s in curves[c] else f"{'(before restart)':>22}" for c in cols)
        print(row + ("   <- saved here" if s == K else ""))
    print()
    for r in results:
        print(f"[demo] {r['source_layout']} -> {r['layout']} ({r['change']}) from the {r['checkpoint_format']} "
              f"checkpoint: read {r['bytes_read'] / 1e6:.3f} MB (ranks of one machine each copy what they share; "
              f"verify full: every stored record read from, {r['bytes_verified'] / 1e6:.3f} MB, checked before any "
              f"write), exchanged {r['bytes_exchanged'] / 1e6:.3f} MB, "
              f"wrote {r['target_bytes'] / 1e6:.3f} MB in {r['reshard_seconds']:.3f} s ({r['reshard_gbps']:.4f} GB/s), "
              f"peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB; first loss after resume {r['first_loss_after_resume']:.8f} vs "
              f"uninterrupted {r['baseline_loss_same_step']:.8f} (rel {r['first_step_rel_diff']:.2e}); max rel diff over "
              f"{r['steps_compared']} steps {r['max_rel_loss_diff_vs_uninterrupted']:.2e}; rng {r['rng']}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = sorted(base)
    ax[0].plot(xs, [base[s] for s in xs], "k-", lw=2, label=f"uninterrupted tp={src[0]},pp={src[1]},dp={src[2]}")
    for c in cols:
        s2 = sorted(curves[c])
        ax[0].plot(s2, [curves[c][s] for s in s2], "--", marker=".", label=f"resumed at {c}")
    ax[0].axvline(K, color="gray", ls=":")
    ax[0].set_xlabel("iteration")
    ax[0].set_ylabel("loss")
    ax[0].legend()
    ax[0].set_title("loss: uninterrupted vs resharded restarts")
    for c in cols:
        s2 = sorted(curves[c])
        ax[1].semilogy(s2, [max(abs(curves[c][s] - base[s]) / abs(base[s]), 1e-12) for s in s2], marker=".", label=c)
    ax[1].axhline(1e-3, color="r", ls=":", label="1e-3")
    ax[1].set_xlabel("iteration")
    ax[1].set_ylabel("|rel diff| vs uninterrupted")
    ax[1].legend()
    fig.tight_layout()
    png = os.path.join(out, "loss_curves.png")
    fig.savefig(png, dpi=100)

    report = {"targets": results, "save_at": K, "steps_after": N,
              "baseline": {"layout": f"tp={src[0]},pp={src[1]},dp={src[2]}", "loss": {str(k): v for k, v in base.items()}},
              "curves": {c: {str(k): v for k, v in v2.items()} for c, v2 in curves.items()},
              "plot": png, "seconds": time.time() - t_start}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = all(r["first_step_rel_diff"] <= 1e-4 and r["max_rel_loss_diff_vs_uninterrupted"] <= 1e-3 for r in results)
    print(f"[demo] wrote {out}/report.json and {png} in {time.time() - t_start:.0f} s; "
          f"{'PASS' if ok else 'FAIL'}: first step within 1e-4 relative and {N} steps within 1e-3", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
