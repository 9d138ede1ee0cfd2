"""The collectives behind reshard's torch.distributed communicator.

`ProcessGroupComm` is called from C++ (csrc/python/torch_comm.cc) with raw host addresses of this
rank's memory; it wraps them in uint8 tensors without copying and calls torch.distributed on the
given process group (gloo on CPU; NCCL after staging through the current CUDA device). Ranks are
ranks of that group. Byte counts are int64 and may exceed 2**31.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C


class ProcessGroupComm:
    """torch.distributed implementation of reshard's Communicator (see include/reshard/comm.h)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise _C.FailedPrecondition("reshard: torch.distributed is not initialized; call "
                                        "dist.init_process_group first or pass comm=None for one process")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Global rank of each group rank (point-to-point calls take global ranks).
        if group is None:
            self._global = list(range(self.size))
        else:
            self._global = [dist.get_global_rank(group, r) for r in range(self.size)]

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _mem(ptr: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return _C.tensor_from_ptr(int(ptr), int(nbytes))

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def _from_dev(self, t: torch.Tensor, host: torch.Tensor):
        if t is not host:
            host.copy_(t.cpu())

    @staticmethod
    def _packed(counts, displs) -> bool:
        at = 0
        for c, d in zip(counts, displs):
            if c and d != at:
                return False
            at += c
        return True

    # -- collectives -----------------------------------------------------------------------------

    def all_to_all_v(self, send_ptr, send_counts, send_displs, recv_ptr, recv_counts, recv_displs):
        n_send, n_recv = sum(send_counts), sum(recv_counts)
        # Counts must agree pairwise (what r sends to p is what p expects from r): checked with one
        # small all-to-all so that a mismatch is an error, not a hang or a silent truncation.
        sc = torch.tensor([int(c) for c in send_counts], dtype=torch.int64, device=self.device)
        expect = torch.empty_like(sc)
        dist.all_to_all_single(expect, sc, group=self.group)
        expect = expect.cpu()
        bad = [p for p in range(self.size) if int(expect[p]) != int(recv_counts[p])]
        if bad:
            p = bad[0]
            raise RuntimeError(f"all_to_all_v count mismatch: rank {p} sends {int(expect[p])} bytes to rank "
                               f"{self.rank}, which expects {int(recv_counts[p])}")
        # No early return when this rank has nothing to move: all_to_all_single is collective.
        # Pack into contiguous rank order where the displacements are not already packed.
        if self._packed(send_counts, send_displs):
            start = min([d for c, d in zip(send_counts, send_displs) if c] or [0])
            send = self._mem(send_ptr + start, n_send)
        else:
            send = torch.empty(n_send, dtype=torch.uint8)
            at = 0
            for c, d in zip(send_counts, send_displs):
                if c:
                    send[at:at + c].copy_(self._mem(send_ptr + d, c))
                at += c
        recv_packed = self._packed(recv_counts, recv_displs)
        if recv_packed:
            start = min([d for c, d in zip(recv_counts, recv_displs) if c] or [0])
            recv_host = self._mem(recv_ptr + start, n_recv)
        else:
            recv_host = torch.empty(n_recv, dtype=torch.uint8)
        recv = self._to_dev(recv_host) if self.device.type != "cpu" else recv_host
        dist.all_to_all_single(recv, self._to_dev(send), output_split_sizes=[int(c) for c in recv_counts],
                               input_split_sizes=[int(c) for c in send_counts], group=self.group)
        self._from_dev(recv, recv_host)
        if not recv_packed:
            at = 0
            for c, d in zip(recv_counts, recv_displs):
                if c:
                    self._mem(recv_ptr + d, c).copy_(recv_host[at:at + c])
                at += c

    def broadcast(self, ptr, nbytes, root, group):
        """Broadcast within `group` (sorted group ranks). Only members call it, so no new process
        group can be created here: the whole world uses dist.broadcast, a subgroup point-to-point
        sends from the root."""
        if nbytes == 0 or len(group) <= 1:
            return
        if self.rank not in group or root not in group:
            raise RuntimeError(f"broadcast: rank {self.rank} or root {root} is not in group {list(group)}")
        host = self._mem(ptr, nbytes)
        buf = self._to_dev(host)
        if len(group) == self.size:
            dist.broadcast(buf, src=self._global[root], group=self.group)
        elif self.rank == root:
            reqs = [dist.isend(buf, dst=self._global[p], group=self.group) for p in group if p != root]
            for r in reqs:
                r.wait()
        else:
            dist.recv(buf, src=self._global[root], group=self.group)
        self._from_dev(buf, host)

    def all_reduce(self, value, op):
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_gather_bytes(self, mine: bytes):
        n = torch.tensor([len(mine)], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(n) for _ in range(self.size)]
        dist.all_gather(sizes, n, group=self.group)
        sizes = [int(s.item()) for s in sizes]
        width = max(sizes + [1])
        buf = torch.zeros(width, dtype=torch.uint8)
        if mine:
            buf[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        buf = self._to_dev(buf)
        outs = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(outs, buf, group=self.group)
        return [bytes(o[:s].cpu().numpy().tobytes()) for o, s in zip(outs, sizes)]

    def barrier(self):
        dist.barrier(group=self.group)
