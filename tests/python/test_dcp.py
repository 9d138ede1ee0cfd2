"""torch.distributed.checkpoint (DCP) folders as a source, loaded into live FSDP2 / DTensor modules.

The checkpoints are written by real torch DCP (FSDP2 with AdamW under torchrun, gloo on CPU, see
dcp_job.py): an FSDP2 job at dp=4 and a (dp=2, tp=2) DTensor mesh. Each is loaded with
reshard.torch.load at other world sizes and meshes; every weight, exp_avg, exp_avg_sq and step
must equal the saving job's own full tensors bitwise (which equal what dcp.load restores, checked
here too), and the next optimizer step must match the uninterrupted run's. Then damaged folders:
each refused by name before any write.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import reshard
import reshard.torch as rt

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "dcp_job.py")
sys.path.insert(0, HERE)
import dcp_job  # noqa: E402


def torchrun(n, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), JOB,
           *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for mesh in ("fsdp", "tp2"):
        d = root / mesh
        d.mkdir()
        torchrun(4, "save", str(d), "3", mesh)
        out[mesh] = d
    return out


def test_reference_is_what_dcp_load_restores(saved):
    """The saving job's own full tensors (the tests' reference) equal dcp.load's, bitwise."""
    import torch.distributed.checkpoint as dcp
    for d in saved.values():
        ref = torch.load(d / "reference.pt")
        sd = {"model": {k[len("weight/"):]: torch.empty_like(v) for k, v in ref.items() if k.startswith("weight/")}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=str(d / "ckpt"))
        assert len(sd["model"]) == 16
        for k, v in sd["model"].items():
            assert torch.equal(v, ref["weight/" + k]), k


@pytest.mark.slow
@pytest.mark.parametrize("src,world,mesh", [
    ("fsdp", 3, "fsdp"), ("fsdp", 2, "fsdp"), ("fsdp", 1, "fsdp"), ("fsdp", 8, "fsdp"),
    ("tp2", 4, "fsdp"),   # (dp=2, tp=2) -> (dp=4, tp=1)
    ("tp2", 4, "tp4"),    # (dp=2, tp=2) -> (dp=1, tp=4)
    ("fsdp", 4, "tp2"),   # FSDP2 only -> a 2-D mesh
])
def test_load_into_live_module(saved, tmp_path, src, world, mesh):
    result = tmp_path / "result.json"
    torchrun(world, "load", str(saved[src]), mesh, str(result))
    r = json.loads(result.read_text())
    assert r["world"] == world
    assert r["compared"] == 16 * 4  # weights, exp_avg, exp_avg_sq, step of every parameter
    assert r["mismatched"] == []
    assert r["step_set"] == 3.0
    assert r["next_step_max_abs_diff"] <= 1e-6
    assert r["checksums_verified"] > 0
    assert "re-cut box by box" in r["change"]


def plain_model():
    torch.manual_seed(1)
    m = dcp_job.Tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def test_one_process_load_and_inspect(saved):
    """No process group: the module is whole on one rank; the CLI reads the same folder."""
    m, opt = plain_model()
    report = rt.load(m, opt, saved["fsdp"] / "ckpt")
    ref = torch.load(saved["fsdp"] / "reference.pt")
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), ref[f"weight/{n}"]), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref[f"exp_avg_sq/{n}"]), n
        assert opt.state[p]["step"].item() == 3.0
    assert report["bytes_read"] == report["bytes_needed"]
    ck = reshard.open_checkpoint(str(saved["fsdp"] / "ckpt"))
    assert ck.writer == "dcp"
    values = json.loads(ck.state["json"])["dcp"]["values"]
    assert values["optim.param_groups.0.lr"] == 0.01
    assert any("model tensors under 'model.'" in n for n in ck.notes)
    p = subprocess.run([sys.executable, "-m", "_reshard_cli", "verify", str(saved["fsdp"] / "ckpt")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "OK: every checksum matches" in p.stdout, p.stdout + p.stderr


def copy_ckpt(saved, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(saved["fsdp"] / "ckpt", d)
    return d


def read_metadata(d):
    import torch.distributed.checkpoint  # noqa: F401 - the classes the pickle names
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file, written by torch above


def write_metadata(d, md):
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def unchanged_after(fn):
    """Runs fn(model, optimizer) expecting an error; returns it after checking no value moved."""
    m, opt = plain_model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(reshard.Error) as e:
        fn(m, opt)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} was written before the error"
    return e


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/reshard_dcp_pwned",))


def test_foreign_pickle_global_is_refused_never_run(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    md = read_metadata(d)
    md.planner_data = Evil()
    write_metadata(d, md)
    if os.path.exists("/tmp/reshard_dcp_pwned"):
        os.remove("/tmp/reshard_dcp_pwned")
    e = unchanged_after(lambda m, o: rt.load(m, o, d))
    assert isinstance(e.value, reshard.InvalidArgument)
    assert "system" in str(e.value) and "not a DCP metadata class" in str(e.value)
    assert not os.path.exists("/tmp/reshard_dcp_pwned")


def test_truncated_data_file_is_named(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    f = d / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    e = unchanged_after(lambda m, o: rt.load(m, o, d))
    assert isinstance(e.value, reshard.DataLoss)
    assert "__1_0.distcp" in str(e.value)


def test_overlapping_chunks_are_refused(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    md = read_metadata(d)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    key = "model.emb.weight"
    c = md.state_dict_metadata[key].chunks[1]
    old = MetadataIndex(key, c.offsets)
    c.offsets = torch.Size([5, 0])  # rows [5, 15) now overlap rows [0, 10)
    md.storage_data[MetadataIndex(key, c.offsets)] = md.storage_data[old]
    write_metadata(d, md)
    e = unchanged_after(lambda m, o: rt.load(m, o, d))
    assert isinstance(e.value, reshard.DataLoss)
    assert "overlap" in str(e.value) and key in str(e.value)


def test_missing_data_file_names_uncovered_elements(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    os.remove(d / "__2_0.distcp")
    ck = reshard.open_checkpoint(str(d))
    assert any(n.startswith("missing file: ") and "__2_0.distcp" in n for n in ck.notes)
    e = unchanged_after(lambda m, o: rt.load(m, o, d))
    assert isinstance(e.value, reshard.DataLoss)
    assert "covered by no" in str(e.value) or "no available source" in str(e.value) or "uncovered" in str(e.value), \
        str(e.value)
    assert "emb.weight" in str(e.value)


def test_damaged_chunk_fails_its_checksum(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    md = read_metadata(d)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    info = md.storage_data[MetadataIndex("model.head.weight", torch.Size([0, 0]))]
    f = d / info.relative_path
    raw = bytearray(f.read_bytes())
    import io
    import struct
    import zipfile
    arc = bytes(raw[info.offset:info.offset + info.length])
    e = next(i for i in zipfile.ZipFile(io.BytesIO(arc)).infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", arc[e.header_offset + 26:e.header_offset + 30])
    raw[info.offset + e.header_offset + 30 + name_len + extra_len + 4] ^= 0xFF  # a byte of the chunk's values
    f.write_bytes(bytes(raw))
    e = unchanged_after(lambda m, o: rt.load(m, o, d, verify="full"))
    assert isinstance(e.value, reshard.DataLoss)
    assert "CRC-32" in str(e.value)


class Smaller(dcp_job.Tiny):
    """The test model without its 3-element parameter `tiny`."""

    def __init__(self):
        super().__init__()
        del self.tiny


def test_module_that_lacks_a_tensor_is_refused(saved):
    m = Smaller()
    with pytest.raises(reshard.InvalidArgument, match="tiny"):
        rt.load(m, torch.optim.AdamW(m.parameters()), saved["fsdp"] / "ckpt")


def test_load_state_dict_like_dcp_load(saved):
    """The dcp.load shape: a nested dict of tensors keyed as saved, filled in place."""
    ref = torch.load(saved["fsdp"] / "reference.pt")
    names = [k[len("weight/"):] for k in ref if k.startswith("weight/")]
    sd = {"model": {n: torch.zeros_like(ref[f"weight/{n}"]) for n in names},
          "optim": {"state": {n: {"exp_avg": torch.zeros_like(ref[f"exp_avg/{n}"]),
                                  "exp_avg_sq": torch.zeros_like(ref[f"exp_avg_sq/{n}"]),
                                  "step": torch.tensor(0.0)} for n in names}}}
    rt.load_state_dict(sd, saved["fsdp"] / "ckpt")
    for n in names:
        assert torch.equal(sd["model"][n], ref[f"weight/{n}"]), n
        assert torch.equal(sd["optim"]["state"][n]["exp_avg"], ref[f"exp_avg/{n}"]), n
        assert sd["optim"]["state"][n]["step"].item() == 3.0


def test_plain_dcp_save_of_any_keys_and_dtypes(tmp_path):
    """dcp.save of a flat dict in one process (no FSDP): bf16, int64 and fp16 tensors, keys with
    no model prefix, one with "state" in its name; read back bitwise into another dict."""
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(5)
    src = {"enc.state.proj": torch.randn(5, 3, generator=g).to(torch.bfloat16),
           "ids": torch.arange(7, dtype=torch.int64) * 3,
           "half": torch.randn(4, generator=g).half()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(src, checkpoint_id=str(tmp_path / "ck"))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    report = rt.load_state_dict(dst, tmp_path / "ck")
    for k in src:
        assert dst[k].dtype == src[k].dtype and torch.equal(dst[k], src[k]), k
    assert report["bytes_read"] == report["bytes_needed"] == sum(v.numel() * v.element_size() for v in src.values())


def test_optimizers_whose_state_is_not_adams_are_refused(saved):
    """NAdam keeps mu_product and Adamax exp_inf: a checkpoint of step, exp_avg, exp_avg_sq cannot
    restore them, so they are refused by name, before any write."""
    for cls in (torch.optim.NAdam, torch.optim.Adamax, torch.optim.SGD):
        e = unchanged_after(lambda m, o, cls=cls: rt.load(m, cls(m.parameters(), lr=1e-3), saved["fsdp"] / "ckpt"))
        assert isinstance(e.value, reshard.InvalidArgument) and cls.__name__ in str(e.value)


def test_missing_step_counter_is_refused(saved, tmp_path):
    d = copy_ckpt(saved, tmp_path)
    md = read_metadata(d)
    del md.state_dict_metadata["optim.state.head.bias.step"]
    write_metadata(d, md)
    e = unchanged_after(lambda m, o: rt.load(m, o, d))
    assert isinstance(e.value, reshard.InvalidArgument)
    assert "no optimizer step counter for head.bias" in str(e.value)


def test_weights_only_still_refuses_a_weight_the_module_lacks(saved):
    m = Smaller()
    with pytest.raises(reshard.InvalidArgument, match="tiny"):
        rt.load(m, None, saved["fsdp"] / "ckpt")
    report = rt.load(m, None, saved["fsdp"] / "ckpt", policies={"strict_unexpected": False})
    ref = torch.load(saved["fsdp"] / "reference.pt")
    assert torch.equal(m.head.weight.detach(), ref["weight/head.weight"])
    assert report["step_set"] is None
