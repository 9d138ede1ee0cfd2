"""Elastic resume: a node is lost mid-training, the job goes on at the world size that is left,
the node comes back, the job goes on at the full size again; the loss continues as if nothing
had happened.

    PYTHONPATH=. .venv/bin/python -m integration.megatron_deepspeed.elastic_demo --out elastic_out

1. Baseline: one uninterrupted run at tp=2,pp=2,dp=2 (8 ranks, mpirun) for STEPS iterations.
2. The elastic job: two torchrun agents of 4 workers each (two "nodes" on this machine, c10d
   rendezvous on localhost, --nnodes=1:2), each worker running the reference trainer with
   `--elastic --load ROOT --save ROOT` (DeepSpeed saves every SAVE_INTERVAL iterations): at every
   start the trainer picks its layout from the newest complete checkpoint and the world size the
   agent gave it (policy keep: tp=2,pp=2 stay, dp = world / 4), keeps the global batch by
   recomputing gradient accumulation, and reshards the checkpoint into the live engine.
3. Once step 8 is saved, the second node is killed (SIGKILL to its agent and workers). The
   surviving agent restarts its workers at world size 4 (tp=2,pp=2,dp=1, 4 accumulation steps).
4. Once step 16 is saved, a node joins again; the agent restarts at world size 8 (dp=2), which
   trains to the end.
5. Every logged loss is compared with the baseline's at the same step; writes OUT/report.json and
   OUT/elastic_loss.png (the loss across both restarts, and the relative difference).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Dict, List

from integration.megatron_deepspeed.launch import free_port, kill_tree, mpirun_module, torchrun_agent

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32", "--micro-batch", "2",
         "--global-batch", "8"]


class DemoError(RuntimeError):
    """The elastic job did not run as planned (an agent failed, a phase timed out)."""


def read_jsonl(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def latest_iteration(root: str) -> int:
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def baseline(out: str, steps: int, timeout: float) -> Dict[int, float]:
    log = os.path.join(out, "baseline.jsonl")
    if os.path.exists(log):
        os.unlink(log)
    r, cmd = mpirun_module("train", 2, 2, 2, ["--steps", str(steps), "--loss-log", log, "--quiet"] + MODEL, timeout)
    if r.returncode != 0:
        raise DemoError(f"baseline failed: {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return {s["step"]: s["loss"] for s in read_jsonl(log)}


def elastic_job(out: str, steps: int, save_interval: int, kill_after: int, rejoin_after: int,
                limit: float = 900) -> dict:
    """Runs the two-agent job with one node lost after step `kill_after` is saved and back after
    step `rejoin_after` is saved. Returns {"steps": the loss log, "agent_logs": {name: path},
    "events": [(seconds, what)]}. Raises DemoError when an agent fails or a phase exceeds `limit`."""
    root, log = os.path.join(out, "ckpt"), os.path.join(out, "loss.jsonl")
    if os.path.exists(log):
        os.unlink(log)
    args = ["--tp", "2", "--pp", "2", "--elastic", "--load", root, "--save", root, "--save-interval", str(save_interval),
            "--steps", str(steps), "--loss-log", log] + MODEL
    endpoint = f"127.0.0.1:{free_port()}"
    logs = {k: os.path.join(out, f"agent_{k}.log") for k in ("node0", "node1", "node1_back")}
    for p in logs.values():
        if os.path.exists(p):
            os.unlink(p)
    agents = []
    events = []
    t0 = time.time()

    def wait_for(cond, what):
        while not cond():
            failed = agents[0].poll() not in (None, 0)
            if failed or time.time() - t0 > limit:
                tail = open(logs["node0"], errors="replace").read()[-3000:]
                raise DemoError(f"{'node0 agent failed' if failed else 'timed out'} waiting for {what} after "
                                f"{time.time() - t0:.0f} s; last steps {read_jsonl(log)[-3:]}; node0 log tail:\n{tail}")
            time.sleep(0.5)
        events.append((round(time.time() - t0, 1), what))

    try:
        # The first agent hosts the rendezvous store; the second one is the node that dies.
        agents.append(torchrun_agent("train", 4, "1:2", endpoint, "elastic", args, logs["node0"]))
        time.sleep(2)
        agents.append(torchrun_agent("train", 4, "1:2", endpoint, "elastic", args, logs["node1"]))
        wait_for(lambda: latest_iteration(root) >= kill_after and
                 any(s["world_size"] == 8 and s["step"] > kill_after for s in read_jsonl(log)),
                 f"world size 8 past step {kill_after} with it saved")
        kill_tree(agents[1].pid, signal.SIGKILL)
        agents[1].wait()
        events.append((round(time.time() - t0, 1), "node1 killed (SIGKILL, agent and workers)"))
        wait_for(lambda: latest_iteration(root) >= rejoin_after and
                 any(s["world_size"] == 4 and s["step"] > rejoin_after for s in read_jsonl(log)),
                 f"world size 4 past step {rejoin_after} with it saved")
        agents.append(torchrun_agent("train", 4, "1:2", endpoint, "elastic", args, logs["node1_back"]))
        events.append((round(time.time() - t0, 1), "node1 back"))
        wait_for(lambda: agents[0].poll() is not None and agents[2].poll() is not None, "the job to finish")
    finally:
        for p in agents:
            if p.poll() is None:
                kill_tree(p.pid, signal.SIGKILL)
                p.wait()
    if agents[0].returncode != 0 or agents[2].returncode != 0:
        raise DemoError(f"agents exited {agents[0].returncode}, {agents[2].returncode}; see {logs}")
    return {"steps": read_jsonl(log), "agent_logs": logs, "events": events}


def compare(steps: List[dict], ref: Dict[int, float]) -> List[dict]:
    """Each logged step against the baseline's; marks the first step of each start."""
    rows = []
    for i, s in enumerate(steps):
        first = i == 0 or steps[i - 1]["start_iteration"] != s["start_iteration"] or \
            steps[i - 1]["world_size"] != s["world_size"]
        rows.append({**s, "first_after_start": first, "baseline": ref[s["step"]],
                     "rel_diff": abs(s["loss"] - ref[s["step"]]) / abs(ref[s["step"]])})
    return rows


def plot(rows: List[dict], ref: Dict[int, float], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = sorted(ref)
    ax[0].plot(xs, [ref[s] for s in xs], "k-", lw=2, label="uninterrupted, 8 ranks (tp=2,pp=2,dp=2)")
    segments = []
    for r in rows:
        if r["first_after_start"]:
            segments.append([])
        segments[-1].append(r)
    for seg in segments:
        lab = f"{seg[0]['world_size']} ranks ({seg[0]['layout']}), from step {seg[0]['start_iteration']}"
        ax[0].plot([r["step"] for r in seg], [r["loss"] for r in seg], "--", marker=".", label=lab)
        ax[1].semilogy([r["step"] for r in seg], [max(r["rel_diff"], 1e-12) for r in seg], marker=".", label=lab)
    for seg in segments[1:]:
        ax[0].axvline(seg[0]["start_iteration"], color="gray", ls=":")
    ax[0].set_xlabel("iteration")
    ax[0].set_ylabel("loss")
    ax[0].set_title("elastic job: a node lost, then back")
    ax[0].legend(fontsize=8)
    ax[1].axhline(1e-3, color="r", ls=":", label="1e-3")
    ax[1].set_xlabel("iteration")
    ax[1].set_ylabel("|rel diff| vs uninterrupted (1e-12 = equal)")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def run(out: str, steps: int = 36, save_interval: int = 4, kill_after: int = 8, rejoin_after: int = 16,
        timeout: float = 600) -> dict:
    """The whole demo; returns the report (also written to OUT/report.json)."""
    t_start = time.time()
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    import shutil
    shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)
    print(f"[elastic] baseline: 8 ranks, tp=2,pp=2,dp=2, {steps} iterations", flush=True)
    ref = baseline(out, steps, timeout)
    print(f"[elastic] elastic job: 2 torchrun agents x 4 workers; node1 killed after step {kill_after} is saved, "
          f"back after step {rejoin_after}", flush=True)
    job = elastic_job(out, steps, save_interval, kill_after, rejoin_after)
    rows = compare(job["steps"], ref)
    chose = []
    with open(job["agent_logs"]["node0"], errors="replace") as f:
        for line in f:
            if line.startswith("[elastic] "):
                chose.append(line[len("[elastic] "):].rstrip())
    starts = [r for r in rows if r["first_after_start"]]
    report = {
        "steps": steps, "save_interval": save_interval, "events": job["events"],
        "starts": [{k: r[k] for k in ("step", "start_iteration", "world_size", "layout", "micro_batch", "gas", "restart",
                                      "loss", "baseline", "rel_diff")} for r in starts],
        "layout_choices": chose,
        "max_rel_diff_first_steps": max(r["rel_diff"] for r in starts),
        "max_rel_diff": max(r["rel_diff"] for r in rows),
        "rows": rows, "agent_logs": job["agent_logs"], "plot": os.path.join(out, "elastic_loss.png"),
        "seconds": round(time.time() - t_start, 1),
    }
    plot(rows, ref, report["plot"])
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    for t, what in job["events"]:
        print(f"[elastic] {t:7.1f} s  {what}", flush=True)
    for c in chose:
        print(f"[elastic] trainer: {c}", flush=True)
    print(" start  world  layout           accumulation  first step  loss          uninterrupted  rel diff")
    for r in starts:
        print(f" {r['start_iteration']:5d}  {r['world_size']:5d}  {r['layout']:<15}  {r['gas']:12d}  {r['step']:10d}  "
              f"{r['loss']:.8f}  {r['baseline']:.8f}     {r['rel_diff']:.1e}")
    ok = report["max_rel_diff_first_steps"] <= 1e-4 and report["max_rel_diff"] <= 1e-3
    print(f"[elastic] wrote {out}/report.json and {report['plot']} in {report['seconds']:.0f} s; "
          f"{'PASS' if ok else 'FAIL'}: each first step after a start within 1e-4 relative of the uninterrupted run, "
          f"all {len(rows)} logged steps within 1e-3 (max {report['max_rel_diff']:.1e})", flush=True)
    report["ok"] = ok
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="elastic_out")
    p.add_argument("--steps", type=int, default=36)
    args = p.parse_args(argv)
    try:
        return 0 if run(args.out, steps=args.steps)["ok"] else 1
    except DemoError as e:
        print(f"[elastic] {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
