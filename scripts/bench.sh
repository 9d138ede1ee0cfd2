#!/usr/bin/env bash
# The load benchmark: reshard against the read and memcpy ceilings, PyTorch DCP and DeepSpeed
# Universal Checkpointing, on this machine, in one run. Writes bench_out/results.json (a list of
# entries), bench_out/results.md, bench_out/*.png and bench_out/meta.json; logs in bench_out/logs.
#
#   scripts/bench.sh            ~2 GB of training state, four target layouts (K = 2, 2, 4, 8 ranks)
#   scripts/bench.sh --quick    ~0.3 GB, two targets, fewer repeats (a few minutes)
#   scripts/bench.sh --size-gb 20 --targets 'tp=1,pp=1,dp=2,zero=1;tp=4,pp=1,dp=2,zero=1' ...
#   scripts/bench.sh --help     every option (benchmarks/bench.py)
#
# Environment:
#   RESHARD_BUILD_DIR   build folder whose bin/reshard and bin/plan_bench are measured (default build,
#                       which scripts/setup.sh makes)
#   RESHARD_PYTHON      Python with torch (and DeepSpeed for its cases); default .venv/bin/python
# Measurements only: nothing asserts a time. GB = 10^9 bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${RESHARD_BUILD_DIR:-build}
[[ "$BUILD" = /* ]] || BUILD="$ROOT/$BUILD"
PY=${RESHARD_PYTHON:-$ROOT/.venv/bin/python}
if [[ ! -x "$BUILD/bin/reshard" ]]; then
  if [[ -z "${RESHARD_BUILD_DIR:-}" ]]; then
    echo "[bench] $BUILD/bin/reshard missing: running scripts/setup.sh" >&2
    bash scripts/setup.sh
  else
    echo "[bench] $BUILD/bin/reshard not found" >&2; exit 2
  fi
fi
export PATH="$ROOT/.venv/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer (~70 MB) in /dev/shm per rank
# and run (the DeepSpeed save and UCP steps); remove the ones this run made, so repeated runs do
# not fill the machine's memory.
SHM_MARK=$(mktemp)
trap 'find /dev/shm -maxdepth 1 -name "deepspeed_allreduce_buffer_*" -newer "$SHM_MARK" -delete 2>/dev/null; rm -f "$SHM_MARK"' EXIT
"$PY" "$ROOT/benchmarks/bench.py" --reshard-bin "$BUILD/bin/reshard" --plan-bench "$BUILD/bin/plan_bench" "$@"
