"""Generate reference Megatron-DeepSpeed-style checkpoints with real DeepSpeed (CPU, gloo).

    .venv/bin/python -m integration.megatron_deepspeed.make_checkpoints OUT_ROOT [--cases a,b] [--steps 3]

One sub-folder per case, each a DeepSpeed save dir written by a short training run of the tiny GPT
(4 layers, hidden 64, 8 heads, ffn 128, vocab 256 unless the case says otherwise):

    OUT_ROOT/<case>/latest, latest_checkpointed_iteration.txt, global_step<N>/...   (DeepSpeed + Megatron)
    OUT_ROOT/<case>/reference/zero_to_fp32.pt      DeepSpeed's get_fp32_state_dict_from_zero_checkpoint
                                                   (tp=1, pp=1 cases only)
    OUT_ROOT/<case>/reference/universal/           python -m deepspeed.checkpoint.ds_to_universal output
    OUT_ROOT/<case>/reference/loss.json            per-step loss of the run
    OUT_ROOT/manifest.json                         every case: layout, model, files, reference results
    OUT_ROOT/logs/<case>.*.log                     stdout/stderr of each tool

A reference tool that fails is recorded in the manifest (error text) instead of aborting the set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from .launch import cleanup_shm, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable

# name -> trainer flags (model/parallel). World size = tp * pp * dp (<= 8).
BASE = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32",
        "--micro-batch", "2", "--global-batch", "8"]
GQA_SWIGLU = ["--query-groups", "4", "--swiglu"]

CASES = {
    # ZeRO-1 on the PipelineModule, fp32, tied embeddings (DeepSpeedZeroOptimizer, zero_pp_rank_* files)
    "pipe_pp1_tp1_dp2_z1_fp32": dict(tp=1, pp=1, dp=2, zero=1, flags=[]),
    "pipe_pp1_tp2_dp2_z1_fp32": dict(tp=2, pp=1, dp=2, zero=1, flags=[]),
    "pipe_pp2_tp1_dp2_z1_fp32": dict(tp=1, pp=2, dp=2, zero=1, flags=[]),
    "pipe_pp2_tp2_dp2_z1_fp32": dict(tp=2, pp=2, dp=2, zero=1, flags=[]),
    # bf16 + ZeRO-1 + grad_accum_dtype fp32 -> BF16_Optimizer (bf16_zero_pp_rank_* files), untied, GQA, SwiGLU
    "pipe_pp2_tp2_dp2_z1_bf16_untied_gqa_swiglu": dict(tp=2, pp=2, dp=2, zero=1, flags=["--bf16", "--untied"] +
                                                       GQA_SWIGLU),
    # bf16 + ZeRO-1 with DeepSpeed's default grad-accum dtype -> DeepSpeedZeroOptimizer writing bf16_ files
    "pipe_pp1_tp1_dp2_z1_bf16_zeroopt": dict(tp=1, pp=1, dp=2, zero=1, flags=["--bf16", "--grad-accum-dtype",
                                                                               "default"]),
    # GQA + SwiGLU + RMSNorm, no linear biases, untied, vocab 300 padded (tp2: 384)
    "pipe_pp1_tp2_dp2_z1_fp32_gqa_swiglu_rms_nobias_v300": dict(
        tp=2, pp=1, dp=2, zero=1,
        flags=["--untied", "--normalization", "rmsnorm", "--no-bias", "--vocab-size", "300"] + GQA_SWIGLU),
    # Plain engine (non-pipeline GPTModel, Megatron module names), dp=2, tp=1
    "plain_dp2_z2_fp32": dict(tp=1, pp=1, dp=2, zero=2, flags=["--no-pipeline"]),
    "plain_dp2_z3_fp32": dict(tp=1, pp=1, dp=2, zero=3, flags=["--no-pipeline"]),
    "plain_dp2_z2_bf16_untied_gqa_swiglu": dict(tp=1, pp=1, dp=2, zero=2,
                                                flags=["--no-pipeline", "--bf16", "--untied"] + GQA_SWIGLU),
    "plain_dp2_z3_bf16_untied_gqa_swiglu": dict(tp=1, pp=1, dp=2, zero=3,
                                                flags=["--no-pipeline", "--bf16", "--untied"] + GQA_SWIGLU),
}


def mpirun_cmd(np_: int):
    return ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(np_), "--bind-to", "none"]


def run_logged(cmd, log_prefix, env=None, timeout=600):
    t0 = time.time()
    with open(log_prefix + ".out.log", "w") as out, open(log_prefix + ".err.log", "w") as err:
        try:
            r = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=err, timeout=timeout)
        finally:
            if env and env.get("MASTER_PORT", "0") != "0":
                cleanup_shm(int(env["MASTER_PORT"]))
    return r.returncode, time.time() - t0


def _tail(path, n=25):
    try:
        with open(path) as f:
            lines = [l for l in f.read().splitlines() if "it/s]" not in l and l.strip()]
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def train_env(port: int):
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def train_case(case_dir, spec, steps, logs, name, extra=()):
    world = spec["tp"] * spec["pp"] * spec["dp"]
    cmd = mpirun_cmd(world) + [PY, "-m", "integration.megatron_deepspeed.train", "--tp", str(spec["tp"]), "--pp",
                               str(spec["pp"]), "--dp", str(spec["dp"]), "--zero", str(spec["zero"]), "--steps",
                               str(steps), "--save", case_dir, "--quiet", "--log-json",
                               os.path.join(case_dir, "reference", "loss.json")] + BASE + spec["flags"] + list(extra)
    os.makedirs(os.path.join(case_dir, "reference"), exist_ok=True)
    rc, dt = run_logged(cmd, os.path.join(logs, f"{name}.train"), env=train_env(free_port()))
    return rc, dt, cmd


def _patched_copy(case_dir, tag, name, how):
    """A temporary copy of the tag folder whose mp_rank_*_model_states.pt 'module' entry is replaced:
    how='empty' -> {} (PipelineEngine files store None there), how='flat' -> the nested Megatron
    state dict flattened to 'a.b.c' names. Everything else is byte-identical."""
    import torch
    tmp = os.path.join(os.path.dirname(case_dir), "_tmp_" + name)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(os.path.join(case_dir, tag), os.path.join(tmp, tag))
    shutil.copy2(os.path.join(case_dir, "latest"), tmp)
    for f in os.listdir(os.path.join(tmp, tag)):
        if f.startswith("mp_rank_") and f.endswith("_model_states.pt"):
            p = os.path.join(tmp, tag, f)
            # Test tool: reads a file this script's own DeepSpeed run just wrote (docs/reliability.md).
            sd = torch.load(p, map_location="cpu", weights_only=False)
            if how == "empty":
                sd["module"] = {}
            else:
                from .model import _flatten
                sd["module"] = _flatten(sd["module"])
            torch.save(sd, p)
    return tmp


def ref_zero_to_fp32(case_dir, tag, logs, name):
    res = _zero_to_fp32(case_dir, tag, logs, name)
    if not res["ok"] and "NoneType" in res["error"]:
        # DeepSpeed's zero_to_fp32 reads buffers from 'module', which a PipelineEngine saves as None.
        tmp = _patched_copy(case_dir, tag, name, "empty")
        try:
            fb = _zero_to_fp32(tmp, tag, logs, name + ".patched", out_dir=os.path.join(case_dir, "reference"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res = {"ok": False, "error": res["error"], "seconds": res["seconds"],
               "workaround": "ran on a copy whose mp_rank_00 'module' (None for PipelineEngine) was set to {}",
               "workaround_ok": fb["ok"]}
        if fb["ok"]:
            res["path"] = fb["path"]
        else:
            res["workaround_error"] = fb["error"]
    return res


def _zero_to_fp32(case_dir, tag, logs, name, out_dir=None):
    out = os.path.join(out_dir or os.path.join(case_dir, "reference"), "zero_to_fp32.pt")
    code = ("import sys, torch\n"
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g\n"
            "sd = g(sys.argv[1], tag=sys.argv[2])\n"
            "torch.save(sd, sys.argv[3])\n"
            "print(len(sd), 'tensors')\n")
    rc, dt = run_logged([PY, "-c", code, case_dir, tag, out], os.path.join(logs, f"{name}.zero_to_fp32"),
                        env=train_env(0))
    if rc == 0:
        return {"ok": True, "path": "reference/zero_to_fp32.pt", "seconds": round(dt, 1)}
    return {"ok": False, "error": _tail(os.path.join(logs, f"{name}.zero_to_fp32.err.log")), "seconds": round(dt, 1)}


def ref_universal(case_dir, tag, logs, name):
    res = _universal(case_dir, tag, logs, name)
    if not res["ok"] and "'dict' object has no attribute 'float'" in res["error"]:
        # ds_to_universal treats every 'module' entry as a tensor; Megatron's nested dict breaks it.
        tmp = _patched_copy(case_dir, tag, name, "flat")
        try:
            fb = _universal(tmp, tag, logs, name + ".patched", out=os.path.join(case_dir, "reference", "universal"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res.update(workaround="ran on a copy whose nested Megatron 'module' dict was flattened to dotted names",
                   workaround_ok=fb["ok"])
        if fb["ok"]:
            res["path"] = "reference/universal"
        else:
            res["workaround_error"] = fb["error"]
    return res


def _universal(case_dir, tag, logs, name, out=None):
    out = out or os.path.join(case_dir, "reference", "universal")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(case_dir, tag),
           "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    rc, dt = run_logged(cmd, os.path.join(logs, f"{name}.ds_to_universal"), env=train_env(0))
    root = os.path.dirname(os.path.abspath(case_dir))
    res = {"command": " ".join(cmd[1:]).replace(root + "/", "<root>/"), "seconds": round(dt, 1)}
    if rc == 0:
        res.update(ok=True, path="reference/universal")
    else:
        res.update(ok=False, error=_tail(os.path.join(logs, f"{name}.ds_to_universal.err.log")))
    return res


def list_files(root, exclude=("reference", )):
    files = []
    for dp, dns, fns in os.walk(root):
        rel = os.path.relpath(dp, root)
        if rel.split(os.sep)[0] in exclude:
            dns[:] = []
            continue
        for f in fns:
            p = os.path.join(dp, f)
            files.append({"path": os.path.relpath(p, root), "bytes": os.path.getsize(p)})
    return sorted(files, key=lambda d: d["path"])


def optimizer_writer(case_dir, tag):
    """Which DeepSpeed optimizer wrote the shards (detected by keys, as a reader must)."""
    import torch
    d = os.path.join(case_dir, tag)
    f = sorted(x for x in os.listdir(d) if x.endswith("_optim_states.pt"))
    if not f:
        return None
    # Test tool: reads a file this script's own DeepSpeed run just wrote (docs/reliability.md).
    sd = torch.load(os.path.join(d, f[0]), map_location="cpu", weights_only=False)["optimizer_state_dict"]
    if "fp32_flat_groups" in sd:
        return "DeepSpeedZeroOptimizer_Stage3"
    if "zero_stage" in sd:
        return "DeepSpeedZeroOptimizer"
    return "BF16_Optimizer"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_root")
    ap.add_argument("--cases", default="all", help="comma-separated case names (default: all)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true", help="skip zero_to_fp32 / ds_to_universal")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(CASES))
        return 0
    names = list(CASES) if a.cases == "all" else [c.strip() for c in a.cases.split(",") if c.strip()]
    for n in names:
        if n not in CASES:
            raise SystemExit(f"unknown case {n}; --list shows them")
    root = os.path.abspath(a.out_root)
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    man_path = os.path.join(root, "manifest.json")
    manifest = {"cases": {}}
    if os.path.exists(man_path):
        with open(man_path) as f:
            manifest = json.load(f)
    import deepspeed
    import torch
    manifest.update(generator="integration/megatron_deepspeed/make_checkpoints.py", deepspeed=deepspeed.__version__,
                    torch=torch.__version__, steps=a.steps)
    t_all = time.time()
    failed = []
    for name in names:
        spec = CASES[name]
        case_dir = os.path.join(root, name)
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(case_dir)
        rc, dt, cmd = train_case(case_dir, spec, a.steps, logs, name)
        tag = f"global_step{a.steps}"
        entry = {
            "dir": name,
            "tag": tag,
            "layout": {"tp": spec["tp"], "pp": spec["pp"], "dp": spec["dp"], "zero_stage": spec["zero"],
                       "pipeline": "--no-pipeline" not in spec["flags"]},
            "train_command": " ".join(x.replace(REPO + "/", "").replace(root + "/", "<root>/") for x in cmd),
            "train_seconds": round(dt, 1),
            "train_ok": rc == 0,
        }
        print(f"[make_checkpoints] {name}: train rc={rc} {dt:.1f}s", flush=True)
        if rc != 0:
            entry["error"] = _tail(os.path.join(logs, f"{name}.train.err.log"), 40)
            failed.append(name)
            manifest["cases"][name] = entry
            continue
        with open(os.path.join(case_dir, "reference", "loss.json")) as f:
            loss = json.load(f)
        cfg = loss["config"]
        entry["model"] = {k: cfg[k] for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "ffn_hidden_size", "swiglu",
            "tied", "add_bias_linear", "normalization", "vocab_size", "padded_vocab_size",
            "make_vocab_size_divisible_by", "seq_length", "position_embeddings", "bf16", "seed")}
        entry["model"]["checkpoint_version"] = 3.0
        entry["layout"]["optimizer_writer"] = optimizer_writer(case_dir, tag)
        entry["training"] = {k: cfg[k] for k in ("global_batch", "micro_batch", "gas", "lr", "corpus_sha256")}
        entry["loss"] = [s["loss"] for s in loss["steps"]]
        entry["files"] = list_files(case_dir)
        refs = {}
        if not a.no_reference:
            if spec["tp"] == 1 and spec["pp"] == 1:
                refs["zero_to_fp32"] = ref_zero_to_fp32(case_dir, tag, logs, name)
            refs["ds_to_universal"] = ref_universal(case_dir, tag, logs, name)
            for k, v in refs.items():
                note = ""
                if not v["ok"] and "workaround_ok" in v:
                    note = (f" (DeepSpeed's own tool fails on this checkpoint: {v['workaround']}; "
                            f"workaround_ok={v['workaround_ok']})")
                print(f"[make_checkpoints] {name}: {k} ok={v['ok']} {v['seconds']}s{note}", flush=True)
        entry["reference"] = refs
        manifest["cases"][name] = entry
        with open(man_path, "w") as f:
            json.dump(manifest, f, indent=1)
    manifest["total_seconds_last_run"] = round(time.time() - t_all, 1)
    with open(man_path, "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"[make_checkpoints] {len(names)} case(s) in {time.time() - t_all:.1f}s -> {man_path}", flush=True)
    if failed:
        print(f"[make_checkpoints] training failed: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
