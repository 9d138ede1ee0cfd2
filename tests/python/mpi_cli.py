"""Running the reshard CLI under mpirun, shared by the CLI tests (imported from the test files,
which pytest runs with this folder on sys.path)."""
import shutil
import subprocess

MPIRUN = shutil.which("mpirun")


def mpirun(cli, k, *args, timeout=120):
    """`cli ARGS` on k ranks under mpirun (oversubscribed, as root allowed); CompletedProcess."""
    return subprocess.run([MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", str(k), str(cli), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
