"""A torchrun worker for the DCP / FSDP2 tests (tests/python/test_dcp.py).

  save OUT STEPS MESH   train a tiny model STEPS steps (AdamW) under MESH, dcp.save it to
                        OUT/ckpt; rank 0 writes OUT/reference.pt (full tensors of the weights
                        and Adam state, gathered by DTensor.full_tensor) and OUT/next.pt (the full
                        weights one step later: the uninterrupted run's next step)
  load OUT MESH RESULT  build the model under MESH, reshard.torch.load(model, optimizer,
                        OUT/ckpt), compare every full tensor with reference.pt bitwise, take
                        one step, compare with next.pt; rank 0 writes RESULT (JSON)

MESH: "fsdp" (FSDP2 over every rank) or "tpN" (a (dp, tp=N) DTensor mesh: the MLP's w1/w3
column-parallel and w2 row-parallel over tp, then FSDP2 over dp). The model has an uneven vocab
(37 rows), a 3-element parameter (empty shards at 4+ ranks) and a fused SwiGLU weight.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

H, FF, V = 8, 8, 37


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(H))
        self.w13 = nn.Linear(H, 2 * FF, bias=False)  # fused SwiGLU [gate; up]
        self.w1 = nn.Linear(H, FF, bias=False)
        self.w3 = nn.Linear(H, FF, bias=False)
        self.w2 = nn.Linear(FF, H, bias=False)
        self.w4 = nn.Linear(FF, H, bias=False)  # the fused path's projection (never tensor parallel)

    def forward(self, h):
        x = h * self.norm
        g, u = self.w13(x).chunk(2, dim=-1)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x)) + self.w4(F.silu(g) * u)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.tiny = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(H, V)

    def forward(self, ids):
        h = self.emb(ids) * (1 + self.tiny.sum() * 0.1)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(mesh_kind):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = Tiny()
    world = dist.get_world_size()
    if mesh_kind.startswith("tp"):
        tp = int(mesh_kind[2:])
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for b in m.blocks:
            parallelize_module(b, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                               "w2": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = None
    for b in m.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(m, mesh=dp_mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    return m, opt


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (4, 5), generator=g)


def train_step(m, opt, step):
    ids = batch(step)
    m(ids).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def snapshot(m, opt):
    out = {}
    for n, p in m.named_parameters():
        out[f"weight/{n}"] = full(p)
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"{k}/{n}"] = full(st[k])
        if "step" in st:
            out[f"step/{n}"] = st["step"].clone()
    return out


def main():
    dist.init_process_group("gloo")
    mode, out = sys.argv[1], sys.argv[2]
    rank = dist.get_rank()
    if mode == "save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        steps, mesh_kind = int(sys.argv[3]), sys.argv[4]
        m, opt = build(mesh_kind)
        for s in range(steps):
            train_step(m, opt, s)
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
        ref = snapshot(m, opt)
        train_step(m, opt, steps)
        nxt = snapshot(m, opt)
        if rank == 0:
            torch.save(ref, os.path.join(out, "reference.pt"))
            torch.save(nxt, os.path.join(out, "next.pt"))
    else:
        import reshard.torch as rt
        mesh_kind, result = sys.argv[3], sys.argv[4]
        m, opt = build(mesh_kind)
        report = rt.load(m, opt, os.path.join(out, "ckpt"))
        ref = torch.load(os.path.join(out, "reference.pt"))
        got = snapshot(m, opt)
        bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
        steps = int(ref[next(k for k in ref if k.startswith("step/"))].item())
        train_step(m, opt, steps)
        nxt = torch.load(os.path.join(out, "next.pt"))
        after = snapshot(m, opt)
        worst = max(float((after[k] - nxt[k]).abs().max()) for k in nxt if k.startswith("weight/"))
        if rank == 0:
            with open(result, "w") as f:
                json.dump({"world": dist.get_world_size(), "mismatched": bad, "compared": len(ref),
                           "next_step_max_abs_diff": worst, "change": report["change"],
                           "bytes_read": report["bytes_read"], "bytes_needed": report["bytes_needed"],
                           "checksums_verified": report["checksums_verified"], "step_set": report["step_set"]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    main()
    # Every result is written; leave without the interpreter's teardown, where torch's gloo
    # threads occasionally abort a finished process ("terminate called without an active
    # exception", pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
