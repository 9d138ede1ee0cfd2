"""reshard.integrations.megatron_deepspeed outside a trainer: the model description it builds from a Megatron(-DeepSpeed)
`args` Namespace equals the one the DeepSpeed reader builds from the same `args` saved in
upstream's files (tests/data/upstream_mds), names map as upstream's modules name parameters, and
the fused QKV order is read off the live attention code."""

import argparse
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the reference trainer (integration/); reshard is the installed package
import reshard  # noqa: E402
import reshard.integrations.megatron_deepspeed as RM  # noqa: E402

DATA = os.path.join(REPO, "tests", "data", "upstream_mds")
CASES = ["head_tp2pp2_fp32", "head_tp2pp2_bf16", "pre_fpdt_tp2pp2_fp32", "pre_fpdt_gqa_tp2pp2_fp32"]
FIELDS = ["num_layers", "hidden", "ffn", "heads", "query_groups", "vocab", "swiglu", "tied_embeddings", "bias",
          "norm", "qkv_order", "qkv_version"]


def saved_args(case):
    ck = reshard.open_checkpoint(os.path.join(DATA, case))
    g = json.loads(ck.state["json"])
    return ck, argparse.Namespace(**g["args"]["state"]), g


@pytest.mark.parametrize("case", CASES)
def test_model_from_args_equals_the_readers(case):
    if not os.path.isdir(os.path.join(DATA, case)):
        pytest.skip(f"{case} not in tests/data/upstream_mds")
    ck, args, g = saved_args(case)
    order = "blocked" if hasattr(args, "ds_sequence_parallel_fpdt") else "interleaved"
    mine = RM.model_config_from_args(args, vocab_size=g["universal_checkpoint_info"]["original_vocab_size"],
                                     qkv_order=order)
    want = ck.inspect()["model"]
    m = reshard.model_config(mine)
    got = {"query_groups": m.query_groups, "param_dtype": m.param_dtype, "padded_vocab": m.padded_vocab(2)}
    for f in FIELDS:
        assert got.get(f, mine[f]) == want[f], (case, f, got.get(f, mine[f]), want[f])
    assert (m.param_dtype, m.padded_vocab(2)) == (want["param_dtype"], want["padded_vocab"])
    # The description lays out exactly the saved tensors, at the same global shapes (positions,
    # biases, head): the reader's tensor list is the files'.
    shapes = {t["name"]: tuple(t["shape"]) for t in reshard.model_tensors(m, 2)}
    assert shapes == {t["name"]: tuple(t["shape"]) for t in ck.inspect()["tensors"]}


def test_model_from_args_refuses_what_it_cannot_map():
    _, args, _ = saved_args("head_tp2pp2_fp32")
    with pytest.raises(reshard.Unsupported, match="mixture-of-experts"):
        RM.model_config_from_args(argparse.Namespace(**dict(vars(args), num_experts=[4])))
    with pytest.raises(reshard.Unsupported, match="embedding_weights_in_fp32"):
        RM.model_config_from_args(argparse.Namespace(**dict(vars(args), embedding_weights_in_fp32=True, bf16=True)))
    with pytest.raises(reshard.InvalidArgument, match="no Megatron padding"):
        RM.model_config_from_args(argparse.Namespace(**dict(vars(args), padded_vocab_size=129)))
    # A padded size its divisor does not give (set by hand): the divisor that gives it is used.
    m = RM.model_config_from_args(argparse.Namespace(**dict(vars(args), padded_vocab_size=256)), vocab_size=128)
    assert m["vocab_divisible_by"] == 128 and reshard.model_config(m).padded_vocab(2) == 256


def test_parameter_names_map_as_upstream_names_them():
    L = 4
    pipe = {"tied_modules.embed.word_embeddings.weight": "embedding.word_embeddings.weight",
            "tied_modules.embed.position_embeddings.weight": "embedding.position_embeddings.weight",
            "1.word_embeddings.weight": "embedding.word_embeddings.weight",
            "2.self_attention.query_key_value.weight": "layers.0.self_attention.query_key_value.weight",
            "5.mlp.dense_4h_to_h.bias": "layers.3.mlp.dense_4h_to_h.bias",
            "6.weight": "final_layernorm.weight", "7.lm_head.weight": "lm_head.weight"}
    for live, canon in pipe.items():
        assert RM.pipe_canonical_name(live, L) == canon
    for bad in ("8.weight", "0.weight", "x.weight", "7.bias"):
        with pytest.raises(reshard.InvalidArgument, match=bad.split(".")[0]):
            RM.pipe_canonical_name(bad, L)
    plain = {"language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
             "module.language_model.encoder.layers.3.input_layernorm.weight": "layers.3.input_layernorm.weight",
             "language_model.encoder.final_layernorm.bias": "final_layernorm.bias",
             "language_model.encoder.final_norm.weight": "final_layernorm.weight",
             "language_model.output_layer.weight": "lm_head.weight"}
    for live, canon in plain.items():
        assert RM.plain_canonical_name(live, L) == canon
    for bad in ("language_model.encoder.layers.4.input_layernorm.weight", "language_model.pooler.dense.weight"):
        with pytest.raises(reshard.InvalidArgument, match="GPTModel name"):
            RM.plain_canonical_name(bad, L)


def _attention(blocked, nq=2, nkv=2):
    cls = type("ParallelAttention", (torch.nn.Module,), {})
    a = cls()
    a.num_attention_heads_per_partition = nq
    a.num_key_value_heads_per_partition = nkv
    if blocked:
        a.kv_projection_size = 16
    return a


def test_live_qkv_order_is_read_off_the_attention_code():
    post = torch.nn.Sequential(_attention(True), _attention(True))
    pre = torch.nn.Sequential(_attention(False), _attention(False))
    assert RM.live_qkv_order(post) == "blocked"
    assert RM.live_qkv_order(pre) == "interleaved"
    assert RM.live_qkv_order(torch.nn.Linear(2, 2)) is None  # a stage without attention
    assert RM.live_qkv_order(post, argparse.Namespace(ds_sequence_parallel_fpdt=False)) == "blocked"
    with pytest.raises(reshard.Unsupported, match="args lack ds_sequence_parallel_fpdt"):
        RM.live_qkv_order(post, argparse.Namespace())
    with pytest.raises(reshard.Unsupported, match="two codes"):
        RM.live_qkv_order(torch.nn.Sequential(_attention(True), _attention(False)))
    with pytest.raises(reshard.Unsupported, match="grouped-query"):
        RM.live_qkv_order(torch.nn.Sequential(_attention(True, 2, 1)))


def test_a_first_start_from_an_empty_load_folder_loads_nothing(tmp_path, monkeypatch):
    """load_checkpoint on a --load folder that is missing or empty returns iteration 0, as
    upstream's does, and last_report is None (a caller reading it after a first start must not
    fail)."""
    import argparse
    import socket
    import types
    import torch.distributed as dist
    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    core.mpu = types.ModuleType("megatron.core.mpu")
    megatron.core = core
    monkeypatch.setitem(sys.modules, "megatron", megatron)
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        RM.load_checkpoint.last_report = {"stale": True}
        (tmp_path / "empty").mkdir()
        for folder in (tmp_path / "empty", tmp_path / "missing"):
            args = argparse.Namespace(load=str(folder))
            assert RM.load_checkpoint([object()], None, None, args) == 0
            assert RM.load_checkpoint.last_report is None
        with pytest.raises(reshard.InvalidArgument, match="args.load is not set"):
            RM.load_checkpoint([object()], None, None, argparse.Namespace(load=None))
    finally:
        dist.destroy_process_group()
