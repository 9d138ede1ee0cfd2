"""Upstream Megatron-DeepSpeed's own trainer resumed through reshard.integrations.megatron_deepspeed.load_checkpoint under
another layout: the losses after the resume equal the uninterrupted run's.

Needs an upstream checkout: RESHARD_MDS_DIR names a work tree (with pretrain_gpt.py), or a git
directory with RESHARD_MDS_COMMIT naming the commit (as MDS_DIR / MDS_COMMIT of
tests/fixtures/upstream_mds/make_upstream_checkpoints.sh, which prepares the patched copy that
trains on CPU). Skipped without it. The only change to upstream's code beyond those CPU patches
is DOCUMENTED_CHANGE, the one line docs/megatron-deepspeed.md tells users to change.

    RESHARD_MDS_DIR=/path/to/Megatron-DeepSpeed .venv/bin/python -m pytest -m slow \\
        tests/python/test_upstream_mds_resume.py

The source run trains tp=2,pp=2,dp=1 (fp32, dropout 0) for SAVE_AT + MORE steps and saves at SAVE_AT;
each resume starts upstream's trainer with --load at that step under another layout and trains
to the same end. Megatron-DeepSpeed before its FPDT change (no --ds-sequence-parallel-fpdt)
also runs the grouped-query model (which the blocked attention code after it cannot train).
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "fixtures", "upstream_mds", "make_upstream_checkpoints.sh")
MDS_DIR = os.environ.get("RESHARD_MDS_DIR", "")
MDS_COMMIT = os.environ.get("RESHARD_MDS_COMMIT", "")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MDS_DIR, reason="RESHARD_MDS_DIR does not name an upstream Megatron-DeepSpeed "
                                 "checkout (work tree, or git directory with RESHARD_MDS_COMMIT)")]

SAVE_AT = 300  # steps before the save ("after a few hundred steps")
MORE = 8       # steps compared after it
# fp32 losses: only the tp/dp reduction order differs. Upstream logs them to 7 significant digits
# (1e-6 at these values), so equal within 1e-6 means at most one unit of the last printed digit.
ATOL = 1e-6

# megatron/training.py, setup_model_and_optimizer: the one line docs/megatron-deepspeed.md changes.
DOCUMENTED_CHANGE = (
    "            args.iteration = load_checkpoint(model, optimizer, opt_param_scheduler)\n",
    "            from reshard.integrations.megatron_deepspeed import load_checkpoint as reshard_load_checkpoint\n"
    "            args.iteration = reshard_load_checkpoint(model, optimizer, opt_param_scheduler)\n",
)

MODELS = {
    "mha": ["--ffn-hidden-size", "128"],
    "gqa": ["--num-key-value-heads", "2", "--ffn-hidden-size", "64", "--swiglu", "--normalization", "rmsnorm",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--no-query-key-layer-scaling"],
}

# (name, tp, pp, dp, extra args). Global batch 4 stays; with dp=2 each rank runs one micro batch
# of 2. vocab 128 (NullTokenizer 127 + eod) at --make-vocab-size-divisible-by 64 is 128 rows at tp
# 1 and 2 but 256 at tp 4: there 32 keeps the 128 rows the loss normalises over (the load's vocab
# padding warning names that divisor). The grouped-query model's 2 key/value heads do not split
# over tp 4 (upstream's attention divides them by tp), so it skips that case.
RESUMES = [
    ("tp2to1", 1, 2, 1, [], ("mha", "gqa")),
    ("tp2to4", 4, 2, 1, ["--make-vocab-size-divisible-by", "32"], ("mha",)),
    ("pp2to1", 2, 1, 1, [], ("mha", "gqa")),
    ("dp1to2", 2, 2, 2, [], ("mha", "gqa")),
    ("gptmodel_pp2to1", 2, 1, 1, ["--no-pipeline-parallel"], ("mha", "gqa")),
]


def _trainer_args(model, tp, pp, iters, extra):
    return (["mds/pretrain_gpt.py", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32"] + MODELS[model] +
            ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
             "--eval-interval", "100000", "--eval-iters", "1",
             "--data-path", "data/tiny_text_document", "--data-impl", "mmap", "--split", "98,2,0",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
             "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
             "--weight-decay", "0.01", "--clip-grad", "1.0", "--optimizer", "adam", "--adam-beta1", "0.9",
             "--adam-beta2", "0.95", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
             "--log-interval", "1", "--distributed-backend", "gloo", "--use-cpu-initialization",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--deepspeed", "--deepspeed_config", "ds_config.json", "--zero-stage", "1"] + extra)


_port = [29700]


def _train(work, model, tp, pp, dp, iters, extra, log):
    n = tp * pp * dp
    _port[0] += 1
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(n), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(work, "mds"), os.path.join(work, "stub")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_port[0])] + _trainer_args(model, tp, pp, iters, extra)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    text = open(log).read()
    assert r.returncode == 0, f"trainer failed ({' '.join(cmd)}):\n{text[-6000:]}"
    losses = {}
    for line in text.splitlines():
        m = re.match(r"^ +iteration +(\d+)/ +\d+ \|.*\| lm loss: ([0-9.E+-]+) \|", line)
        if m:
            losses[int(m.group(1))] = float(m.group(2))
    return losses, text


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """The patched upstream copy with the documented change, and which models its code trains."""
    env = dict(os.environ, MDS_DIR=MDS_DIR, PREPARE_ONLY="1", PYTHON=sys.executable)
    if MDS_COMMIT:
        env["MDS_COMMIT"] = MDS_COMMIT
    r = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    work = re.search(r"\[upstream_mds\] prepared (\S+)", r.stdout).group(1)
    path = os.path.join(work, "mds", "megatron", "training.py")
    text = open(path).read()
    assert text.count(DOCUMENTED_CHANGE[0]) == 1, f"{path}: the line docs/megatron-deepspeed.md changes is not there once"
    open(path, "w").write(text.replace(*DOCUMENTED_CHANGE))
    fpdt = "--ds-sequence-parallel-fpdt" in open(os.path.join(work, "mds", "megatron", "arguments.py")).read()
    yield work, ["mha"] if fpdt else ["mha", "gqa"]
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("model", ["mha", "gqa"])
def test_resume_under_another_layout_equals_the_uninterrupted_run(upstream, model):
    work, models = upstream
    if model not in models:
        pytest.skip("grouped-query attention trains only in Megatron-DeepSpeed before its FPDT change (676a482c)")
    end = SAVE_AT + MORE
    save = os.path.join(work, f"save_{model}")
    shutil.rmtree(save, ignore_errors=True)
    ref, _ = _train(work, model, 2, 2, 1, end, ["--save", save, "--save-interval", str(SAVE_AT)],
                    os.path.join(work, f"A_{model}.log"))
    assert sorted(ref) == list(range(1, end + 1)), sorted(ref)[-5:]
    # Only the step to resume from: upstream also saved at the end, and `latest` names that one.
    load = os.path.join(work, f"load_{model}")
    shutil.rmtree(load, ignore_errors=True)
    os.makedirs(load)
    shutil.copytree(os.path.join(save, f"global_step{SAVE_AT}"), os.path.join(load, f"global_step{SAVE_AT}"))
    open(os.path.join(load, "latest"), "w").write(f"global_step{SAVE_AT}")
    failures = []
    for name, tp, pp, dp, extra, models_ in RESUMES:
        if model not in models_:
            continue
        got, log = _train(work, model, tp, pp, dp, end, ["--load", load] + extra,
                          os.path.join(work, f"{name}_{model}.log"))
        loaded = re.search(r"^reshard: loaded .* at iteration (\d+) .*; consumed samples (\d+), tokens (\d+); QKV rows (\w+)",
                           log, re.M)
        assert loaded, f"{name}: no 'reshard: loaded' line:\n{log[-4000:]}"
        assert (int(loaded.group(1)), int(loaded.group(2)), int(loaded.group(3))) == (SAVE_AT, 4 * SAVE_AT, 4 * SAVE_AT * 32)
        assert "reshard: WARNING" not in log, f"{name}: {re.findall(r'reshard: WARNING.*', log)}"
        assert sorted(got) == list(range(SAVE_AT + 1, end + 1)), (name, sorted(got))
        diffs = [abs(got[i] - ref[i]) for i in got]
        if round(max(diffs), 9) > ATOL:
            failures.append(f"{name} ({tp=} {pp=} {dp=}): max |diff| {max(diffs):.3g}; uninterrupted "
                            f"{[ref[i] for i in sorted(got)]} resumed {[got[i] for i in sorted(got)]}")
    assert not failures, "\n".join(failures)


def test_a_schedule_other_than_the_saved_one_is_refused_before_any_write(upstream):
    """A job started with another --train-iters than the save's: upstream's scheduler refuses the
    saved state; the load says so by name before any tensor is written (the trainer exits)."""
    work, _ = upstream
    save = os.path.join(work, "save_sched")
    shutil.rmtree(save, ignore_errors=True)
    _train(work, "mha", 2, 2, 1, 4, ["--save", save, "--save-interval", "4"], os.path.join(work, "sched_A.log"))
    n = 2
    _port[0] += 1
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(n), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(work, "mds"), os.path.join(work, "stub")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_port[0])] + _trainer_args("mha", 1, 2, 9, ["--load", save])
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "the LR scheduler (OptimizerParamScheduler) refuses the checkpoint's state" in out, out[-4000:]
    assert "nothing was loaded" in out
