"""GPU check of the Python path (run by benchmarks/gpu_check.sh on a GPU machine; needs CUDA):
reshard.load into CUDA tensors over the trainer's NCCL process group (world size 1 here: one GPU)
equals the load into CPU tensors bitwise, and the report says the tensors were staged and copied.

    PYTHONPATH=python python tests/gpu/python_cuda_check.py
Exits 0 when every check passed; prints one line per check."""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

import reshard

MODEL = {"name": "gpu-py", "num_layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "query_groups": 2, "vocab": 100,
         "vocab_divisible_by": 8, "swiglu": True, "tied_embeddings": True, "param_dtype": "bf16"}
DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    failures = 0
    try:
        with tempfile.TemporaryDirectory() as d:
            m = reshard.model_config(MODEL)
            reshard.synth_checkpoint(d, m, "tp=2,pp=1,dp=2,zero=1", 3)
            L = reshard.derive_layout(m, "tp=1,pp=1,dp=1,zero=1")
            cpu = {b["name"]: torch.full((b["numel"],), float("nan"), dtype=DT[b["dtype"]]) for b in L.buffers}
            reshard.load(d, L, cpu, comm=reshard.local_communicator())
            gpu = {k: torch.full_like(v, float("nan"), device="cuda") for k, v in cpu.items()}
            comm = reshard.communicator()  # the NCCL process group
            rep = reshard.load(d, L, gpu, comm=comm)
            bad = [k for k in cpu if not torch.equal(cpu[k], gpu[k].cpu())]
            ok = not bad and rep["device"].startswith("cuda")
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'}: load into CUDA over NCCL == CPU load ({len(cpu)} tensors, "
                  f"{rep['target_bytes']} bytes, {rep['gbps']:.2f} GB/s, copy {rep['device_copy_seconds']:.4f} s)"
                  + (f"; differing: {bad[:4]}" if bad else ""))
            # A refused load leaves the device tensors untouched.
            untied = reshard.derive_layout(reshard.model_config({**MODEL, "tied_embeddings": False}), "tp=1,pp=1,dp=1,zero=1")
            live = {b["name"]: torch.ones(b["numel"], dtype=DT[b["dtype"]], device="cuda") for b in untied.buffers}
            try:
                reshard.load(d, untied, live, comm=comm)
                ok = False
            except reshard.InvalidArgument:
                ok = all(bool((t == 1).all()) for t in live.values())
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'}: a refused load leaves CUDA tensors untouched")
    finally:
        dist.destroy_process_group()
    print(f"python cuda checks: {'all passed' if failures == 0 else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
