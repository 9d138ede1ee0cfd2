"""The CLI's contract: exit codes, one-line errors naming the field, and the plan JSON."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("RESHARD_CLI", ROOT / "build" / "bin" / "reshard"))


def run(*args):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


pytestmark = pytest.mark.skipif(not CLI.exists(), reason="build/bin/reshard not built (run scripts/setup.sh)")


def test_version_help_and_unknown_commands():
    """--version names the version and the commit of the build; `help` and `help COMMAND` print
    help and exit 0; an unknown command (or help topic) exits 2 naming it, with the nearest
    command suggested."""
    import re
    r = run("--version")
    assert r.returncode == 0 and re.fullmatch(r"reshard \d+\.\d+\.\d+ \(commit ([0-9a-f]{12}(-dirty)?|unknown)\)\n",
                                              r.stdout), r.stdout
    r = run("help")
    assert r.returncode == 0 and "Subcommands:" in r.stdout, r.stdout
    assert all(c in r.stdout for c in ("plan", "inspect", "verify", "convert", "synth", "diff")), r.stdout
    r = run("help", "convert")
    assert r.returncode == 0 and "convert [OPTIONS] IN [OUT]" in r.stdout and "--target" in r.stdout, r.stdout
    r = run("plna", "x")
    assert r.returncode == 2 and "unknown command 'plna' (did you mean 'plan'?)" in r.stderr, r.stderr
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'; commands: plan," in r.stderr, r.stderr
    r = run("help", "nope")
    assert r.returncode == 2 and "unknown command 'nope'" in r.stderr, r.stderr


def test_step_is_the_step_read_in_every_command(tmp_path):
    """--step names the step read (plan, inspect, verify, convert); --out-step the step folder
    written (convert, synth)."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    for seed, name in ((1, "s1"), (2, "s2")):  # iteration = 1 + seed
        r = run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=1,dp=1,zero=0", "--seed", seed, "--out-step", name)
        assert r.returncode == 0, r.stderr
    assert json.loads(run("inspect", ck, "--json").stdout)["iteration"] == 3  # latest: s2
    assert json.loads(run("inspect", ck, "--step", "s1", "--json").stdout)["iteration"] == 2
    r = run("convert", ck, out, "--target", "tp=1,dp=1,zero=1", "--step", "s1", "--out-step", "conv")
    assert r.returncode == 0, r.stderr
    j = json.loads(run("inspect", out, "--step", "conv", "--json").stdout)
    assert j["iteration"] == 2 and j["layout"].endswith("zero=1"), j["layout"]


def test_synth_and_convert_json(tmp_path):
    """synth --json and convert --json print one JSON object on stdout: what was written, and for
    convert the change, bytes and what no check covered (one process; under mpirun the load
    report)."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    r = run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=2,dp=1,zero=1", "--seed", 4, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["output"] == str(ck / "step-5") and j["ranks"] == 2 and j["iteration"] == 5 and j["state_bytes"] > 0, j
    r = run("convert", ck, out, "--target", "tp=4,dp=1,zero=1", "--json", "--verify", "free")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)  # the warning about unchecked bytes goes to stderr, not into the JSON
    assert j["output"] == str(out / "step-5") and j["change"] == "tp 2->4, ZeRO-1 partitions re-cut", j
    assert j["writer"] == "native" and j["verify"] == "free" and 0 < j["bytes_unchecked"] <= j["bytes_read"], j
    assert "left" in r.stderr and "unchecked" in r.stderr, r.stderr
    assert json.loads(run("inspect", out, "--json").stdout)["layout"] == "tp=4,pp=1,vpp=1,dp=1,zero=1"


def test_plan_gpt3_175b_json_has_job_totals():
    r = run("plan", "--model", ROOT / "configs/models/gpt3-175b.yaml", "--source", "tp=8,pp=16,dp=8,zero=1",
            "--target", "tp=4,pp=8,dp=32,zero=1", "--json")
    assert r.returncode == 0, r.stderr
    assert "tp 8->4, pp 16->8, dp 8->32, ZeRO-1 partitions re-cut" in r.stderr
    j = json.loads(r.stdout)
    assert j["source_world_size"] == 1024 and j["target_world_size"] == 1024
    # 175B parameters: bf16 weights (2 bytes) + fp32 master, exp_avg, exp_avg_sq (12 bytes), read once.
    params = j["bytes_needed"] / 14
    assert 174e9 < params < 176e9, params
    assert j["bytes_to_read"] == j["bytes_needed"]
    assert j["bytes_to_exchange"] > 0
    assert 0 < j["peak_staging_bytes_per_rank"] <= 2**30
    assert j["plan_seconds"] > 0


def test_plan_text_output_names_the_change():
    r = run("plan", "--model", "tiny-gpt", "--source", "tp=2,pp=2,dp=2,zero=1", "--target", "tp=1,pp=2,dp=4,zero=1")
    assert r.returncode == 0, r.stderr
    assert "tp 2->1, dp 2->4" in r.stdout


@pytest.mark.parametrize("layout,needle", [
    ("tp=0,dp=2", "layout field tp=0 must be >= 1"),
    ("tp=2,foo=3", "unknown key 'foo'"),
    ("tp=two", "tp='two' is not an integer"),
    ("tp=3,dp=1", "not divisible by tp"),
    ("tp=1,pp=8,dp=1", "pp*vpp=8 > num_layers=4"),
    # Uneven stages need a partition (--target-stages, or the hook's engine); without one, said so.
    ("tp=1,pp=3,dp=1", "num_layers=4 is not divisible by pp*vpp=3 (reshard's own split of the layers is uniform"),
    ("tp=8,dp=1", "tp=8 > query_groups=4"),
    ("tp=1,pp=2,dp=2,zero=3", "ZeRO stage 2 or 3 with pipeline"),
])
def test_bad_topology_is_one_line_exit_2(layout, needle):
    r = run("plan", "--model", "tiny-gpt", "--source", "tp=1,dp=1", "--target", layout)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("reshard: error:")
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("layout,needle", [
    ("tp=3,dp=1", "heads=8 is not divisible by tp"),
    ("tp=1,pp=8,dp=1", "pp*vpp=8 > num_layers=4"),
    ("tp=8,dp=1", "tp=8 > query_groups=4"),
])
def test_convert_names_the_same_field_as_plan(tmp_path, layout, needle):
    ck = tmp_path / "ck"
    assert run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=1,dp=1,zero=1").returncode == 0
    for args in (("plan", "--model", "tiny-gpt", "--source", "tp=1,dp=1", "--target", layout),
                 ("convert", ck, tmp_path / "out", "--target", layout)):
        r = run(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
    assert not (tmp_path / "out").exists()


def test_uneven_target_stages_plan_convert_and_read_back(tmp_path):
    """--target-stages 1,2,1 puts tiny-gpt's 4 layers on 3 stages as given (DeepSpeed's
    PipelineModule makes such splits); the converted checkpoint holds every value of the source
    (diff) and converts back; bad sizes are one-line errors naming the rule."""
    ck = tmp_path / "ck"
    assert run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=2,pp=2,dp=1,zero=1").returncode == 0
    r = run("plan", ck, "--target", "tp=1,pp=3,dp=2,zero=1", "--target-stages", "1,2,1", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["target_world_size"] == 6
    out = tmp_path / "out"
    r = run("convert", ck, out, "--target", "tp=1,pp=3,dp=1,zero=1", "--target-stages", "1,2,1")
    assert r.returncode == 0, r.stderr
    info = json.loads(run("inspect", out, "--json").stdout)
    assert info["layout"].startswith("tp=1,pp=3,")
    meta = json.loads(next(out.glob("step-*/metadata.json")).read_text())
    ranks_of_layer = {}  # layer -> ranks holding its weights (tp=dp=1: rank = pipeline stage)
    for b in meta["buffers"]:
        if b["name"].startswith("weight/layers."):
            ranks_of_layer.setdefault(int(b["name"].split(".")[1]), set()).add(b["rank"])
    assert ranks_of_layer == {0: {0}, 1: {1}, 2: {1}, 3: {2}}, ranks_of_layer
    r = run("diff", ck, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert run("verify", out).returncode == 0
    back = tmp_path / "back"
    assert run("convert", out, back, "--target", "tp=2,pp=2,dp=1,zero=1").returncode == 0
    assert run("diff", ck, back).returncode == 0
    # Where pp stays, the source's own split is kept without --target-stages (a tp change of a
    # DeepSpeed job split 1+2+1 resumes on the same stages).
    wide = tmp_path / "wide"
    r = run("convert", out, wide, "--target", "tp=2,pp=3,dp=1,zero=1")
    assert r.returncode == 0, r.stderr
    ranks_of_layer = {}
    for b in json.loads(next(wide.glob("step-*/metadata.json")).read_text())["buffers"]:
        if b["name"].startswith("weight/layers."):
            ranks_of_layer.setdefault(int(b["name"].split(".")[1]), set()).add(b["rank"])
    assert ranks_of_layer == {0: {0, 1}, 1: {2, 3}, 2: {2, 3}, 3: {4, 5}}, ranks_of_layer
    assert run("diff", ck, wide).returncode == 0
    assert run("plan", out, "--target", "tp=1,pp=3,dp=2,zero=1").returncode == 0
    for sizes, needle in (("2,1", "layers per stage has 2 entries for pp=3"),
                          ("2,1,2", "layers per stage sum to 5 but the model has num_layers=4"),
                          ("3,2,-1", "stage 2 has -1 layers")):
        for cmd in (("plan", ck), ("convert", ck, tmp_path / f"bad{len(needle)}")):
            r = run(*cmd, "--target", "tp=1,pp=3,dp=1,zero=1", "--target-stages", sizes)
            assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (cmd, r.stderr)
    r = run("plan", ck, "--target", "tp=1,pp=2,vpp=2,dp=1,zero=1", "--target-stages", "2,2")
    assert r.returncode == 2 and "vpp=1" in r.stderr, r.stderr


def test_convert_checks_every_source_piece_unless_told_otherwise_and_then_warns(tmp_path):
    ck = tmp_path / "ck"
    assert run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=1,dp=1,zero=1").returncode == 0
    (f,) = ck.glob("step-*/rank_00000.safetensors")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a piece that tp=2 cuts between its two ranks
    f.write_bytes(bytes(data))
    r = run("convert", ck, tmp_path / "out_full", "--target", "tp=2,dp=1,zero=1")  # default --verify full
    assert r.returncode == 2, r.stdout + r.stderr
    assert "fail their checks; nothing was written" in r.stderr and "xxh3 mismatch" in r.stderr, r.stderr
    assert not (tmp_path / "out_full").exists()
    r = run("convert", ck, tmp_path / "out_free", "--target", "tp=2,dp=1,zero=1", "--verify", "free")
    assert r.returncode == 0, r.stderr
    assert "warning: --verify free left" in r.stderr and " read unchecked against the source" in r.stderr, r.stderr
    r = run("convert", ck, tmp_path / "out_bogus", "--target", "tp=2,dp=1,zero=1", "--verify", "bogus")
    assert r.returncode == 2 and "bogus" in r.stderr


def test_synth_refuses_a_negative_seed(tmp_path):
    # CLI11 would read -5 into the unsigned seed as 2^64 - 5.
    r = run("synth", tmp_path / "ck", "--model", "tiny-gpt", "--layout", "tp=1", "--seed", "-5")
    assert r.returncode == 2 and "--seed: must be >= 0, got -5" in r.stderr, r.stderr
    assert not (tmp_path / "ck").exists()


def test_one_process_convert_warns_about_pieces_a_zero_re_cut_leaves_unchecked(tmp_path):
    """tp=2,dp=3 -> tp=1,dp=3 in one process re-cuts ZeRO partitions inside
    pieces, which "free" cannot check, but the warning was computed as "read minus checked" and the
    replica comparisons' checked reads made up the difference: a corrupted byte reached the output
    with no warning. The warning now counts the fragments no check covers."""
    model = tmp_path / "m.yaml"
    model.write_text("name: t\nnum_layers: 2\nhidden: 64\nffn: 256\nheads: 4\nvocab: 512\nvocab_divisible_by: 64\n"
                     "max_position_embeddings: 32\ntied_embeddings: true\nparam_dtype: bf16\noptimizer: adam\n")
    ck = tmp_path / "ck"
    assert run("synth", ck, "--model", model, "--layout", "tp=2,pp=1,dp=3,zero=1", "--seed", "5").returncode == 0
    r = run("convert", ck, tmp_path / "free", "--target", "tp=1,pp=1,dp=3,zero=1", "--verify", "free")
    assert r.returncode == 0, r.stderr
    assert "warning: --verify free left 51.1 KB of the 1.89 MB read unchecked" in r.stderr, r.stderr
    r = run("convert", ck, tmp_path / "full", "--target", "tp=1,pp=1,dp=3,zero=1")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # A merge that reads every piece whole leaves nothing unchecked: no warning.
    r = run("convert", ck, tmp_path / "merge", "--target", "tp=1,pp=1,dp=1,zero=1", "--verify", "free")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.mark.parametrize("budget,says", [
    ("18446744073709551616", "is too large"), ("18446744073709551615GiB", "is too large"),
    ("1e30GiB", ": unknown unit 'e30GiB'"), ("inf", "is not a size"), (" 65536", "is not a size"),
    ("-65536", "is not a size"), ("65536.5", "is not a whole number of bytes"),
    ("1.0001MiB", "is not a whole number of bytes"), ("0", "must be positive"), ("0.0GiB", "must be positive")])
def test_sizes_are_parsed_exactly_or_refused(budget, says):
    """Sizes are parsed in integers. A 2^64 used to wrap (it became "memory budget 0 bytes
    is below the minimum"), and parsing through a double took "4096.5", " 4096" and 2^53 + 1."""
    r = run("plan", "--model", ROOT / "configs/models/tiny-gpt.yaml", "--source", "tp=1", "--target", "tp=2",
            "--memory-budget", budget)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--memory-budget '{budget}'{'' if says.startswith(':') else ' '}{says}" in r.stderr, r.stderr


def test_sizes_with_a_fraction_and_a_unit_are_whole_bytes():
    r = run("plan", "--model", ROOT / "configs/models/tiny-gpt.yaml", "--source", "tp=1", "--target", "tp=2",
            "--memory-budget", "1.5MiB", "--json")
    assert r.returncode == 0, r.stderr
    r = run("bench", "memcpy", "--bytes", "1.5KiB", "--repeat", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["bytes"] == 1536, r.stdout + r.stderr


@pytest.mark.parametrize("args,says", [
    (["memcpy", "--bytes", "18446744073709549568"], "cannot allocate 18446744073709549568 bytes"),
    (["memcpy", "--bytes", "1MiB", "--threads", "100000"], "not in range 1 to 1024"),
    (["read-ceiling", "FILE", "--small-buffer", "--small", "18446744073709549568"], "cannot allocate"),
    (["read-ceiling", "FILE", "--chunk", "1000"], "must be a positive multiple of 4096 bytes"),
    (["read-ceiling", "FILE", "--chunk", "9007199254740993"], "must be a positive multiple of 4096 bytes")])
def test_bench_ceilings_refuse_sizes_and_threads_they_cannot_use(tmp_path, args, says):
    """What used to crash both ceilings: a size that wrapped to 0 when rounded up to a page
    (segfault), an allocation failing inside a worker thread and 100000 threads (aborts)."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 10000)
    r = run("bench", *[str(f) if a == "FILE" else a for a in args])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert says in r.stderr, r.stderr


def test_bad_model_file_names_field(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\nnum_layers: 2\nhidden: 64\nheads: 6\nvocab: 100\n")
    r = run("plan", "--model", bad, "--source", "tp=1", "--target", "tp=1")
    assert r.returncode == 2
    assert "hidden=64 must be divisible by heads=6" in r.stderr
    bad.write_text("name: x\nnum_layer: 2\n")
    r = run("plan", "--model", bad, "--source", "tp=1", "--target", "tp=1")
    assert r.returncode == 2 and "unknown field 'num_layer'" in r.stderr
    bad.write_text("name: x\nnum_layers: 2\nhidden: 64\nheads: 8\nvocab: 100\nrules:\n  - {pattern: 'nothing\\.matches', split: row}\n")
    r = run("plan", "--model", bad, "--source", "tp=1", "--target", "tp=2")
    assert r.returncode == 2 and "matches no tensor" in r.stderr


def test_missing_model_file_exit_2():
    r = run("plan", "--model", "/nonexistent/model.yaml", "--source", "tp=1", "--target", "tp=1")
    assert r.returncode == 2 and "/nonexistent/model.yaml" in r.stderr


def test_text_read_from_files_prints_on_one_line(tmp_path):
    """A model name holding a newline (a YAML "\\n") is stored as given; synth, inspect and verify
    print it escaped, so it cannot forge a line of their reports (a 'problem:' line here)."""
    yaml = (ROOT / "configs/models/tiny-gpt.yaml").read_text()
    lines = [('name: "tiny\\nproblem: forged"' if l.startswith("name:") else l) for l in yaml.splitlines()]
    model = tmp_path / "nl.yaml"
    model.write_text("\n".join(lines) + "\n")
    ck = tmp_path / "ck"
    outs = [run("synth", ck, "--model", model, "--layout", "tp=1,dp=1,zero=0")]
    outs += [run("inspect", ck), run("verify", ck)]
    for r in outs:
        assert r.returncode == 0, r.stderr
        assert not any(l.startswith("problem: forged") for l in r.stdout.splitlines()), r.stdout
    assert "model tiny\\x0aproblem: forged" in outs[0].stdout
    assert "model tiny\\x0aproblem: forged" in outs[1].stdout
    assert json.loads(run("inspect", ck, "--json").stdout)["model"]["name"] == "tiny\nproblem: forged"


def test_odd_latest_files_and_file_size_limit_get_clear_errors(tmp_path):
    """A `latest` linked to a long file printed 4 KB of it; a `latest` folder was
    reported as "no `latest` file"; under `ulimit -f` synth died of SIGXFSZ with no message."""
    ck = tmp_path / "ck"
    assert run("synth", ck, "--model", "tiny-gpt", "--layout", "tp=1,dp=1,zero=0").returncode == 0
    (ck / "latest").unlink()
    (tmp_path / "long.txt").write_text("x" * 3000)
    (ck / "latest").symlink_to(tmp_path / "long.txt")
    r = run("inspect", ck)
    assert r.returncode == 2 and "(3000 bytes, cut)" in r.stderr and len(r.stderr) < 600, r.stderr
    (ck / "latest").unlink()
    (ck / "latest").mkdir()
    r = run("inspect", ck)
    assert r.returncode == 2 and "latest is not a regular file" in r.stderr, r.stderr
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, 100 << 10))

    r = subprocess.run([str(CLI), "synth", tmp_path / "big", "--model", "tiny-gpt", "--layout", "tp=1,dp=1,zero=0"],
                       capture_output=True, text=True, timeout=120, preexec_fn=small_files)
    assert r.returncode == 2 and "File too large" in r.stderr and "rank_00000.safetensors" in r.stderr, r.stderr


def _on_a_terminal(*args, timeout=300):
    """Runs the CLI with stdout and stderr on a pseudo-terminal; returns (exit code, what it printed)."""
    import pty
    import select
    main, sub = pty.openpty()
    p = subprocess.Popen([str(CLI), *map(str, args)], stdout=sub, stderr=sub, stdin=subprocess.DEVNULL, close_fds=True)
    os.close(sub)
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], timeout)
        if not ready:
            p.kill()
            raise AssertionError(f"no output for {timeout} s: {out[-2000:]!r}")
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    return p.wait(timeout=timeout), out.decode(errors="replace")


def test_progress_on_a_terminal_only_and_nothing_under_quiet(tmp_path):
    """convert and verify draw one line per stage (and a bar for the bytes copied) on a terminal,
    nothing of it when the output is a pipe, and under --quiet (before or after the subcommand)
    print nothing at all on success."""
    src = tmp_path / "src"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=2,pp=2,dp=1,zero=1").returncode == 0
    code, out = _on_a_terminal("convert", src, tmp_path / "a", "--target", "tp=1,pp=1,dp=2,zero=1")
    assert code == 0, out
    import re
    stages = re.findall(r"\r  ([a-z]+)[^\r\n]*? \d+\.\d\d s\x1b\[K", out)  # each stage's finished line
    assert stages == ["open", "plan", "checksums", "weights", "read", "write"], out
    assert re.search(r"read and copy +\[#{24}\] 100%", out), out
    assert "wrote " in out, out
    code, out = _on_a_terminal("verify", tmp_path / "a")
    assert code == 0 and "\r  checksums" in out and "OK: every checksum matches" in out, out
    # A pipe: the summary, no progress.
    r = run("convert", src, tmp_path / "b", "--target", "tp=1,pp=1,dp=2,zero=1")
    assert r.returncode == 0 and "\r" not in r.stderr + r.stdout and "wrote " in r.stdout, r.stderr
    for args in (["--quiet", "convert", src, tmp_path / "c", "--target", "tp=1,pp=1,dp=2,zero=1"],
                 ["convert", src, tmp_path / "d", "--target", "tp=1,pp=1,dp=2,zero=1", "-q"],
                 ["verify", tmp_path / "a", "--quiet"]):
        code, out = _on_a_terminal(*args)
        assert code == 0 and out == "", (args, out)
    assert (tmp_path / "c" / "latest").is_file() and (tmp_path / "d" / "latest").is_file()
    # --quiet does not hide a failure.
    code, out = _on_a_terminal("--quiet", "verify", tmp_path / "missing")
    assert code == 2 and "does not exist" in out, out


def test_plan_and_convert_take_a_resume_config(tmp_path):
    """plan --config plans what a trainer reading the config would load (its checkpoint, target,
    verify and policies) and adds per-rank live memory and a read time estimate; convert --config
    writes that target with the config's policies; flags the config also sets are refused."""
    src = tmp_path / "src"
    assert run("synth", src, "--model", "tiny-gpt", "--layout", "tp=2,pp=1,dp=1,zero=1").returncode == 0
    cfg = tmp_path / "resume.yaml"
    cfg.write_text(f"checkpoint:\n  root: {src}\ntarget: tp=1,pp=1,dp=4,zero=1\nverify: off\n"
                   "policies:\n  replicas: first\n  memory_budget_bytes: 65536\n")
    r = run("plan", "--config", cfg, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["target_layout"] == "tp=1,pp=1,vpp=1,dp=4,zero=1" and j["verify"] == "off" and j["config"] == str(cfg)
    assert any("policy first" in n for n in j["notes"]), j["notes"]
    assert j["num_waves"] > 1  # the config's 64 KiB budget
    assert j["live_bytes_total"] == j["target_bytes"]
    assert j["target_bytes"] / 4 <= j["live_bytes_per_rank_max"] < j["target_bytes"]
    assert 0 < j["read_bytes_per_rank_max"] <= j["bytes_to_read"]
    assert j["read_rate_sample_bytes"] > 0 and j["read_rate_bytes_per_second"] > 0
    assert j["estimated_read_seconds"] == pytest.approx(j["read_bytes_per_rank_max"] / j["read_rate_bytes_per_second"])
    r = run("plan", "--config", cfg, "--json", "--no-read-rate")
    assert r.returncode == 0 and "estimated_read_seconds" not in json.loads(r.stdout)
    r = run("plan", "--config", cfg)
    assert r.returncode == 0 and "live state per rank: up to " in r.stdout and "estimated read time " in r.stdout
    for extra, flag in ((["--target", "tp=2"], "--target"), ([src], "PATH"), (["--memory-budget", "1GiB"], "--memory-budget")):
        r = run("plan", "--config", cfg, *extra)
        assert r.returncode == 2 and f"{flag} cannot be given with it" in r.stderr, r.stderr
    r = run("plan", src)
    assert r.returncode == 2 and "plan needs --target LAYOUT (or --config FILE)" in r.stderr, r.stderr
    # convert --config OUT: the config's target and policies (verify off: no checksum pass).
    out = tmp_path / "out"
    r = run("convert", "--config", cfg, out, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["target_layout"] == "tp=1,pp=1,vpp=1,dp=4,zero=1" and j["verify"] == "off" and j["waves"] > 1
    assert any("policy first" in n for n in j["notes"]), j["notes"]
    r = run("diff", src, out)
    assert r.returncode == 0 and " 0 differ" in r.stdout, r.stdout
    for extra, flag in ((["--verify", "free"], "--verify"), (["--target", "tp=2"], "--target")):
        r = run("convert", "--config", cfg, tmp_path / "o2", *extra)
        assert r.returncode == 2 and f"{flag} cannot be given with it" in r.stderr, r.stderr
    r = run("convert", "--config", cfg, src, tmp_path / "o3")
    assert r.returncode == 2 and "give only OUT" in r.stderr, r.stderr
    r = run("convert", src, "--target", "tp=1")
    assert r.returncode == 2 and "convert needs IN and OUT" in r.stderr, r.stderr
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
