"""Runs one module of this package as an mpirun job of tp*pp*dp CPU ranks over gloo, the way the
demo and the trainer tests do: a free rendezvous port per job, DeepSpeed on its CPU accelerator,
one OpenMP thread per rank, and DeepSpeed's shared-memory buffers of the job removed afterwards."""

import glob
import os
import socket
import subprocess
import sys
from typing import List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cleanup_shm(port: int) -> None:
    """DeepSpeed's CPU shm allreduce op leaves /dev/shm/deepspeed_allreduce_buffer_*_<addr>_<port>_<rank>
    (about 69 MB per rank) after every job; remove this job's (its port is ours alone)."""
    for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(f)
        except OSError:
            pass


def mpirun_module(module: str, tp: int, pp: int, dp: int, args: Sequence[str],
                  timeout: float) -> Tuple[subprocess.CompletedProcess, List[str]]:
    """Runs `python -m integration.megatron_deepspeed.<module> --tp .. --pp .. --dp .. <args>` on
    tp*pp*dp ranks from the repository root; returns the finished process (output captured) and the
    command. Raises subprocess.TimeoutExpired after `timeout` seconds."""
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(tp * pp * dp),
           sys.executable, "-m", f"integration.megatron_deepspeed.{module}", "--tp", str(tp), "--pp", str(pp),
           "--dp", str(dp)] + list(args)
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONPATH=REPO,  # the reference trainer; reshard is the installed package
               # DeepSpeed JIT-builds its CPU shm op at init; a per-venv build folder keeps jobs of
               # other checkouts (another venv) from invalidating it or holding its lock.
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".venv", "torch_extensions")))
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout), cmd
    finally:
        cleanup_shm(port)
