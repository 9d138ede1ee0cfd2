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


def job_env(port: int) -> dict:
    """The environment of one job's ranks: the rendezvous port, DeepSpeed on its CPU accelerator,
    one OpenMP thread, the reference trainer on PYTHONPATH."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                OMP_NUM_THREADS="1", PYTHONPATH=REPO,  # the reference trainer; reshard is the installed package
                # DeepSpeed JIT-builds its CPU shm op at init; a per-venv build folder keeps jobs of
                # other checkouts (another venv) from invalidating it or holding its lock.
                TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".venv", "torch_extensions")))


def mpirun_ranks(module: str, np: int, args: Sequence[str],
                 timeout: float) -> Tuple[subprocess.CompletedProcess, List[str]]:
    """Runs `python -m integration.megatron_deepspeed.<module> <args>` on `np` ranks from the
    repository root; returns the finished process (output captured) and the command. Raises
    subprocess.TimeoutExpired after `timeout` seconds."""
    cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(np),
           sys.executable, "-m", f"integration.megatron_deepspeed.{module}"] + list(args)
    port = free_port()
    try:
        return subprocess.run(cmd, cwd=REPO, env=job_env(port), capture_output=True, text=True, timeout=timeout), cmd
    finally:
        cleanup_shm(port)


def mpirun_module(module: str, tp: int, pp: int, dp: int, args: Sequence[str],
                  timeout: float) -> Tuple[subprocess.CompletedProcess, List[str]]:
    """mpirun_ranks on tp*pp*dp ranks with `--tp .. --pp .. --dp ..` before `args`."""
    return mpirun_ranks(module, tp * pp * dp, ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp)] + list(args), timeout)


def torchrun_agent(module: str, nproc: int, nnodes: str, endpoint: str, rdzv_id: str, args: Sequence[str],
                   log_path: str, max_restarts: int = 3) -> subprocess.Popen:
    """Starts one torchrun elastic agent (standing for one node) of `nproc` workers running
    `python -m integration.megatron_deepspeed.<module> <args>`: c10d rendezvous at `endpoint`
    ("127.0.0.1:PORT"; the first agent to start hosts its store), `nnodes` as "MIN:MAX",
    `max_restarts` worker-group restarts after a failure (membership changes do not count).
    kill_tree(p.pid) takes the whole "node" down (torchrun starts each worker in a session of
    its own, so killing the agent's group leaves them running). Output (the agent's and its workers') goes to `log_path`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
           "--rdzv-conf=join_timeout=300,last_call_timeout=2,close_timeout=10",
           f"--max-restarts={max_restarts}", "--monitor-interval=1", "--local-addr=127.0.0.1",
           "-m", f"integration.megatron_deepspeed.{module}"] + list(args)
    env = job_env(0)
    for k in ("MASTER_ADDR", "MASTER_PORT"):  # the agent sets them for each round
        env.pop(k, None)
    # torchrun's leader agent otherwise hosts one TCP store for the workers of every round and
    # never clears it: a round after a membership change reads the previous round's gloo peer
    # addresses from it and fails with "connectFullMesh ... Connection refused". With sharing off,
    # each round's rank 0 hosts a fresh store (pytorch/pytorch#135712, #167288).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def kill_tree(pid: int, sig: int = 9) -> List[int]:
    """Sends `sig` (default SIGKILL) to `pid` and every process descended from it (found through
    /proc parent links before any is signalled); returns the pids signalled."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return tree
