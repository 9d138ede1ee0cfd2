# Sourced by demo.sh, elastic_demo.sh and test.sh after setup.sh, from the repository root: the
# environment their jobs run in, and the clean-up of what DeepSpeed leaves behind.
ROOT=$(pwd)
export PATH="$ROOT/.venv/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the reference trainer (integration/); reshard is installed in .venv
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
# DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer (~70 MB) in /dev/shm per rank
# and run (killed workers never remove theirs); remove the ones this run made, so repeated runs
# do not fill the machine's memory.
SHM_MARK=$(mktemp)
trap 'find /dev/shm -maxdepth 1 -name "deepspeed_allreduce_buffer_*" -newer "$SHM_MARK" -delete 2>/dev/null; rm -f "$SHM_MARK"' EXIT
