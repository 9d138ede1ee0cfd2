"""Elastic resume through the Python API: the layout chooser on an opened checkpoint, the batch
split, the world size a launcher gives, `target: auto` resume configs, and the newest complete
step (a save that did not finish is skipped with a note, never loaded)."""

import os
import shutil

import pytest

reshard = pytest.importorskip("reshard", reason="build the extension first (scripts/setup.sh)")

TINY = {"name": "tiny-f32", "num_layers": 2, "hidden": 16, "ffn": 32, "heads": 4, "query_groups": 2, "vocab": 60,
        "vocab_divisible_by": 8, "max_position_embeddings": 8, "swiglu": True, "tied_embeddings": True, "bias": True,
        "norm": "layernorm", "param_dtype": "f32", "qkv_version": 3.0}
SAVED = "tp=2,pp=2,dp=2,zero=1"


@pytest.fixture
def root(tmp_path):
    m = reshard.model_config(TINY)
    for seed, step in ((5, "step-4"), (6, "step-8")):
        reshard.synth_checkpoint(str(tmp_path), m, SAVED, seed, step)
    with open(tmp_path / "latest", "w") as f:
        f.write("step-4")  # a save of step-8 that finished but whose `latest` write did not
    return tmp_path


def test_keep_policy_on_an_opened_checkpoint(root):
    ckpt = reshard.open_checkpoint(str(root), step="newest")
    assert os.path.basename(ckpt.path) == "step-8"
    assert any("newest complete step: step-8 (`latest` names step-4)" in n for n in ckpt.notes), ckpt.notes
    c = reshard.choose_layout(ckpt, 4)
    assert c["target"] == "tp=2,pp=2,vpp=1,dp=1,zero=1"
    assert c["reason"] == "world size 8 -> 4: kept tp=2, pp=2, ZeRO-1; dp 2 -> 1 (policy keep)"
    assert reshard.choose_layout(ckpt, 16)["target"] == "tp=2,pp=2,vpp=1,dp=4,zero=1"
    with pytest.raises(reshard.InvalidArgument, match=r"no layout fits world size 6 .*not a multiple of tp\*pp = 4"):
        reshard.choose_layout(ckpt, 6)


def test_list_policy_asks_the_checkpoints_model(root):
    ckpt = reshard.open_checkpoint(str(root))
    # The model has 4 heads and 2 query groups: tp=8 cannot take it, tp=4 cannot either
    # (more tp ranks than query groups is refused by default), tp=2 can.
    c = reshard.choose_layout(ckpt, 4, policy="list", allowed=["tp=4,pp=1", "tp=2,pp=1"])
    assert c["target"] == "tp=2,pp=1,vpp=1,dp=2,zero=1", c
    assert len(c["tried"]) == 1 and c["tried"][0].startswith("allowed[0] tp=4,pp=1,vpp=1,dp=1,zero=1: "), c["tried"]
    with pytest.raises(reshard.InvalidArgument, match=r"world size 3.*allowed\[0\].*allowed\[1\]"):
        reshard.choose_layout(ckpt, 3, policy="list", allowed=["tp=2", "tp=4"])
    with pytest.raises(reshard.InvalidArgument, match="list of layout strings"):
        reshard.choose_layout(ckpt, 4, policy="list", allowed="tp=2")
    with pytest.raises(reshard.InvalidArgument, match="'grow' is unknown"):
        reshard.choose_layout(ckpt, 4, policy="grow")
    with pytest.raises(reshard.InvalidArgument, match="which does not read them; pass policy='list'"):
        reshard.choose_layout(ckpt, 4, allowed=["tp=2"])
    for bad in (2**70, 4.0, True, "4"):
        with pytest.raises(reshard.InvalidArgument, match="world_size must be an integer"):
            reshard.choose_layout(ckpt, bad)
    with pytest.raises(reshard.InvalidArgument, match="global_batch must be an integer"):
        reshard.choose_layout(ckpt, 4, global_batch=4.7)
    assert reshard.choose_layout(ckpt, 4, allowed=None)["target"] == "tp=2,pp=2,vpp=1,dp=1,zero=1"
    with pytest.raises(reshard.InvalidArgument, match="only the saved world size 8"):
        reshard.choose_layout(ckpt, 4, policy="refuse")


def test_global_batch_is_kept_or_the_restart_refused():
    with pytest.raises(reshard.InvalidArgument, match="global batch 8 is not divisible by dp=3"):
        reshard.choose_layout("tp=1,pp=1,dp=8,zero=1", 3, global_batch=8)
    b = reshard.plan_batch(24, 2, 8)
    assert (b["micro_batch"], b["grad_accum"]) == (1, 3)
    assert "micro-batch 2 -> 1" in b["reason"]
    b = reshard.plan_batch(16, 2, 4)
    assert (b["micro_batch"], b["grad_accum"], b["reason"]) == (2, 2, "")
    with pytest.raises(reshard.InvalidArgument, match="global batch 8 is not divisible by dp=3"):
        reshard.plan_batch(8, 2, 3)
    # Large values: the divisor search is bounded, the range is named.
    b = reshard.plan_batch(2**40, 2**39 - 1, 1)
    assert b["micro_batch"] == 2**38 and b["grad_accum"] == 4
    with pytest.raises(reshard.InvalidArgument, match=r"out of range \(at most 2\^40 samples\)"):
        reshard.plan_batch(2**40 + 2, 2, 2)
    for bad in ((8.9, 2, 2), ("8", 2, 2), (8, True, 2), (2**70, 1, 1)):
        with pytest.raises(reshard.InvalidArgument, match="must be an integer"):
            reshard.plan_batch(*bad)


def test_world_size_of_job():
    assert reshard.world_size_of_job({}) is None
    assert reshard.world_size_of_job({"WORLD_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "8"}) == 4
    assert reshard.world_size_of_job({"OMPI_COMM_WORLD_SIZE": "8"}) == 8
    assert reshard.world_size_of_job({"SLURM_NTASKS": "2"}) == 2
    with pytest.raises(reshard.InvalidArgument, match="WORLD_SIZE='four'"):
        reshard.world_size_of_job({"WORLD_SIZE": "four"})
    with pytest.raises(reshard.InvalidArgument, match="PMI_SIZE='0'"):
        reshard.world_size_of_job({"PMI_SIZE": "0"})
    for odd in ("\u00b2", "\u0664", "9" * 30):
        with pytest.raises(reshard.InvalidArgument, match="not a world size"):
            reshard.world_size_of_job({"WORLD_SIZE": odd})


def test_newest_skips_a_save_that_did_not_finish(root):
    # A save killed midway: one rank's data file never written, another cut short.
    os.unlink(root / "step-8" / "rank_00003.safetensors")
    ckpt = reshard.open_checkpoint(str(root), step="newest")
    assert os.path.basename(ckpt.path) == "step-4"
    skipped = [n for n in ckpt.notes if n.startswith("skipped step step-8, not complete")]
    assert len(skipped) == 1 and "rank_00003.safetensors" in skipped[0], ckpt.notes
    # `latest` and an asked step are unchanged: the asked step-8 opens (and a load names its gap).
    assert os.path.basename(reshard.open_checkpoint(str(root)).path) == "step-4"
    # Every step incomplete: an error listing each, never a silent start from nothing.
    with open(root / "step-4" / "rank_00001.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(reshard.NotFound, match=r"no complete step in .*\(2 step folder\(s\) found\).*step-8.*step-4"):
        reshard.open_checkpoint(str(root), step="newest")


def test_newest_does_not_hide_a_model_disagreement(root):
    other = dict(TINY, hidden=32, ffn=64)
    with pytest.raises(reshard.InvalidArgument, match="disagrees with the model"):
        reshard.open_checkpoint(str(root), step="newest", model=other)
    # A model file that is not there is that file's error, not "no complete step".
    with pytest.raises(reshard.NotFound, match="no-such-model.yaml") as e:
        reshard.open_checkpoint(str(root), step="newest", model=str(root / "no-such-model.yaml"))
    assert "no complete step" not in str(e.value)


def test_newest_orders_step_folders_by_number_and_unnumbered_first(tmp_path):
    m = reshard.model_config(TINY)
    for names, newest in ((["a-12", "m", "z-4"], "a-12"), (["iter_0000004", "iter_0000008", "release"], "iter_0000008"),
                          (["step-4", "step-8", "zz-final"], "step-8")):
        root = tmp_path / names[0]
        for n in names:
            reshard.synth_checkpoint(str(root), m, SAVED, 5, n)
        assert os.path.basename(reshard.open_checkpoint(str(root), step="newest").path) == newest, names


def test_a_folder_named_newest_is_a_step_name(tmp_path):
    m = reshard.model_config(TINY)
    reshard.synth_checkpoint(str(tmp_path), m, SAVED, 5, "newest")
    reshard.synth_checkpoint(str(tmp_path), m, SAVED, 5, "step-9")
    assert os.path.basename(reshard.open_checkpoint(str(tmp_path), step="newest").path) == "newest"


RESUME_AUTO = """checkpoint:
  root: {root}
target: auto
elastic:
  policy: list
  allowed: ["tp=2,pp=2", "tp=1,pp=2"]
"""


def test_resume_config_target_auto(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RESUME_AUTO.format(root=tmp_path))
    rc = reshard.load_resume_config(str(p))
    assert rc["target"] == "auto" and rc["target_topology"] is None
    assert rc["elastic"] == {"policy": "list", "allowed": ["tp=2,pp=2", "tp=1,pp=2"]}
    bad = {
        "target: tp=2,pp=2\nelastic:\n  policy: keep\n": "write target: auto",
        "target: auto\nelastic:\n  policy: list\n": "policy list needs",
        "target: auto\nelastic:\n  policy: keep\n  allowed: [\"tp=2\"]\n": "does not read it",
        "target: auto\nelastic:\n  policy: grow\n": "elastic.policy",
        "target: auto\nelastic:\n  policy: list\n  allowed: [\"tp=x\"]\n": r"elastic.allowed\[0\]",
        "target: auto\nelastic:\n  polcy: keep\n": "polcy",
        "target: auto\nelastic:\n  policy: list\n  allowed: tp=2\n": "must be a list",
    }
    for body, msg in bad.items():
        p.write_text(f"checkpoint:\n  root: {tmp_path}\n" + body)
        with pytest.raises(reshard.InvalidArgument, match=msg):
            reshard.load_resume_config(str(p))


CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build", "bin", "reshard")


@pytest.mark.skipif(not os.path.exists(CLI), reason="build/bin/reshard not built (run scripts/setup.sh)")
def test_cli_plan_of_a_target_auto_config(root, tmp_path):
    import json
    import subprocess
    os.unlink(root / "step-8" / "rank_00002.safetensors")  # the newest step did not finish
    p = tmp_path / "auto.yaml"
    p.write_text(RESUME_AUTO.format(root=root))

    def plan(*extra):
        return subprocess.run([CLI, "plan", "--config", str(p), *extra], capture_output=True, text=True)

    r = plan("--world-size", "4", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["target_layout"] == "tp=2,pp=2,vpp=1,dp=1,zero=1", j["target_layout"]
    assert j["elastic"] == {"world_size": 4, "reason": "world size 8 -> 4: allowed[0] tp=2,pp=2,vpp=1,dp=1,zero=1, "
                            "the first allowed layout that fits (policy list)", "tried": []}
    # The trainer's global batch turns layouts down as its restart would: at 8 ranks tp=2,pp=2
    # takes dp=2 and tp=1,pp=2 dp=4, and a global batch of 6 keeps only the first, of 7 neither.
    j = json.loads(plan("--world-size", "8", "--global-batch", "6", "--json").stdout)
    assert j["target_layout"] == "tp=2,pp=2,vpp=1,dp=2,zero=1", j
    j = json.loads(plan("--world-size", "8", "--global-batch", "12", "--json").stdout)
    assert j["target_layout"] == "tp=2,pp=2,vpp=1,dp=2,zero=1", j
    r = plan("--world-size", "8", "--global-batch", "7")
    assert r.returncode == 2 and "global batch 7 is not divisible by dp=2" in r.stderr, r.stderr
    assert "global batch 7 is not divisible by dp=4" in r.stderr, r.stderr
    r = plan("--world-size", "4", "--global-batch", "8")
    assert r.returncode == 0 and "elastic: world size 8 -> 4" in r.stdout, r.stderr
    j = json.loads(plan("--world-size", "2", "--json").stdout)
    assert j["target_layout"] == "tp=1,pp=2,vpp=1,dp=1,zero=1", j
    assert "allowed[1]" in j["elastic"]["reason"] and "1 turned down before it" in j["elastic"]["reason"], j
    assert j["elastic"]["tried"] == ["allowed[0] tp=2,pp=2,vpp=1,dp=0,zero=1: world size 2 is not a multiple of tp*pp = 4"]
    assert "elastic: turned down allowed[0]" in plan("--world-size", "2").stdout
    r = plan("--world-size", "4")
    assert "elastic: world size 8 -> 4" in r.stdout and "(step step-4)" in r.stdout, r.stdout
    r = plan()
    assert r.returncode == 2 and "give --world-size N" in r.stderr, r.stderr
    r = plan("--world-size", "-4")
    assert r.returncode == 2 and "--world-size -4 must be at least 1" in r.stderr, r.stderr
    r = plan("--world-size", "3")
    assert r.returncode == 2 and "no layout fits world size 3" in r.stderr, r.stderr
    r = subprocess.run([CLI, "plan", str(root), "--target", "tp=1", "--world-size", "4"], capture_output=True, text=True)
    assert r.returncode == 2 and "--world-size and --global-batch apply to --config" in r.stderr, r.stderr
