"""Elastic resume inside the reference trainer (real DeepSpeed PipelineEngine, ZeRO-1, gloo).

* torchrun's elastic agent (integration/megatron_deepspeed/elastic_demo.py): two agents of 4 workers each (two "nodes" on this machine, c10d
  rendezvous on localhost, --nnodes=1:2) train tp=2,pp=2 with saves every 4 steps in DeepSpeed's
  format. One node is killed with SIGKILL (agent and workers); the surviving agent restarts its
  workers at world size 4, each of which chooses tp=2,pp=2,dp=1 from the checkpoint, reshards the
  newest complete step and trains on; a node comes back, the agent restarts at world size 8
  (dp=2 again) and the job finishes. Every logged loss equals the uninterrupted run's at the same
  step (same global batch, same samples) within 1e-4 relative at each first step after a restart
  and 1e-3 everywhere; the log of each restart names the change and the chosen layout.
* A rank killed during a save (mpirun): the step folder it leaves is skipped with a note, the
  elastic restart at another world size loads the previous complete step and trains on.
About 5 minutes on 2 cores.
"""

import glob
import json
import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the reference trainer (integration/); reshard is the installed package
reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")
pytest.importorskip("deepspeed")
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found", allow_module_level=True)

from integration.megatron_deepspeed import elastic_demo  # noqa: E402
from integration.megatron_deepspeed.launch import mpirun_module, mpirun_ranks  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = ["--layers", "4", "--hidden", "64", "--heads", "8", "--ffn", "128", "--seq-length", "32", "--micro-batch", "2",
         "--global-batch", "8"]
STEPS = 36


@pytest.fixture
def shm_mark(tmp_path):
    """DeepSpeed's CPU shm all-reduce buffers (/dev/shm, ~70 MB per rank) of killed workers are
    never unlinked by them; remove the ones this test made."""
    mark = tmp_path / "shm_mark"
    mark.write_text("")
    yield
    t = os.path.getmtime(mark)
    for f in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.path.getmtime(f) >= t:
                os.unlink(f)
        except OSError:
            pass


def reference_losses(tmp, steps):
    losses = elastic_demo.baseline(tmp, steps, 600)
    assert sorted(losses) == list(range(1, steps + 1))
    return losses


def assert_matches_reference(steps, ref):
    """Each logged step (a step repeated after a restart included) equals the uninterrupted run's;
    the first step of each start within 1e-4 relative, every step within 1e-3."""
    rows = elastic_demo.compare(steps, ref)
    for r in rows:
        assert r["rel_diff"] <= (1e-4 if r["first_after_start"] else 1e-3), r
    return rows


def test_torchrun_node_lost_then_back(tmp_path, shm_mark):
    rep = elastic_demo.run(str(tmp_path / "out"), steps=STEPS)
    rows = rep["rows"]
    worlds = []
    for s in rows:
        if not worlds or worlds[-1] != s["world_size"]:
            worlds.append(s["world_size"])
    assert worlds == [8, 4, 8], worlds
    assert {s["layout"] for s in rows if s["world_size"] == 4} == {"tp=2,pp=2,dp=1"}
    assert all(s["gas"] == 4 for s in rows if s["world_size"] == 4), "global batch 8 = 2 x 4 x dp 1"
    assert all(s["gas"] == 2 for s in rows if s["world_size"] == 8)
    assert rows[-1]["step"] == STEPS and set(range(1, STEPS + 1)) <= {s["step"] for s in rows}
    for r in rows:
        assert r["rel_diff"] <= (1e-4 if r["first_after_start"] else 1e-3), r
    restarts = [s for s in rep["starts"] if s["start_iteration"] > 0]
    assert [s["world_size"] for s in restarts] == [4, 8], rep["starts"]
    for s in restarts:  # each restart resumes the newest saved step, right after it
        assert s["step"] == s["start_iteration"] + 1 and s["start_iteration"] % 4 == 0, s
    assert restarts[0]["start_iteration"] >= 8 and restarts[1]["start_iteration"] >= 16
    assert rep["ok"] and os.path.getsize(rep["plot"]) > 10000
    text = open(rep["agent_logs"]["node0"], errors="replace").read()
    assert "[elastic] world size 8 -> 4: kept tp=2, pp=2, ZeRO-1; dp 2 -> 1 (policy keep)" in text
    assert "[elastic] world size 4 -> 8: kept tp=2, pp=2, ZeRO-1; dp 1 -> 2 (policy keep)" in text
    assert "reshard: tp=2,pp=2,vpp=1,dp=2,zero=1 -> tp=2,pp=2,vpp=1,dp=1,zero=1" in text
    assert "reshard: tp=2,pp=2,vpp=1,dp=1,zero=1 -> tp=2,pp=2,vpp=1,dp=2,zero=1" in text


def test_rank_killed_during_a_save_then_elastic_restart(tmp_path, shm_mark):
    tmp = str(tmp_path)
    ref = reference_losses(tmp, 9)
    root, log = os.path.join(tmp, "ckpt"), os.path.join(tmp, "loss.jsonl")
    common = ["--tp", "2", "--pp", "2", "--elastic", "--load", root, "--save", root, "--save-interval", "3",
              "--steps", "9", "--loss-log", log] + MODEL
    # 8 ranks; at the save of step 6 the last rank is killed (SIGKILL) before writing its files.
    r, cmd = mpirun_ranks("train", 8, common + ["--die-in-save", "6", "--quiet"], 600)
    assert elastic_demo.latest_iteration(root) == 3, r.stdout[-2000:] + r.stderr[-3000:]
    assert os.path.isdir(os.path.join(root, "global_step6")), "the killed save left its folder"
    assert not os.path.exists(os.path.join(root, "global_step6", "zero_pp_rank_1_mp_rank_03_optim_states.pt"))
    # An incomplete step folder is never loaded, even when `latest` names it.
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("6")
    r, cmd = mpirun_ranks("train", 4, common, 600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    assert "[elastic] world size 8 -> 4: kept tp=2, pp=2, ZeRO-1; dp 2 -> 1 (policy keep)" in r.stdout
    assert "[elastic] note: skipped step global_step6, not complete" in r.stdout, r.stdout[-3000:]
    assert "[elastic] step global_step3: tp=2,pp=2,vpp=1,dp=2,zero=1 -> tp=2,pp=2,vpp=1,dp=1,zero=1" in r.stdout
    steps = elastic_demo.read_jsonl(log)
    after = [s for s in steps if s["world_size"] == 4]
    assert [s["step"] for s in after] == list(range(4, 10))
    assert_matches_reference(steps, ref)


def test_no_layout_fits_is_refused_before_any_read(tmp_path, shm_mark):
    tmp = str(tmp_path)
    root = os.path.join(tmp, "ckpt")
    r, cmd = mpirun_module("train", 2, 2, 1, ["--steps", "2", "--save", root, "--quiet"] + MODEL, 600)
    assert r.returncode == 0, r.stderr[-3000:]
    # 6 ranks cannot keep tp*pp = 4.
    r, cmd = mpirun_ranks("train", 6, ["--tp", "2", "--pp", "2", "--elastic", "--load", root, "--steps", "3", "--quiet"] + MODEL, 600)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "no layout fits world size 6" in out and "not a multiple of tp*pp = 4" in out, out[-3000:]


def test_resume_config_target_auto_with_an_allowed_list(tmp_path, shm_mark):
    tmp = str(tmp_path)
    root = os.path.join(tmp, "ckpt")
    r, cmd = mpirun_module("train", 2, 1, 2, ["--steps", "3", "--save", root, "--quiet"] + MODEL, 600)
    assert r.returncode == 0, r.stderr[-3000:]
    rc = os.path.join(tmp, "auto.yaml")
    with open(rc, "w") as f:
        f.write(f"checkpoint:\n  root: {root}\ntarget: auto\nelastic:\n  policy: list\n"
                f"  allowed: [\"tp=4,pp=1\", \"tp=1,pp=2\"]\n")
    log, report = os.path.join(tmp, "loss.jsonl"), os.path.join(tmp, "report.json")
    # 2 ranks: tp=4 needs 4, tp=1,pp=2 takes dp=1; no --tp/--pp given, the config decides.
    r, cmd = mpirun_ranks("train", 2, ["--resume-config", rc, "--steps", "5", "--loss-log", log,
                                       "--reshard-report", report] + MODEL, 600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    assert "[elastic] world size 4 -> 2: allowed[1] tp=1,pp=2,vpp=1,dp=1,zero=1" in r.stdout, r.stdout[-3000:]
    steps = elastic_demo.read_jsonl(log)
    assert [(s["step"], s["layout"], s["gas"]) for s in steps] == [(4, "tp=1,pp=2,dp=1", 4), (5, "tp=1,pp=2,dp=1", 4)]
    with open(report) as f:
        rep = json.load(f)
    assert rep["elastic"]["target"] == "tp=1,pp=2,vpp=1,dp=1,zero=1"
    assert rep["elastic"]["tried"][0].startswith("allowed[0] tp=4,pp=1,vpp=1,dp=0,zero=1: world size 2")
    assert rep["change"].startswith("tp 2->1"), rep["change"]


def test_first_save_cut_short_starts_over_with_a_note(tmp_path, shm_mark):
    tmp = str(tmp_path)
    root = os.path.join(tmp, "ckpt")
    common = ["--tp", "2", "--pp", "1", "--elastic", "--load", root, "--save", root, "--steps", "2"] + MODEL
    r, cmd = mpirun_ranks("train", 4, common + ["--die-in-save", "2", "--quiet"], 600)
    assert os.path.isdir(os.path.join(root, "global_step2"))
    assert not os.path.exists(os.path.join(root, "global_step2", "zero_pp_rank_1_mp_rank_01_optim_states.pt"))
    assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))
    # DeepSpeed's rank 0 wrote `latest` without waiting for the others: it names the unfinished step.
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "global_step2"
    # No save ever finished: the restart starts over, and says why, instead of refusing forever.
    r, cmd = mpirun_ranks("train", 2, common, 600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    assert f"[elastic] no save under {root} ever finished (the first was cut short: " in r.stdout, r.stdout[-3000:]
    assert "[train] step 1 loss" in r.stdout
    # Once a save finished, an unreadable newest step is never a reason to start over.
    assert elastic_demo.latest_iteration(root) == 2
    shutil.rmtree(os.path.join(root, "global_step2"))
    os.makedirs(os.path.join(root, "global_step2"))
    r, cmd = mpirun_ranks("train", 2, common + ["--steps", "3"], 600)
    assert r.returncode != 0 and "[train] step" not in r.stdout
