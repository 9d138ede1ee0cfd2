"""reshard's trainer hook into the plain DeepSpeedEngine (--no-pipeline) with ZeRO-2 and ZeRO-3,
on real DeepSpeed (gloo, mpirun): ZeRO-3 dp=4 -> ZeRO-3 dp=3 (a load DeepSpeed itself refuses),
ZeRO-3 tp=2,dp=2 -> ZeRO-1 PipelineEngine tp=1,pp=2,dp=2, ZeRO-2 dp=2 -> ZeRO-3 dp=4. Each target
starts scrambled to NaN; its consolidated live state must equal the source's at the saved
iteration bitwise (weights, fp32 master, exp_avg, exp_avg_sq, step) and its next step's loss the
uninterrupted run's within 1e-6 relative (fp32)."""

import json
import os
import shutil
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "python"), REPO]
reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")
pytest.importorskip("deepspeed")
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found", allow_module_level=True)

from integration.megatron_deepspeed import model as M  # noqa: E402
from integration.megatron_deepspeed.launch import mpirun_module  # noqa: E402
from integration.megatron_deepspeed.reshard_hook import model_config_dict  # noqa: E402
from integration.megatron_deepspeed.state_dump import consolidate  # noqa: E402

pytestmark = pytest.mark.slow
BASE = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32", "--micro-batch", "2",
        "--global-batch", "24", "--quiet"]
CFG = model_config_dict(M.GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                                    ffn_hidden_size=128, seq_length=32))


def run(tp, pp, dp, args):
    r, cmd = mpirun_module("state_dump", tp, pp, dp, BASE + args, 600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def losses(path):
    with open(path) as f:
        return {s["step"]: s["loss"] for s in json.load(f)["steps"]}


def source(tmp, tp, dp, zero):
    run(tp, 1, dp, ["--no-pipeline", "--zero", str(zero), "--log-json", f"{tmp}/src.json", "--dump-dir", f"{tmp}/src",
                    "--dump-at-save", "--save", f"{tmp}/ds", "--save-native", f"{tmp}/native", "--save-interval", "3",
                    "--steps", "4"])


def resume(tmp, name, tp, pp, dp, zero, fmt, plain):
    run(tp, pp, dp, (["--no-pipeline"] if plain else []) + [
        "--zero", str(zero), "--log-json", f"{tmp}/{name}.json", "--dump-dir", f"{tmp}/{name}", "--scramble",
        "--load", f"{tmp}/{fmt}", "--load-with", "reshard", "--load-step", "3", "--dump-at-save", "--save",
        f"{tmp}/{name}_ds", "--steps", "4"])
    a, b = consolidate(f"{tmp}/src/it3", CFG), consolidate(f"{tmp}/{name}/load", CFG)
    for k in ("weight", "fp32", "exp_avg", "exp_avg_sq"):
        assert set(a[k]) == set(b[k]) and len(a[k]) == 52, (name, k, set(a[k]) ^ set(b[k]))
        for n in a[k]:
            assert not torch.isnan(b[k][n]).any(), (name, k, n, "not written")
            assert torch.equal(a[k][n], b[k][n]), (name, k, n, float((a[k][n] - b[k][n]).abs().max()))
    assert a["step"] == b["step"] == [3.0] and b["global_steps"] == [3] and b["global_samples"] == [72]
    la, lb = losses(f"{tmp}/src.json")[4], losses(f"{tmp}/{name}.json")[4]
    assert abs(la - lb) <= 1e-6 * abs(la), (name, la, lb)


def test_zero3_dp4_to_zero3_dp3_and_to_pipeline(tmp_path):
    tmp = str(tmp_path)
    source(tmp, 1, 4, 3)
    resume(tmp, "z3d3", 1, 1, 3, 3, "ds", True)
    resume(tmp, "pipe", 2, 2, 1, 1, "native", False)


def test_zero3_tp2dp2_to_zero1_pipeline_tp1pp2dp2(tmp_path):
    tmp = str(tmp_path)
    source(tmp, 2, 2, 3)
    resume(tmp, "pipe", 1, 2, 2, 1, "ds", False)


def test_zero2_dp2_to_zero3_dp4(tmp_path):
    tmp = str(tmp_path)
    source(tmp, 1, 2, 2)
    resume(tmp, "z3d4", 1, 1, 4, 3, "ds", True)
