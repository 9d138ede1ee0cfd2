"""Reliability: every fault of the issue's list, seen from both faces. The CLI exits 2 with one line
naming the path, tensor, region, rank or field (verify exits 1 when it finds a problem in a readable
checkpoint); Python raises the matching reshard.Error subclass with the same message. Live tensors
are never written when a load is refused. docs/reliability.md has the table.

CLI: $RESHARD_CLI or build/bin/reshard. Python: the installed reshard package."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import mpi_cli
from mpi_cli import MPIRUN

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))
MODEL = ROOT / "configs" / "models" / "tiny-gpt.yaml"
SRC = "tp=2,pp=1,dp=2,zero=1"

try:
    import torch
    import reshard
except Exception:  # extension not built
    reshard = None

need_cli = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} not built")
need_py = pytest.mark.skipif(reshard is None, reason="reshard Python extension not built")


def cli(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


def mpirun(k, *args):
    return mpi_cli.mpirun(CLI, k, *args)


def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("reshard: error:"), lines[0]
    return lines[0]


@pytest.fixture
def ck(tmp_path):
    root = tmp_path / "ck"
    if reshard is not None:
        reshard.synth_checkpoint(str(root), str(MODEL), SRC, 5)
    elif CLI.exists():
        r = cli("synth", root, "--model", MODEL, "--layout", SRC, "--seed", 5, "--out-step", "step-1")
        assert r.returncode == 0, r.stderr
    else:
        pytest.skip("neither the CLI nor the extension is built")
    return root


def step_dir(root):
    return root / (root / "latest").read_text().strip()


def live_tensors(layout, rank=0):
    """Sentinel-filled tensors for this rank's buffers of a layout, keyed by buffer name."""
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "F32": torch.float32,
          "BF16": torch.bfloat16, "F16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
    out = {}
    for b in layout.buffers:
        if b["rank"] == rank:
            t = torch.empty(b["numel"], dtype=dt[str(b["dtype"])])
            t.view(torch.uint8).fill_(0xA5)
            out[b["name"]] = t
    return out


def untouched(tensors):
    return all(bool((t.view(torch.uint8) == 0xA5).all()) for t in tensors.values())


# ---- paths -------------------------------------------------------------------------------------

def path_case(tmp_path, ck, which):
    """Returns (path, step, python class name, CLI message part)."""
    if which == "missing":
        return tmp_path / "nope", None, "NotFound", "does not exist"
    if which == "file":
        (tmp_path / "f.bin").write_bytes(b"x")
        return tmp_path / "f.bin", None, "InvalidArgument", "is a file"
    if which == "empty_dir":
        (tmp_path / "e").mkdir()
        return tmp_path / "e", None, "InvalidArgument", "is an empty folder"
    if which == "no_latest_no_steps":
        (tmp_path / "j").mkdir()
        (tmp_path / "j" / "notes.txt").write_text("x")
        return tmp_path / "j", None, "InvalidArgument", "not a checkpoint folder"
    if which == "no_latest_with_steps":
        (ck / "latest").unlink()
        return ck, None, "NotFound", "no `latest`"
    if which == "latest_names_missing":
        (ck / "latest").write_text("step-77\n")
        return ck, None, "NotFound", "names step 'step-77'"
    if which == "asked_step_missing":
        return ck, "99", "NotFound", "step '99' not found"
    if which == "latest_escapes":
        (ck / "latest").write_text("../../etc\n")
        return ck, None, "DataLoss", "not a step folder name"
    raise AssertionError(which)


PATH_CASES = ["missing", "file", "empty_dir", "no_latest_no_steps", "no_latest_with_steps", "latest_names_missing",
              "asked_step_missing", "latest_escapes"]


@need_py
@pytest.mark.parametrize("which", PATH_CASES)
def test_path_faults_python(tmp_path, ck, which):
    path, step, cls, part = path_case(tmp_path, ck, which)
    with pytest.raises(getattr(reshard, cls)) as e:
        reshard.open_checkpoint(str(path), step=step)
    assert isinstance(e.value, reshard.Error)
    assert part in str(e.value), str(e.value)
    assert str(path) in str(e.value) or which == "asked_step_missing" and str(ck) in str(e.value)


@need_cli
@pytest.mark.parametrize("which", PATH_CASES)
@pytest.mark.parametrize("cmd", ["inspect", "verify", "plan"])
def test_path_faults_cli_exit_2(tmp_path, ck, which, cmd):
    path, step, cls, part = path_case(tmp_path, ck, which)
    args = [cmd, path] + (["--step", step] if step else []) + (["--target", "tp=1"] if cmd == "plan" else [])
    r = cli(*args)
    if cmd == "verify" and cls == "DataLoss":
        # verify reports a damaged but recognisable checkpoint as a finding: exit 1
        assert r.returncode == 1, r.stdout + r.stderr
        assert part in r.stdout and "FAILED" in r.stdout, r.stdout
        return
    assert r.returncode == 2, r.stdout + r.stderr
    assert part in one_line_error(r)


@need_py
def test_step_folder_instead_of_root_is_accepted_and_reported(ck):
    info = reshard.inspect(str(step_dir(ck)))
    assert any("a step folder was given" in n for n in info["notes"]), info["notes"]


@need_cli
def test_step_folder_instead_of_root_cli_says_so(ck):
    r = cli("inspect", step_dir(ck), "--json")
    assert r.returncode == 0, r.stderr
    assert any("a step folder was given" in n for n in json.loads(r.stdout)["notes"])


# ---- partial, truncated, corrupt, traversal --------------------------------------------------

@need_py
def test_partial_checkpoint_load_names_files_and_ranges_and_writes_nothing(ck):
    sd = step_dir(ck)
    (sd / "rank_00001.safetensors").unlink()
    c = reshard.open_checkpoint(str(ck))
    target = reshard.derive_layout(c.model, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    with pytest.raises(reshard.DataLoss) as e:
        reshard.load(c, target, live, comm=reshard.local_communicator())
    msg = str(e.value)
    assert "uncovered: tensor " in msg and "elements [" in msg and "of source rank 1" in msg, msg
    assert untouched(live)
    # The trainer's error names the missing file itself, as the CLI does (see docs/reliability.md).
    assert "rank_00001.safetensors" in msg, msg


@need_cli
def test_partial_checkpoint_plan_exit_2_verify_exit_1(ck, tmp_path):
    f = step_dir(ck) / "rank_00003.safetensors"
    f.unlink()
    r = cli("plan", ck, "--target", "tp=1,dp=1,zero=1")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert "uncovered: tensor " in line and "of source rank 3" in line, line
    r = cli("verify", ck)
    assert r.returncode == 1 and str(f) in r.stdout


def header_of(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return data, n, json.loads(data[8:8 + n])


@need_py
def test_safetensors_header_pointing_outside_the_file(ck):
    f = step_dir(ck) / "rank_00000.safetensors"
    data, n, h = header_of(f)
    name = next(k for k in h if k != "__metadata__")
    # Grow the last tensor so that the header describes bytes past the end of the file.
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[last]["shape"] = [h[last]["shape"][0] + 1024]
    h[last]["data_offsets"][1] += 1024 * {"F32": 4, "BF16": 2, "F16": 2}[h[last]["dtype"]]
    body = json.dumps(h).encode()
    body += b" " * ((8 - (8 + len(body)) % 8) % 8)
    f.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])
    with pytest.raises(reshard.DataLoss) as e:
        reshard.open_checkpoint(str(ck))
    assert "rank_00000.safetensors" in str(e.value), str(e.value)
    assert name


@need_cli
@pytest.mark.parametrize("how", ["truncated_header", "garbage_header", "metadata_outside", "metadata_not_json",
                                 "metadata_is_a_folder", "traversal_files", "traversal_buffers", "absolute_path"])
def test_damaged_step_cli_exit_2_python_error(ck, how):
    sd = step_dir(ck)
    meta = sd / "metadata.json"
    j = json.loads(meta.read_text())
    part, cls = None, "DataLoss"
    if how == "truncated_header":
        f = sd / "rank_00002.safetensors"
        f.write_bytes(f.read_bytes()[:40])
        part = "rank_00002.safetensors"
    elif how == "garbage_header":
        f = sd / "rank_00002.safetensors"
        f.write_bytes(b"\xff" * 64)
        part = "rank_00002.safetensors"
    elif how == "metadata_outside":
        j["pieces"][1]["base"] = 1 << 40
        meta.write_text(json.dumps(j))
        part = "pieces[1]"
    elif how == "metadata_not_json":
        meta.write_text("{ nope")
        part = "metadata.json is not valid JSON"
    elif how == "metadata_is_a_folder":  # was "… is not a step folder: it holds neither metadata.json …"
        meta.unlink()
        meta.mkdir()
        part = "metadata.json is not a regular file"
    elif how == "traversal_files":
        j["files"][0]["name"] = "../../x.safetensors"
        meta.write_text(json.dumps(j))
        part, cls = "../../x.safetensors", "InvalidArgument"
    elif how == "traversal_buffers":
        j["buffers"][0]["file"] = "../rank_00000.safetensors"
        meta.write_text(json.dumps(j))
        part, cls = "../rank_00000.safetensors", "InvalidArgument"
    elif how == "absolute_path":
        j["files"][1]["name"] = "/etc/passwd"
        meta.write_text(json.dumps(j))
        part, cls = "/etc/passwd", "InvalidArgument"
    for cmd in (["inspect", ck], ["plan", ck, "--target", "tp=1,dp=1,zero=1"]):
        r = cli(*cmd)
        assert r.returncode == 2, (cmd, r.stdout + r.stderr)
        assert part in one_line_error(r)
    r = cli("verify", ck)
    if cls == "DataLoss":  # a finding in a recognisable checkpoint
        assert r.returncode == 1 and part in r.stdout, r.stdout + r.stderr
    else:  # a hostile name is invalid input
        assert r.returncode == 2 and part in one_line_error(r), r.stdout + r.stderr
    if reshard is not None:
        with pytest.raises(getattr(reshard, cls)) as e:
            reshard.open_checkpoint(str(ck))
        assert part in str(e.value)


@need_py
def test_checksum_mismatch_refuses_the_load(ck):
    f = step_dir(ck) / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 10] ^= 0x01
    f.write_bytes(bytes(data))
    c = reshard.open_checkpoint(str(ck))
    target = reshard.derive_layout(c.model, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    with pytest.raises(reshard.Error) as e:
        reshard.load(c, target, live, comm=reshard.local_communicator())
    msg = str(e.value)
    assert "xxh3 mismatch" in msg and "rank_00000.safetensors" in msg, msg
    assert isinstance(e.value, (reshard.DataLoss, reshard.FailedPrecondition))
    if isinstance(e.value, reshard.FailedPrecondition):
        assert "the live state is unusable" in msg
    else:
        assert untouched(live)


@need_cli
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_convert_under_mpirun_gathers_every_corrupt_piece(ck, tmp_path):
    """convert --verify full (the default) under mpirun: each rank checks a share of the source's
    checksummed pieces and the ranks gather the findings, so the error (printed once, by rank 0)
    counts every corrupt piece, as many as one process finds, and nothing is written."""
    f = step_dir(ck) / "rank_00003.safetensors"
    data = bytearray(f.read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    for at in range(header, len(data), 4096):  # one bit in every 4 KiB of the data: many pieces
        data[at] ^= 0x01
    f.write_bytes(bytes(data))
    one = cli("convert", ck, tmp_path / "out", "--target", "tp=1,dp=2,zero=1")
    n = int(one_line_error(one).split("reshard: error: ")[1].split(" source piece(s) fail their checks")[0])
    assert one.returncode == 2 and n > 1, one.stderr
    r = mpirun(2, "convert", ck, tmp_path / "out", "--target", "tp=1,dp=2,zero=1")
    errors = [x for x in r.stderr.splitlines() if x.startswith("reshard: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
    assert errors[0].startswith(f"reshard: error: {n} source piece(s) fail their checks; nothing was written to"), errors
    assert "rank_00003.safetensors" in errors[0] and "xxh3 mismatch" in errors[0], errors
    assert not (tmp_path / "out").exists()


# ---- topology, model, replicas, budget ---------------------------------------------------------

@need_cli
@pytest.mark.parametrize("target,part", [("tp=3,pp=1,dp=1,zero=1", "tp=3"), ("tp=1,pp=64,dp=1", "pp=64"),
                                         ("tp=1,dp=0", "dp=0"), ("tp=1,zero=7", "zero=7"), ("tp=2,ep=2", "ep=2")])
def test_topology_cannot_hold_the_model(ck, target, part):
    r = cli("plan", ck, "--target", target)
    assert r.returncode == 2, r.stdout + r.stderr
    assert part in one_line_error(r)
    if reshard is not None:
        with pytest.raises(reshard.Error) as e:
            reshard.plan(str(ck), target)
        assert part in str(e.value)
        assert isinstance(e.value, (reshard.InvalidArgument, reshard.Unsupported))


@need_py
def test_world_size_mismatch(ck):
    c = reshard.open_checkpoint(str(ck))
    target = reshard.derive_layout(c.model, "tp=2,dp=1,zero=1")
    with pytest.raises(reshard.InvalidArgument) as e:
        reshard.load(c, target, live_tensors(target, 0), comm=reshard.local_communicator())
    assert "has world size 2 but the communicator has 1 ranks" in str(e.value)


@need_py
@pytest.mark.parametrize("change,part,policy", [
    ({"bias": False}, "not in the model", {}),
    ({"ffn": 96}, "checkpoint shape", {}),
    ({"num_layers": 5}, "not in the checkpoint", {}),
])
def test_model_and_checkpoint_disagree(ck, change, part, policy):
    import yaml
    m = yaml.safe_load(MODEL.read_text())
    m.update(change)
    target = reshard.derive_layout(m, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    with pytest.raises(reshard.InvalidArgument) as e:
        reshard.load(str(ck), target, live, comm=reshard.local_communicator(), policies=policy)
    assert part in str(e.value), str(e.value)
    assert untouched(live)


@need_py
def test_strictness_off_loads_and_reports(ck):
    import yaml
    m = yaml.safe_load(MODEL.read_text())
    m["num_layers"] = m["num_layers"] - 1
    target = reshard.derive_layout(m, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    rep = reshard.load(str(ck), target, live, comm=reshard.local_communicator(),
                       policies={"strict_unexpected": False})
    assert any("ignored (strict_unexpected off)" in p for p in rep["policies"]), rep["policies"]


def differing_replica(ck):
    """Rewrites the checkpoint as a new step whose tp rank 1 copy of one replicated weight differs
    in one low bit, saved through reshard's writer so every checksum is valid: replicas that
    diverged in training, not a damaged file (a piece without its checksum is refused at open)."""
    from safetensors.torch import load_file
    c = reshard.open_checkpoint(str(ck))
    repl = {t["name"] for t in c.inspect()["tensors"] if t["split"] == "replicated"}
    L = c.layout
    files = {r: load_file(str(step_dir(ck) / f"rank_{r:05d}.safetensors")) for r in range(L.world_size)}
    tensors, changed = [], None
    for b in L.buffers:
        t = files[b["rank"]][b["name"]].clone()
        if changed is None and b["rank"] == 1 and b["state"] == "weight" and b["name"].split("/", 1)[1] in repl:
            t.view(torch.int16).view(-1)[0] ^= 1
            changed = b["name"].split("/", 1)[1]
        tensors.append(t)
    assert changed, "no replicated weight on rank 1"
    reshard.save_all_ranks(str(ck), "step-99", L, tensors, state=c.state)
    return changed


@need_py
@need_cli
def test_verify_names_weights_that_differ_from_their_master(ck):
    """A 16-bit weight changed after the save without its fp32 master (edited, or a model file from
    another save), written through reshard's writer so every checksum is valid: `reshard verify`
    compares every tensor's weights with its master rounded to the weight dtype and names the
    tensor, tp rank, element and both values, exit 1. The sound checkpoint passes the same check."""
    j = json.loads(cli("verify", ck, "--json").stdout)
    c = reshard.open_checkpoint(str(ck))
    names = {t["name"] for t in c.inspect()["tensors"]}
    assert j["ok"], j
    assert j["weights_vs_master"]["tensors_checked"] == len(names) and j["weights_vs_master"]["mismatches"] == [], j
    from safetensors.torch import load_file
    L = c.layout
    files = {r: load_file(str(step_dir(ck) / f"rank_{r:05d}.safetensors")) for r in range(L.world_size)}
    edited = "layers.0.mlp.dense_4h_to_h.weight"  # row parallel: tp rank 1 holds columns [ffn/2, ffn)
    tensors, numel = [], None
    for b in L.buffers:
        t = files[b["rank"]][b["name"]].clone()
        if b["rank"] == 1 and b["name"] == "weight/" + edited:
            t.view(torch.int16).view(-1)[3] ^= 1  # one bf16 ulp off the rounded master
            numel = t.numel()
        tensors.append(t)
    assert numel, "no weight buffer of tp rank 1 for " + edited
    reshard.save_all_ranks(str(ck), "step-99", L, tensors, state=c.state)
    r = cli("verify", ck)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("weights differ from master: ")]
    assert len(lines) == 1, r.stdout
    want = (f"weights differ from master: tensor {edited} (tp rank 1): 1 of {numel} weight elements differ from "
            f"the fp32 master rounded to BF16 (first at [0, 3] of the tp rank's shard: weight ")
    assert lines[0].startswith(want), lines[0]
    assert "the model files and the optimizer files disagree" in lines[0], lines[0]
    j = json.loads(cli("verify", ck, "--json").stdout)
    assert not j["ok"] and j["weights_vs_master"]["mismatches"] == [lines[0][len("weights differ from master: "):]]
    # A load with verify="full" refuses it before any write; convert (--verify full by default) too.
    c = reshard.open_checkpoint(str(ck))
    target = reshard.derive_layout(c.model, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    with pytest.raises(reshard.DataLoss) as e:
        reshard.load(c, target, live, comm=reshard.local_communicator(), verify="full")
    assert f"tensor {edited} (tp rank 1): 1 of {numel} weight elements differ" in str(e.value), str(e.value)
    assert untouched(live)
    r = cli("convert", ck, ck.parent / "out", "--target", "tp=1,dp=1,zero=1")
    assert r.returncode == 2 and f"tensor {edited} (tp rank 1)" in one_line_error(r), r.stdout + r.stderr
    assert not (ck.parent / "out").exists()
    # Under mpirun the ranks split the tensors and gather what they found; rank 0 prints it.
    if MPIRUN:
        r = mpirun(2, "convert", ck, ck.parent / "out", "--target", "tp=1,dp=2,zero=1")
        errors = [x for x in r.stderr.splitlines() if x.startswith("reshard: error:")]
        assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
        assert f"tensor {edited} (tp rank 1): 1 of {numel} weight elements differ" in errors[0], errors
        assert not (ck.parent / "out").exists()


@need_py
def test_replicas_that_differ_policies(ck):
    tensor = differing_replica(ck)
    c = reshard.open_checkpoint(str(ck))
    target = reshard.derive_layout(c.model, "tp=1,dp=1,zero=1")
    live = live_tensors(target)
    with pytest.raises(reshard.DataLoss) as e:
        reshard.load(c, target, live, comm=reshard.local_communicator())
    assert tensor in str(e.value) and "max |diff|" in str(e.value), str(e.value)
    assert untouched(live)
    rep = reshard.load(c, target, live, comm=reshard.local_communicator(), policies={"replicas": "first"})
    assert any(tensor in s and "max |diff|" in s for s in rep["replica_report"]), rep["replica_report"]
    first = {k: v.clone() for k, v in live.items()}
    rep = reshard.load(c, target, live, comm=reshard.local_communicator(), policies={"replicas": "average"})
    assert any(tensor in s and "max |diff|" in s for s in rep["replica_report"]), rep["replica_report"]
    # The copies differ in one element by one low bit: only that tensor can change, in one element.
    for k in live:
        diff = (live[k].view(-1) != first[k].view(-1)).sum().item()
        assert diff <= (1 if k == "weight/" + tensor else 0), (k, diff)


@need_py
def test_memory_budget_too_small(ck):
    with pytest.raises(reshard.InvalidArgument) as e:
        reshard.plan(str(ck), "tp=1,dp=1,zero=1", policies={"memory_budget_bytes": 1000})
    assert "memory budget 1000 bytes is below the minimum" in str(e.value)


@need_cli
def test_memory_budget_too_small_cli(ck, tmp_path):
    r = cli("plan", ck, "--target", "tp=1,dp=1,zero=1", "--memory-budget", "1000")
    assert r.returncode == 2 and "memory budget" in one_line_error(r)
    r = cli("convert", ck, tmp_path / "out", "--target", "tp=1,dp=1,zero=1", "--memory-budget", "1000")
    assert r.returncode == 2 and "memory budget" in one_line_error(r)
    assert not (tmp_path / "out" / "latest").exists()


FIXTURES = Path(os.environ.get("RESHARD_DS_FIXTURES", ROOT / "build" / "ds_fixtures"))


def copy_ds_fixture(tmp_path, case):
    """Copies the real DeepSpeed fixture `case` to tmp_path/ck; returns (root, global_step folder).
    Skips the test when the fixtures are not built."""
    src = FIXTURES / case
    if not (FIXTURES / ".complete").exists() or not src.is_dir():
        pytest.skip(f"DeepSpeed fixtures not built in {FIXTURES}")
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst, next(p for p in dst.iterdir() if p.name.startswith("global_step"))


@need_cli
def test_verify_names_a_missing_deepspeed_optimizer_file(tmp_path):
    """One *_optim_states.pt of a DeepSpeed save deleted: `reshard verify` lists the file itself
    under missing (it used to say only "buffer fp32/group0 (rank 7): its data file is missing")."""
    dst, step = copy_ds_fixture(tmp_path, "pipe_pp2_tp2_dp2_z1_fp32")
    gone = step / "zero_pp_rank_1_mp_rank_03_optim_states.pt"
    gone.unlink()
    r = cli("verify", dst)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"missing: missing file: {gone}" in r.stdout, r.stdout
    assert "1 missing file(s)" in r.stdout, r.stdout


@need_py
@pytest.mark.parametrize("variant", ["bfloat16_key", "zero_bool", "stage_string", "no_ds_config"])
def test_deepspeed_folder_without_optimizer_files_is_refused_in_every_config_form(tmp_path, variant):
    """Every *_optim_states.pt gone, with ds_config in the forms DeepSpeed's parser also takes (the
    old "bfloat16" key, zero_optimization: true, a stage string) or no ds_config at all (Megatron's
    args.zero_stage decides): refused, not opened as weights only (each form used to open
    as weights only, and convert wrote an output without optimizer state)."""
    dst, step = copy_ds_fixture(tmp_path, "pipe_pp2_tp2_dp2_z1_bf16_untied_gqa_swiglu")
    for f in step.glob("*optim_states.pt"):
        f.unlink()
    for f in step.glob("mp_rank_*_model_states.pt"):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        cfg = sd["ds_config"]
        if variant == "bfloat16_key":
            cfg["bfloat16"] = cfg.pop("bf16")
            cfg.pop("zero_optimization", None)
            sd["args"].zero_stage = 0
        elif variant == "zero_bool":
            cfg["zero_optimization"] = True
            cfg["bf16"] = {"enabled": False}
            sd["args"].bf16 = False
        elif variant == "stage_string":
            cfg["zero_optimization"] = {"stage": "1"}
            cfg["bf16"] = {"enabled": False}
            sd["args"].bf16 = False
        else:
            sd["ds_config"] = None
            sd["args"].bf16 = False
        torch.save(sd, f)
    with pytest.raises(reshard.DataLoss, match=r"no \*_optim_states.pt files, but") as e:
        reshard.open_checkpoint(str(dst))
    want = {"bfloat16_key": "ds_config bfloat16.enabled=true", "zero_bool": "ds_config zero_optimization stage 1",
            "stage_string": "ds_config zero_optimization stage 1", "no_ds_config": "args.zero_stage=1"}[variant]
    assert want in str(e.value), str(e.value)


def _set_engine_steps(step_folder, steps):
    """Rewrites every model-states file of a DeepSpeed step folder as if an engine at `steps` had
    saved it (global_steps and Megatron's iteration), as an older save's files copied in would be."""
    for f in list(step_folder.glob("mp_rank_*_model_states.pt")) + list(step_folder.glob("zero_pp_rank_*_model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        sd["global_steps"] = steps
        if "iteration" in sd:
            sd["iteration"] = steps
        torch.save(sd, f)


@need_cli
@need_py
def test_model_states_of_another_save_are_refused(tmp_path):
    """An mp_rank_00_model_states.pt of step 2 copied into global_step3 loaded as
    "iteration 2, optimizer step 3" (verify OK, convert exit 0, output named step-2) and the
    trainer replayed a batch. Now refused at open, naming the file: first because DeepSpeed named
    the folder after global_steps, then, in a folder with a tag of its own, because Adam cannot
    have taken more steps than the engine."""
    dst, step = copy_ds_fixture(tmp_path, "pipe_pp2_tp2_dp2_z1_fp32")
    assert step.name == "global_step3"
    _set_engine_steps(step, 2)
    out = tmp_path / "out"
    r = cli("convert", dst, out, "--target", "tp=1,pp=1,dp=2,zero=1")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert f"{step / 'mp_rank_00_model_states.pt'}: global_steps=2 but the folder is global_step3" in line, line
    assert not out.exists() or not any(out.iterdir())
    v = cli("verify", dst)
    assert v.returncode == 1 and "could not be opened" in v.stdout, v.stdout + v.stderr
    # The same files under a tag DeepSpeed did not choose: the optimizer's step count gives it away.
    tagged = step.with_name("before-upgrade")
    step.rename(tagged)
    (dst / "latest").write_text("before-upgrade")
    r = cli("convert", dst, out, "--target", "tp=1,pp=1,dp=2,zero=1")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert "optim_states.pt: the optimizer has taken 3 steps but" in line, line
    assert "records global_steps=2" in line and "come from different saves" in line, line
    # A consistent save under its own tag still opens (the folder name alone is no evidence).
    _set_engine_steps(tagged, 3)
    ck = reshard.open_checkpoint(str(dst))
    assert ck.state["iteration"] == 3 and ck.state["step"] == 3


@need_cli
@pytest.mark.parametrize("case,gone", [("pipe_pp2_tp2_dp2_z1_fp32", "mp_rank_01_model_states.pt"),
                                       ("plain_dp2_z3_fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_missing_model_states_file_is_named_and_no_rank_keeps_its_rng(tmp_path, case, gone):
    """A model-states file gone (tensors all still covered): `verify` names it, also for ZeRO-3's
    per-dp-rank files (it used to say "every file is present"), and a load into the same layout
    carries no rank's RNG stream instead of restoring some and reseeding the others (a ZeRO-3 dp
    rank without its file took dp rank 0's stream), saying so under "not carried over"."""
    dst, step = copy_ds_fixture(tmp_path, case)
    (step / gone).unlink()
    v = cli("verify", dst)
    assert v.returncode == 1, v.stdout + v.stderr
    assert f"missing: missing file: {step / gone} (its ranks' RNG and client state are not available)" in v.stdout, v.stdout
    assert "1 missing file(s)" in v.stdout, v.stdout
    layout = "tp=2,pp=2,dp=2,zero=1" if case.startswith("pipe") else "tp=1,pp=1,dp=2,zero=3"
    out = tmp_path / "out"
    r = cli("convert", dst, out, "--target", layout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"not carried over: per-rank state (RNG) of the save: its model-states file(s) {step / gone} are "
            "missing, so no rank's stream is restored; every rank reseeds") in r.stdout, r.stdout
    meta = json.loads(next(out.glob("*/metadata.json")).read_text())
    assert meta["state"]["per_rank_base64"] == {}, meta["state"]


def swap_files(a, b):
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@need_cli
def test_rank_files_swapped_are_refused_even_where_verify_free_would_not_check(ck, tmp_path):
    """Two native rank files swapped (dp rank 1's optimizer partitions of tp ranks 0 and 1): a tp
    2 -> 4 convert with --verify free cuts those pieces between ranks and used to write rank 3's
    state as rank 2's with exit 0. Each file's header records its rank: refused at open, exit 2,
    nothing written; `verify` reports it (exit 1)."""
    step = step_dir(ck)
    swap_files(step / "rank_00002.safetensors", step / "rank_00003.safetensors")
    out = tmp_path / "out"
    r = cli("convert", ck, out, "--target", "tp=4,pp=1,dp=1,zero=1", "--verify", "free")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    assert f"{step / 'rank_00002.safetensors'}: the file holds the buffers of rank '3'" in line, line
    assert not out.exists() or not any(out.iterdir())
    v = cli("verify", ck)
    assert v.returncode == 1, v.stdout + v.stderr
    assert "the file holds the buffers of rank '3'" in v.stdout + v.stderr


@need_cli
@pytest.mark.parametrize("files", [("layer_03-model_00-model_states.pt", "layer_03-model_01-model_states.pt"),
                                   ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"),
                                   ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")])
def test_deepspeed_files_swapped_are_refused_at_open(tmp_path, files):
    """Two files of a real DeepSpeed save swapped: same shapes, valid CRCs. torch.save named each
    archive's folder after the file it wrote, so the open names the file and what it holds."""
    dst, step = copy_ds_fixture(tmp_path, "pipe_pp2_tp2_dp2_z1_fp32")
    a, b = step / files[0], step / files[1]
    swap_files(a, b)
    out = tmp_path / "out"
    r = cli("convert", dst, out, "--target", "tp=1,pp=1,dp=1,zero=1", "--verify", "off")
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line_error(r)
    first = f"{a}: it was saved as {b.name}" in line or f"{b}: it was saved as {a.name}" in line
    assert first and "renamed, swapped or copied over one another" in line, line
