"""reshard's load benchmark: one run on one machine, reshard against the physical ceilings and its peers.

    scripts/bench.sh [--quick] [--size-gb 2] [--out bench_out] ...     (calls this file)

1. Writes a GPT-style checkpoint with optimizer state (bf16 weights, fp32 master, exp_avg,
   exp_avg_sq; ~14 bytes per parameter) under one source layout by (a) reshard's native format
   (`reshard synth`), (b) real DeepSpeed (the reference Megatron-DeepSpeed trainer of
   integration/megatron_deepspeed, saved after one training step so Adam's moments exist) where
   DeepSpeed runs,
   (c) PyTorch DCP (DTensor shards over gloo).
2. Measures the ceilings on the same files: read_ceiling (positioned reads from all cores into one
   preallocated buffer as large as the data; warm and cold), read_small_buffer (a small reused
   buffer, information only), memcpy_ceiling.
3. Loads under several target layouts: reshard (`reshard bench load` under mpirun -np K; from the
   native files, and from the DeepSpeed files when the reader can open them; system "reshard" is
   `--verify free`, "reshard_verify_full" the library's default `--verify full`), DCP's own load with
   resharding, DeepSpeed Universal Checkpointing (ds_to_universal + universal load; time to resume
   includes the conversion). A ZeRO-3 case (--zero3, default dp=4 -> dp=2, which DeepSpeed's own
   load refuses): the plain DeepSpeedEngine saves, reshard loads from its files, UCP converts and
   loads into a ZeRO-3 engine.
   Warm measurements run first, while the native files' pages are those their writer left in the
   page cache (2 MiB folios where the filesystem has large folios: a restart right after a save);
   cold ones last (each evicts the files first). `reshard_pread_pages` is one warm load after the
   cold read ceiling brought the pages back through pread (small folios, more to map), for
   information.
4. Writes OUT/results.json (a list of entries), OUT/results.md, OUT/*.png, OUT/meta.json.

Measurements only: nothing here asserts a time. GB = 10^9 bytes, GiB = 2^30 bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)  # integration.megatron_deepspeed.launch

from gpt_shapes import GPT, parse_layout, short_layout, size_model  # noqa: E402
from integration.megatron_deepspeed.launch import cleanup_shm  # noqa: E402

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun(np_: int):
    return ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(np_), "--bind-to", "none"]


class Runner:
    def __init__(self, out: str, verbose: bool):
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.verbose = verbose
        self.n = 0

    def run(self, cmd, name, env=None, timeout=1800, check=True):
        """Runs cmd; returns (rc, stdout, seconds). Logs go to OUT/logs/NN-name.{out,err}."""
        self.n += 1
        base = os.path.join(self.logs, f"{self.n:02d}-{name}")
        full_env = dict(os.environ)
        full_env.update(env or {})
        t0 = time.perf_counter()
        with open(base + ".err", "w") as err:
            err.write(" ".join(cmd) + "\n")
            err.flush()
            try:
                p = subprocess.run(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True,
                                   timeout=timeout)
            finally:
                # DeepSpeed's CPU allreduce buffers (69 MB per rank) outlive the job in /dev/shm.
                if (env or {}).get("MASTER_PORT"):
                    cleanup_shm(int(env["MASTER_PORT"]))
        dt = time.perf_counter() - t0
        with open(base + ".out", "w") as f:
            f.write(p.stdout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {p.returncode}); see {base}.err:\n" + tail(base + ".err"))
        return p.returncode, p.stdout, dt


def tail(path, n=15):
    try:
        with open(path) as f:
            lines = [l.rstrip() for l in f if l.strip() and "it/s]" not in l]
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def files_under(d):
    out = []
    for dp, _, fns in os.walk(d):
        for f in sorted(fns):
            p = os.path.join(dp, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return sorted(out)


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info():
    info = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                            text=True).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--", "csrc", "include"], cwd=REPO,
                                                capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def have_deepspeed() -> str:
    """'' when DeepSpeed imports (on the CPU accelerator), else the reason."""
    r = subprocess.run([PY, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True, text=True,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"), cwd=REPO)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import deepspeed failed"])[-1]


# ------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, a):
        self.a = a
        self.out = os.path.abspath(a.out)
        self.data = os.path.abspath(a.data or os.path.join(self.out, "data"))
        self.r = Runner(self.out, a.verbose)
        self.bin = os.path.abspath(a.reshard_bin)
        self.entries = []
        self.skipped = []  # {"what", "why"}
        self.info = {}
        cores = os.cpu_count() or 1
        self.cores = cores
        self.zero3_source, _, self.zero3_target = (a.zero3 or "").partition("->")

    # -- helpers ---------------------------------------------------------------------------------
    def env_for(self, ranks):
        return {"OMP_NUM_THREADS": str(max(1, self.cores // max(1, ranks))), "DS_ACCELERATOR": "cpu",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def add(self, **e):
        self.entries.append(e)
        return e

    def skip(self, what, why):
        self.skipped.append({"what": what, "why": why})

    # -- 1. checkpoints --------------------------------------------------------------------------
    def make_model(self):
        mult = 1
        for lay in [self.a.source] + self.a.targets:
            mult = math.lcm(mult, parse_layout(lay)["pp"] * parse_layout(lay)["vpp"])
        self.model = size_model(self.a.size_gb * 1e9, mult)
        os.makedirs(self.data, exist_ok=True)
        self.model_yaml = os.path.join(self.data, "bench-gpt.yaml")
        with open(self.model_yaml, "w") as f:
            f.write(self.model.yaml())
        self.model_json = os.path.join(self.data, "bench-gpt.json")
        with open(self.model_json, "w") as f:
            f.write(self.model.to_json())
        self.info["model"] = dict(json.loads(self.model.to_json()), params=self.model.params(),
                                  state_bytes=self.model.state_bytes())
        # The checkpoints written at once (native, DCP, DeepSpeed, its Universal conversion) took
        # about 3x the state bytes; a full disk stalled a run here (a rank's MPI
        # start-up never returned), so too little space is refused before anything is written.
        need = int(3.2 * self.model.state_bytes())
        free = shutil.disk_usage(self.data).free
        if free < need:
            raise SystemExit(f"[bench] {self.data}: {free / 1e9:.1f} GB free, the checkpoints need about "
                             f"{need / 1e9:.1f} GB; free space there, choose another --out, or a smaller --size-gb")

    def synth_native(self):
        self.native = os.path.join(self.data, "native")
        shutil.rmtree(self.native, ignore_errors=True)
        _, _, dt = self.r.run([self.bin, "synth", self.native, "--model", self.model_yaml, "--layout", self.a.source,
                               "--seed", "7"], "synth-native")
        self.info["write_seconds"] = {"native": dt}

    def save_dcp(self):
        src = parse_layout(self.a.source)
        self.dcp = os.path.join(self.data, "dcp")
        shutil.rmtree(self.dcp, ignore_errors=True)
        _, out, dt = self.r.run(mpirun(src["world"]) + [PY, os.path.join(HERE, "dcp_worker.py"), "save", self.dcp,
                                                         "--model-json", self.model_json, "--layout", self.a.source],
                                "save-dcp", env=self.env_for(src["world"]))
        self.info["write_seconds"]["dcp"] = dt

    def ds_save(self, layout, name):
        """Saves the benchmark model with the reference trainer at `layout` into DATA/name after one
        step (ZeRO-2/3: the plain DeepSpeedEngine on GPTModel, else the PipelineEngine); returns
        (root, tag)."""
        src = parse_layout(layout)
        root = os.path.join(self.data, name)
        shutil.rmtree(root, ignore_errors=True)
        plain = ["--no-pipeline"] if src["zero"] >= 2 else []
        cmd = mpirun(src["world"]) + [
            PY, "-m", "integration.megatron_deepspeed.train"] + plain + [
            "--tp", str(src["tp"]), "--pp", str(src["pp"]), "--dp", str(src["dp"]), "--zero", str(max(1, src["zero"])),
            "--steps", "1", "--save", root, "--quiet", "--micro-batch", "1", "--global-batch", str(src["dp"])
        ] + self.model.trainer_flags()
        _, _, dt = self.r.run(cmd, "save-" + name.replace("_", "-"), env=self.env_for(src["world"]))
        self.info["write_seconds"][name] = dt
        with open(os.path.join(root, "latest")) as f:
            return root, f.read().strip()

    def save_deepspeed(self):
        self.ds, self.ds_tag = self.ds_save(self.a.source, "deepspeed")

    def save_deepspeed_zero3(self):
        """The ZeRO-3 case: the plain DeepSpeedEngine (GPTModel) at the --zero3 source layout."""
        self.ds3, self.ds3_tag = self.ds_save(self.zero3_source, "deepspeed_zero3")
        self.ds3_ok = True

    def data_files(self, fmt):
        if fmt == "deepspeed-zero3":
            return [p for p in files_under(os.path.join(self.ds3, self.ds3_tag)) if os.path.getsize(p) > 0]
        if fmt == "native":
            with open(os.path.join(self.native, "latest")) as f:
                d = os.path.join(self.native, f.read().strip())
        elif fmt == "dcp":
            d = self.dcp
        else:
            d = os.path.join(self.ds, self.ds_tag)
        return [p for p in files_under(d) if os.path.getsize(p) > 0]

    # -- 2. ceilings -----------------------------------------------------------------------------
    def ceilings(self, fmt, caches):
        files = self.data_files(fmt)
        for cache in caches:
            cmd = [self.bin, "bench", "read-ceiling", "--repeat", str(self.a.repeat if cache == "warm" else 1)]
            if cache == "cold":
                cmd.append("--cold")
            else:  # one untimed pass to warm the cache
                self.r.run([self.bin, "bench", "read-ceiling", "--small-buffer"] + files, f"warm-{fmt}")
            _, out, _ = self.r.run(cmd + files, f"read-ceiling-{cache}-{fmt}")
            j = json_lines(out)[-1]
            self.add(system="read_ceiling", case=f"{cache} {fmt} files", cache=cache, source_format=fmt,
                     seconds=j["seconds"], gbps=j["gbps"], bytes=j["bytes"], read_amplification=1.0,
                     peak_rss_bytes=j["peak_rss_bytes"], threads=j["threads"], seconds_all=j["seconds_all"],
                     resident_fraction_after_evict=j.get("resident_fraction_after_evict"))
        if fmt == "native" and "warm" in caches:
            _, out, _ = self.r.run([self.bin, "bench", "read-ceiling", "--small-buffer", "--repeat",
                                    str(self.a.repeat)] + files, f"read-small-{fmt}")
            j = json_lines(out)[-1]
            self.add(system="read_small_buffer", case=f"warm {fmt} files", cache="warm", source_format=fmt,
                     seconds=j["seconds"], gbps=j["gbps"], bytes=j["bytes"], read_amplification=1.0,
                     peak_rss_bytes=j["peak_rss_bytes"], threads=j["threads"], seconds_all=j["seconds_all"],
                     note="information only: skips the write into memory")

    def adjacent_ceiling(self, fmt):
        """The warm read ceiling of `fmt`'s files measured right before a load (3 repeats, median):
        this VM's memory bandwidth drifts by tens of percent over minutes, so a load's ratio to the
        ceiling is taken against a ceiling measured seconds, not minutes, away."""
        if self.a.no_adjacent_ceiling:
            return None
        _, out, _ = self.r.run([self.bin, "bench", "read-ceiling", "--repeat", "3"] + self.data_files(fmt),
                               f"read-ceiling-adjacent-{fmt}")
        return json_lines(out)[-1]["gbps"]

    def memcpy(self):
        nbytes = max(256 << 20, min(int(self.model.state_bytes()), 2 << 30))
        _, out, _ = self.r.run([self.bin, "bench", "memcpy", "--bytes", str(nbytes), "--repeat", "5"], "memcpy")
        j = json_lines(out)[-1]
        self.add(system="memcpy_ceiling", case=f"memcpy {nbytes / 1e9:.2f} GB, {j['threads']} threads", cache="n/a",
                 seconds=j["seconds"], gbps=j["gbps"], bytes=j["bytes"], read_amplification=None,
                 peak_rss_bytes=j["peak_rss_bytes"], threads=j["threads"], seconds_all=j["seconds_all"])

    # -- 3. loads --------------------------------------------------------------------------------
    def reshard_load(self, fmt, path, target, cache, system="reshard", extra=(), repeat=None, source=None):
        K = parse_layout(target)["world"]
        source = source or self.a.source
        repeat = repeat or (self.a.repeat if cache == "warm" else self.a.cold_repeat)
        cmd = mpirun(K) + [self.bin, "bench", "load", path, "--target", target, "--repeat", str(repeat),
                           "--memory-budget", self.a.memory_budget] + list(extra)
        if "--verify" not in extra:  # "reshard", nodedup, one-read-per-job: the fast mode, named
            cmd += ["--verify", "free"]  # (the library's default, "full", is the reshard_verify_full row)
        if fmt.startswith("deepspeed"):
            cmd += ["--model", self.model_yaml]
        if cache == "cold":
            cmd.append("--cold")
        else:  # warm the cache (an untimed load)
            cmd[cmd.index("--repeat") + 1] = str(repeat + 1)
        adjacent = self.adjacent_ceiling(fmt) if cache == "warm" else None
        _, out, _ = self.r.run(cmd, f"{system}-{cache}-{fmt}-{short_layout(target)}", env=self.env_for(K))
        runs = json_lines(out)
        if cache == "warm":
            runs = runs[1:]
        secs = [j["seconds"] for j in runs]
        m = runs[0]
        e = self.add(system=system, case=f"{cache} {fmt} {short_layout(source)}->{short_layout(target)}",
                     cache=cache, source_format=fmt, source_layout=source, target_layout=target, ranks=K,
                     seconds=median(secs), seconds_all=secs, gbps=m["target_bytes"] / median(secs) / 1e9,
                     target_bytes=m["target_bytes"], bytes_read=m["bytes_read"], bytes_needed=m["bytes_needed"],
                     read_amplification=m["read_amplification"],
                     read_amplification_copies=m.get("read_amplification_copies"),
                     bytes_reread_on_node=m.get("bytes_reread_on_node", 0), bytes_exchanged=m["bytes_exchanged"],
                     plan_seconds=median([j["plan_seconds"] for j in runs]), waves=m["waves"],
                     peak_rss_bytes=max(j["peak_rss_bytes"] for j in runs),
                     rss_above_live_bytes=max(j["rss_above_live_bytes"] for j in runs),
                     live_bytes_max_rank=m["live_bytes_max_rank"], peak_staging_bytes=m["peak_staging_bytes"],
                     memory_budget_bytes=m["memory_budget_bytes"], dedup=m["dedup"], verify=m["verify"],
                     bytes_verified=m.get("bytes_verified"), verify_bytes_read=m.get("verify_bytes_read"),
                     checked_as_read=(m["bytes_verified"] / (m["bytes_read"] - m.get("bytes_reread_on_node", 0)))
                     if m.get("bytes_read") else None,
                     io_threads=m["io_threads"], change=m["change"], read_ceiling_adjacent_gbps=adjacent)
        if cache == "cold":
            e["resident_fraction_after_evict"] = max(j.get("resident_fraction_after_evict", -1) for j in runs)
        # Where the time goes: the executor's phases, max over ranks, of the median repeat.
        mid = min(runs, key=lambda j: abs(j["seconds"] - e["seconds"]))
        e["breakdown"] = {"seconds": mid["seconds"], "open_seconds": mid.get("open_seconds_max_rank"),
                          "load_seconds": mid.get("load_seconds"), "plan_seconds": mid["plan_seconds"],
                          "read_seconds": mid["read_seconds_max_rank"],
                          "copy_seconds": mid.get("copy_seconds_max_rank", 0.0),
                          "preflight_seconds": mid.get("preflight_seconds_max_rank", 0.0),
                          "exchange_seconds": mid["exchange_seconds_max_rank"],
                          "scatter_seconds": mid["scatter_seconds_max_rank"], "waves": mid["waves"],
                          "bytes_read_max_rank": mid["bytes_read_max_rank"],
                          "bytes_sent_max_rank": mid["bytes_sent_max_rank"]}
        return e

    def dcp_load(self, target, cache, loader="dcp"):
        """dcp.load of the DCP files into DTensors at `target`, or (loader "reshard") reshard's
        load_state_dict of the same files into the same DTensors."""
        system = "dcp" if loader == "dcp" else "reshard_from_dcp"
        t = parse_layout(target)
        if t["pp"] != 1:
            self.skip(f"{system} {cache} {short_layout(target)}", "DCP peer expresses tp and dp only (pp=1)")
            return
        K = t["world"]
        repeat = self.a.peer_repeat if cache == "warm" else 1
        cmd = mpirun(K) + [PY, os.path.join(HERE, "dcp_worker.py"), "load", self.dcp, "--model-json", self.model_json,
                           "--layout", target, "--repeat", str(repeat), "--reshard-bin", self.bin, "--loader", loader]
        if cache == "cold":
            cmd.append("--cold")
        adjacent = self.adjacent_ceiling("dcp") if cache == "warm" else None
        _, out, _ = self.r.run(cmd, f"{system}-{cache}-{short_layout(target)}", env=self.env_for(K))
        j = json_lines(out)[-1]
        e = self.add(system=system, case=f"{cache} {system} {short_layout(self.a.source)}->{short_layout(target)}",
                     cache=cache, source_format="dcp", source_layout=self.a.source, target_layout=target, ranks=K,
                     seconds=j["seconds"], seconds_all=j["seconds_all"], gbps=j["target_bytes"] / j["seconds"] / 1e9,
                     target_bytes=j["target_bytes"], bytes_read=j.get("bytes_read"),
                     bytes_needed=self.model.state_bytes(),
                     read_amplification=(j["bytes_read"] / self.model.state_bytes()) if j.get("bytes_read") else None,
                     bytes_exchanged=0, plan_seconds=None, peak_rss_bytes=j["peak_rss_bytes"],
                     rss_above_live_bytes=j["rss_above_live_bytes"], live_bytes_max_rank=j["live_bytes_max_rank"],
                     read_ceiling_adjacent_gbps=adjacent)
        if cache == "cold":
            e["resident_fraction_after_evict"] = j.get("resident_fraction_after_evict")

    def ucp_convert(self, root=None, tag=None, key="ucp_convert_seconds"):
        root, tag = root or self.ds, tag or self.ds_tag
        uni_tag = tag + "_universal"
        out = os.path.join(root, uni_tag)
        shutil.rmtree(out, ignore_errors=True)
        workers = str(max(1, self.cores))
        _, _, dt = self.r.run([PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               os.path.join(root, tag), "--output_folder", out, "--num_extract_workers",
                               workers, "--num_merge_workers", workers], key.replace("_seconds", "").replace("_", "-"),
                              env=self.env_for(1))
        with open(os.path.join(root, "latest_universal"), "w") as f:
            f.write(uni_tag)
        setattr(self, key, dt)
        self.info[key] = dt
        self.info[key.replace("_seconds", "_universal_bytes")] = sum(os.path.getsize(p) for p in files_under(out))

    def ucp_load(self, target, root=None, convert_seconds=None, source=None, fmt="deepspeed"):
        K = parse_layout(target)["world"]
        root = root or self.ds
        source = source or self.a.source
        convert_seconds = self.ucp_convert_seconds if convert_seconds is None else convert_seconds
        cmd = mpirun(K) + [PY, "-m", "benchmarks.ds_worker", root, "--target", target] + self.model.trainer_flags()
        _, out, _ = self.r.run(cmd, f"ucp-load-{short_layout(target)}", env=self.env_for(K))
        j = json_lines(out)[-1]
        total = convert_seconds + j["seconds"]
        self.add(system="ucp", case=f"warm {fmt} {short_layout(source)}->{short_layout(target)}",
                 cache="warm", source_format=fmt, source_layout=source, target_layout=target, ranks=K,
                 seconds=total, conversion_seconds=convert_seconds, load_seconds=j["seconds"],
                 gbps=j["target_bytes"] / total / 1e9, target_bytes=j["target_bytes"], bytes_read=j.get("bytes_read"),
                 bytes_needed=self.model.state_bytes(),
                 read_amplification=(j["bytes_read"] / self.model.state_bytes()) if j.get("bytes_read") else None,
                 bytes_exchanged=None, plan_seconds=None, peak_rss_bytes=j["peak_rss_bytes"],
                 rss_above_live_bytes=j["rss_above_live_bytes"], live_bytes_max_rank=j["live_bytes_max_rank"],
                 note="time to resume = ds_to_universal conversion + universal load")

    def plan_bench(self):
        pb = self.a.plan_bench
        if not pb or not os.path.exists(pb):
            self.skip("plan_bench", f"{pb} not built (needs libbenchmark-dev)")
            return
        _, out, _ = self.r.run([pb, "--benchmark_filter=gpt3_175b", "--benchmark_format=json"], "plan-bench")
        b = json.loads(out)["benchmarks"][0]
        unit = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}[b.get("time_unit", "ms")]
        self.add(system="reshard_plan", case="plan gpt3-175b tp8pp16dp8z1->tp4pp8dp32z1 (1024 ranks)", cache="n/a",
                 seconds=b["real_time"] * unit, gbps=None, read_amplification=None, peak_rss_bytes=None,
                 fragments=b.get("fragments"), waves=b.get("waves"), ranks=1024,
                 note="build/bin/plan_bench: both layouts and the whole job's plan, one process")

    # -- 4. ratios and output --------------------------------------------------------------------
    def ratios(self):
        ceil = {(e["cache"], e["source_format"]): e for e in self.entries if e["system"] == "read_ceiling"}
        memcpy = next((e for e in self.entries if e["system"] == "memcpy_ceiling"), None)
        by = {}
        for e in self.entries:
            if "target_layout" in e:
                by.setdefault((e["system"], e["cache"], e["target_layout"]), e)
        for e in self.entries:
            if "target_layout" not in e:
                continue
            c = ceil.get((e["cache"], e["source_format"]))
            need = e.get("bytes_needed") or 0
            # The ceiling measured right before this load where there is one, else the run's.
            cgbps = e.get("read_ceiling_adjacent_gbps") or (c["gbps"] if c else None)
            if cgbps and need and e["seconds"]:
                # Fraction of the read ceiling for the same bytes: time the ceiling takes to read the
                # bytes this load needs (each stored byte once), over this load's time.
                e["x_read_ceiling"] = (need / (cgbps * 1e9)) / e["seconds"]
                # The same against the bytes the load writes (GB/s of target state over the
                # ceiling's GB/s): a target that replicates state over dp or pipeline stages writes
                # more bytes than the files hold (tied embeddings on two stages, 16-bit weights on
                # every dp rank).
                if e.get("target_bytes"):
                    e["x_read_ceiling_target"] = (e["target_bytes"] / (cgbps * 1e9)) / e["seconds"]
            if memcpy and e.get("target_bytes"):
                e["x_memcpy_ceiling"] = (e["target_bytes"] / (memcpy["gbps"] * 1e9)) / e["seconds"]
            for peer in ("dcp", "ucp"):
                p = by.get((peer, e["cache"], e["target_layout"])) or (by.get((peer, "warm", e["target_layout"]))
                                                                       if peer == "ucp" else None)
                if p is not None and p is not e:
                    e[f"speedup_vs_{peer}"] = p["seconds"] / e["seconds"]
            if e["system"] != "reshard":
                r = by.get(("reshard", e["cache"], e["target_layout"]))
                if r is not None:
                    e["reshard_speedup"] = e["seconds"] / r["seconds"]

    def write(self, t_start):
        self.ratios()
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(self.entries, f, indent=1)
        self.info.update(skipped=self.skipped, total_seconds=time.time() - t_start, loadavg_end=loadavg(),
                         command=" ".join(["scripts/bench.sh"] + self.a.argv), finished=datetime.datetime.now()
                         .astimezone().isoformat(timespec="seconds"))
        with open(os.path.join(self.out, "meta.json"), "w") as f:
            json.dump(self.info, f, indent=1)
        md = markdown(self.entries, self.info)
        with open(os.path.join(self.out, "results.md"), "w") as f:
            f.write(md)
        try:
            plots(self.entries, self.out)
        except Exception as ex:  # plots are a convenience; the numbers are in results.json
            print(f"[bench] plots failed: {ex}", file=sys.stderr)
        return md

    # -- the run ---------------------------------------------------------------------------------
    def steps(self):
        a = self.a
        S = [("model", self.make_model), ("synth native checkpoint", self.synth_native)]
        if not a.skip_dcp:
            S.append(("DCP save", self.save_dcp))
        self.ds_ok = False
        if not a.skip_deepspeed:
            why = have_deepspeed()
            if why:
                self.skip("deepspeed", why)
            else:
                S.append(("DeepSpeed save", self._ds_save_guarded))
        # The checkpoints were just written: flush their dirty pages so that writeback does not run
        # (and take a core) during the timed loads that follow.
        S.append(("flush written checkpoints (sync)", os.sync))
        S.append(("memcpy ceiling", self.memcpy))
        # Warm loads first, while the native files' pages are the ones their writer left in the page
        # cache (as on a restart right after a save): a cold measurement evicts them, and the reads
        # that bring them back decide the page-cache folio size, which decides what mapping them
        # costs (docs/design.md, window-aligned writes). The cold measurements come last.
        S.append(("read ceilings warm (native)", lambda: self.ceilings("native", ["warm"])))
        if not a.skip_dcp:
            S.append(("read ceilings warm (dcp)", lambda: self.ceilings("dcp", ["warm"])))
        for i, t in enumerate(a.targets):
            S.append((f"reshard warm {short_layout(t)}", lambda t=t: self._guard(
                f"reshard warm {short_layout(t)}", lambda: self.reshard_load("native", self.native, t, "warm"))))
            if i == 0 or not a.quick:  # other settings: every target, or the first with --quick
                S.append((f"reshard_nodedup warm {short_layout(t)}", lambda t=t: self._guard(
                    f"reshard_nodedup warm {short_layout(t)}",
                    lambda: self.reshard_load("native", self.native, t, "warm", "reshard_nodedup", ["--no-dedup"]))))
                S.append((f"reshard_one_read_per_job warm {short_layout(t)}", lambda t=t: self._guard(
                    f"reshard_one_read_per_job warm {short_layout(t)}",
                    lambda: self.reshard_load("native", self.native, t, "warm", "reshard_one_read_per_job",
                                              ["--one-read-per-job"]))))
                S.append((f"reshard_verify_off warm {short_layout(t)}", lambda t=t: self._guard(
                    f"reshard_verify_off warm {short_layout(t)}",
                    lambda: self.reshard_load("native", self.native, t, "warm", "reshard_verify_off",
                                              ["--verify", "off"]))))
                S.append((f"reshard_verify_full warm {short_layout(t)}", lambda t=t: self._guard(
                    f"reshard_verify_full warm {short_layout(t)}",
                    lambda: self.reshard_load("native", self.native, t, "warm", "reshard_verify_full",
                                              ["--verify", "full"]))))
            if not a.skip_dcp:
                S.append((f"dcp warm {short_layout(t)}",
                          lambda t=t: self._guard(f"dcp warm {short_layout(t)}", lambda: self.dcp_load(t, "warm"))))
                S.append((f"reshard_from_dcp warm {short_layout(t)}", lambda t=t: self._guard(
                    f"reshard_from_dcp warm {short_layout(t)}", lambda: self.dcp_load(t, "warm", "reshard"))))
        if not a.skip_deepspeed:
            S.append(("read ceilings (deepspeed)", lambda: self._if_ds(lambda: self.ceilings("deepspeed", ["warm"]))))
            for i, t in enumerate(a.targets):
                S.append((f"reshard warm deepspeed {short_layout(t)}", lambda t=t: self._if_ds(
                    lambda: self._guard(f"reshard from deepspeed files {short_layout(t)}",
                                        lambda: self.reshard_load("deepspeed", self.ds, t, "warm")))))
                if i == 0 or not a.quick:
                    S.append((f"reshard_verify_full warm deepspeed {short_layout(t)}", lambda t=t: self._if_ds(
                        lambda: self._guard(f"reshard_verify_full from deepspeed files {short_layout(t)}",
                                            lambda: self.reshard_load("deepspeed", self.ds, t, "warm",
                                                                      "reshard_verify_full", ["--verify", "full"])))))
            S.append(("UCP conversion", lambda: self._if_ds(lambda: self._guard("ucp conversion", self.ucp_convert))))
            for t in a.targets[:a.ucp_targets]:
                S.append((f"UCP load {short_layout(t)}", lambda t=t: self._if_ds(lambda: self._guard(
                    f"ucp load {short_layout(t)}", lambda: self.ucp_load(t)) if hasattr(self, "ucp_convert_seconds")
                    else None)))
            if self.zero3_source:  # ZeRO-3 (DeepSpeed's FSDP) at another dp: reshard beside UCP
                t3 = self.zero3_target
                S.append(("DeepSpeed ZeRO-3 save", lambda: self._if_ds(lambda: self._guard(
                    "deepspeed zero3 save", self.save_deepspeed_zero3))))
                S.append(("read ceilings (deepspeed ZeRO-3)", lambda: self._if_ds3(
                    lambda: self.ceilings("deepspeed-zero3", ["warm"]))))
                S.append((f"reshard warm deepspeed ZeRO-3 {short_layout(t3)}", lambda: self._if_ds3(lambda: self._guard(
                    f"reshard from deepspeed zero3 files {short_layout(t3)}", lambda: self.reshard_load(
                        "deepspeed-zero3", self.ds3, t3, "warm", source=self.zero3_source)))))
                S.append((f"reshard_verify_full warm deepspeed ZeRO-3 {short_layout(t3)}", lambda: self._if_ds3(
                    lambda: self._guard(f"reshard_verify_full from deepspeed zero3 files {short_layout(t3)}",
                                        lambda: self.reshard_load("deepspeed-zero3", self.ds3, t3, "warm",
                                                                  "reshard_verify_full", ["--verify", "full"],
                                                                  source=self.zero3_source)))))
                S.append(("UCP ZeRO-3 conversion", lambda: self._if_ds3(lambda: self._guard(
                    "ucp zero3 conversion", lambda: self.ucp_convert(self.ds3, self.ds3_tag, "ucp_zero3_convert_seconds")))))
                S.append((f"UCP ZeRO-3 load {short_layout(t3)}", lambda: self._if_ds3(lambda: self._guard(
                    f"ucp zero3 load {short_layout(t3)}", lambda: self.ucp_load(
                        t3, self.ds3, self.ucp_zero3_convert_seconds, self.zero3_source, "deepspeed-zero3"))
                    if hasattr(self, "ucp_zero3_convert_seconds") else None)))
        # Cold: each measurement evicts the files' pages first.
        S.append(("read ceilings cold (native)", lambda: self.ceilings("native", ["cold"])))
        # The cold read ceiling brought the native files back through pread's read-ahead (small
        # folios): one warm load of the first target from that page cache, for information.
        t0 = a.targets[0]
        S.append((f"reshard warm, pages from pread {short_layout(t0)}", lambda: self._guard(
            f"reshard warm (pages from pread) {short_layout(t0)}",
            lambda: self.reshard_load("native", self.native, t0, "warm", "reshard_pread_pages"))))
        if not a.skip_dcp:
            S.append(("read ceilings cold (dcp)", lambda: self.ceilings("dcp", ["cold"])))
        for i, t in enumerate(a.targets):
            S.append((f"reshard cold {short_layout(t)}", lambda t=t: self._guard(
                f"reshard cold {short_layout(t)}", lambda: self.reshard_load("native", self.native, t, "cold"))))
            if not a.skip_dcp and (i == 0 or not a.quick):
                S.append((f"dcp cold {short_layout(t)}",
                          lambda t=t: self._guard(f"dcp cold {short_layout(t)}", lambda: self.dcp_load(t, "cold"))))
        S.append(("plan_bench", lambda: self._guard("plan_bench", self.plan_bench)))
        return S

    def _guard(self, what, fn):
        try:
            return fn()
        except Exception as ex:  # a peer that fails is reported, not fatal
            self.skip(what, str(ex)[-1500:])
            print(f"[bench] {what}: skipped ({str(ex).splitlines()[0]})", file=sys.stderr)

    def _ds_save_guarded(self):
        try:
            self.save_deepspeed()
            self.ds_ok = True
        except Exception as ex:
            self.skip("deepspeed save", str(ex)[-1500:])
            print(f"[bench] DeepSpeed save failed; DeepSpeed cases skipped", file=sys.stderr)

    def _if_ds(self, fn):
        if self.ds_ok:
            return fn()

    def _if_ds3(self, fn):
        if getattr(self, "ds3_ok", False):
            return fn()

    def run(self):
        t_start = time.time()
        self.info.update(machine=machine_info(), loadavg_start=loadavg(), source_layout=self.a.source,
                         targets=self.a.targets, memory_budget=self.a.memory_budget, repeat=self.a.repeat,
                         started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
        S = self.steps()
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(S), desc="bench", unit="step", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
        self.info["step_seconds"] = {}
        for name, fn in S:
            t0 = time.perf_counter()
            if bar is not None:
                bar.set_postfix_str(name)
            else:
                print(f"[bench] {name}", file=sys.stderr)
            fn()
            self.info["step_seconds"][name] = round(time.perf_counter() - t0, 2)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        md = self.write(t_start)
        if not self.a.keep_data:
            shutil.rmtree(self.data, ignore_errors=True)
        print(md)


# ------------------------------------------------------------------------------------------------
def fmt(v, spec):
    return "" if v is None else format(v, spec)


def checksummed(e):
    """What the load checked against stored checksums: the fraction of the bytes it read that it
    checked as it read them (verify=free); for verify=full, every unit it touches, read whole in a
    pass before any write (the GB of that pass)."""
    if e.get("checked_as_read") is None:
        return ""
    if e.get("verify") == "full":
        return f"all units touched ({e['verify_bytes_read'] / 1e9:.2f} GB read first)"
    return f"{e['checked_as_read']:.2f}"


def markdown(entries, info):
    m = info.get("machine", {})
    lines = [f"# reshard load benchmark", "",
             f"- command: `{info.get('command')}`", f"- date: {info.get('started')} .. {info.get('finished')}",
             f"- machine: {m.get('cores')} cores ({m.get('cpu', '?')}), {m.get('mem_total_gib')} GiB, "
             f"{m.get('platform')}; git {m.get('git_commit')}{' (dirty)' if m.get('git_dirty') else ''}",
             f"- load average at start / end: {info.get('loadavg_start')} / {info.get('loadavg_end')}",
             f"- model: {info.get('model')}",
             f"- source layout {info.get('source_layout')}; memory budget {info.get('memory_budget')} per rank; "
             f"median of {info.get('repeat')} warm repeats", ""]
    lines += ["| system | case | ranks | seconds | GB/s | x read ceiling | x ceiling GB/s | read amp. | exchanged GB | "
              "plan s | peak RSS GiB | RSS above live GiB | vs dcp | vs ucp | checksummed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append("| " + " | ".join([
            e["system"], e["case"], fmt(e.get("ranks"), "d"), fmt(e.get("seconds"), ".3f"), fmt(e.get("gbps"), ".2f"),
            fmt(e.get("x_read_ceiling"), ".2f"), fmt(e.get("x_read_ceiling_target"), ".2f"),
            fmt(e.get("read_amplification"), ".2f"),
            fmt(e["bytes_exchanged"] / 1e9 if e.get("bytes_exchanged") is not None else None, ".3f"),
            fmt(e.get("plan_seconds"), ".4f"),
            fmt(e["peak_rss_bytes"] / 2**30 if e.get("peak_rss_bytes") else None, ".2f"),
            fmt(e["rss_above_live_bytes"] / 2**30 if e.get("rss_above_live_bytes") is not None else None, ".2f"),
            fmt(e.get("speedup_vs_dcp"), ".1f"), fmt(e.get("speedup_vs_ucp"), ".1f"), checksummed(e)]) + " |")
    bds = [e for e in entries if e.get("breakdown")]
    if bds:
        lines += ["", "reshard loads, where the time goes (executor phases, max over ranks, median repeat; pre-flight = "
                  "checks before any write (plan agreement, files, the verify=full checksum pass, replica "
                  "comparisons); read = checksum checks + packing what other ranks get; copy = local copies into "
                  "live tensors; exchange = all-to-all-v and group broadcasts; scatter = unpacking what was "
                  "received):", "",
                  "| system | case | total s | plan s | pre-flight s | read s | copy s | exchange s | scatter s | waves |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in bds:
            b = e["breakdown"]
            lines.append(f"| {e['system']} | {e['case']} | {b['seconds']:.3f} | {b['plan_seconds']:.4f} | "
                         f"{b.get('preflight_seconds', 0.0):.3f} | "
                         f"{b['read_seconds']:.3f} | {b.get('copy_seconds', 0.0):.3f} | {b['exchange_seconds']:.3f} | "
                         f"{b['scatter_seconds']:.3f} | {b['waves']} |")
    ucp = [e for e in entries if e["system"] == "ucp"]
    if ucp:
        lines += ["", "UCP time to resume = conversion + load: " + "; ".join(
            f"{e['case']}: {e['conversion_seconds']:.1f} s + {e['load_seconds']:.1f} s" for e in ucp)]
    if info.get("skipped"):
        lines += ["", "Skipped or failed:", ""]
        for s in info["skipped"]:
            lines.append(f"- {s['what']}: {s['why'].strip().splitlines()[-1][:300] if s['why'].strip() else ''}")
    lines += ["", "read amp. = bytes read from storage / bytes needed: a second rank of the same machine copying "
              "the same bytes out of the shared page cache is not a storage read (reshard: "
              "read_amplification_copies in results.json counts every copy out of a file)."]
    lines += ["", "GB = 10^9 bytes, GiB = 2^30 bytes. GB/s = bytes of target state / seconds. x read ceiling = "
              "(bytes needed / read-ceiling GB/s of the same files and cache, measured right before the load when "
              "warm) / seconds; x ceiling GB/s = this entry's GB/s / that ceiling's GB/s (counts the bytes the "
              "target holds, which exceed the files' where it replicates state). vs dcp / vs ucp = the "
              "peer's seconds / this entry's seconds (same target layout and cache; UCP includes its conversion).", ""]
    return "\n".join(lines)


def plots(entries, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loads = [e for e in entries if "target_layout" in e]
    targets = sorted({e["target_layout"] for e in loads}, key=lambda s: (parse_layout(s)["world"], s))
    systems = [s for s in ("reshard", "reshard_verify_off", "reshard_verify_full", "reshard_nodedup",
                           "reshard_one_read_per_job", "dcp", "ucp")
               if any(e["system"] == s for e in loads)]
    ceil = {(e["cache"], e["source_format"]): e for e in entries if e["system"] == "read_ceiling"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, cache in zip(axes, ("warm", "cold")):
        w = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            xs, ys = [], []
            for j, t in enumerate(targets):
                e = next((e for e in loads if e["system"] == s and e["cache"] == cache and e["target_layout"] == t
                          and (e["source_format"] != "deepspeed" or s == "ucp")), None)
                if e:
                    xs.append(j + i * w)
                    ys.append(e["gbps"])
            if xs:
                ax.bar(xs, ys, w, label=s, color=f"C{i}")
        c = ceil.get((cache, "native"))
        if c:
            ax.axhline(c["gbps"], color="k", ls="--", lw=1, label=f"read ceiling {c['gbps']:.2f}")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(targets))])
        ax.set_xticklabels([short_layout(t) for t in targets], fontsize=8)
        ax.set_title(f"{cache} page cache: GB/s of target state")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gbps.png"), dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    warm = [e for e in loads if e["cache"] == "warm" and e.get("peak_rss_bytes")]
    labels = [f"{e['system']}\n{short_layout(e['target_layout'])}" for e in warm]
    ax.bar(range(len(warm)), [e["peak_rss_bytes"] / 2**30 for e in warm], label="peak RSS (largest rank)")
    ax.bar(range(len(warm)), [e.get("live_bytes_max_rank", 0) / 2**30 for e in warm], label="live tensors", alpha=0.7)
    ax.set_xticks(range(len(warm)))
    ax.set_xticklabels(labels, fontsize=6, rotation=60)
    ax.set_ylabel("GiB")
    ax.set_title("warm loads: peak RSS vs live tensors (largest rank)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rss.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~0.3 GB of state, two targets, fewer repeats (< 5 min)")
    ap.add_argument("--size-gb", type=float, default=None, help="training state to write, GB (default 2; quick 0.3)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench_out"))
    ap.add_argument("--data", default=None, help="where checkpoints go (default OUT/data; removed unless --keep-data)")
    ap.add_argument("--source", default="tp=2,pp=1,dp=2,zero=1")
    ap.add_argument("--targets", default=None, help="';'-separated target layouts (world size <= 8)")
    ap.add_argument("--ucp-targets", type=int, default=None, help="how many of the targets UCP loads (default 2: each rank runs a DeepSpeed engine; quick 1)")
    ap.add_argument("--repeat", type=int, default=None, help="timed warm repeats (median reported; default 3)")
    ap.add_argument("--cold-repeat", type=int, default=None)
    ap.add_argument("--peer-repeat", type=int, default=None, help="timed warm repeats of DCP (default 2; quick 1)")
    ap.add_argument("--memory-budget", default="1GiB")
    ap.add_argument("--reshard-bin", default=os.path.join(REPO, "build", "bin", "reshard"))
    ap.add_argument("--plan-bench", default=os.path.join(REPO, "build", "bin", "plan_bench"))
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--zero3", default="tp=1,pp=1,dp=4,zero=3->tp=1,pp=1,dp=2,zero=3",
                    help="SOURCE->TARGET of the ZeRO-3 case (the plain DeepSpeedEngine saves SOURCE; reshard and UCP "
                         "load TARGET); '' skips it")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--no-adjacent-ceiling", action="store_true",
                    help="ratios against the run's one warm read ceiling instead of one measured right before "
                         "each warm load")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    # The command as the user typed it (scripts/bench.sh adds --reshard-bin and --plan-bench).
    shown, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--reshard-bin", "--plan-bench"):
            skip = True
        else:
            shown.append(x)
    a.argv = shown
    q = a.quick
    a.size_gb = a.size_gb or (0.3 if q else 2.0)
    default_targets = ["tp=1,pp=1,dp=2,zero=1", "tp=2,pp=1,dp=1,zero=1"]
    if not q:
        default_targets += ["tp=1,pp=2,dp=2,zero=1", "tp=4,pp=1,dp=2,zero=1"]
    a.targets = [t.strip() for t in a.targets.split(";")] if a.targets else default_targets
    a.ucp_targets = a.ucp_targets if a.ucp_targets is not None else (1 if q else 2)
    a.repeat = a.repeat or 3
    a.cold_repeat = a.cold_repeat or (1 if q else 2)
    a.peer_repeat = a.peer_repeat or (1 if q else 2)
    if not os.path.exists(a.reshard_bin):
        raise SystemExit(f"{a.reshard_bin} not found: run scripts/setup.sh (or set RESHARD_BUILD_DIR)")
    Bench(a).run()


if __name__ == "__main__":
    main()
