#!/usr/bin/env bash
# The main job: train a Megatron-DeepSpeed-style GPT at tp=2,pp=2,dp=2, save, restart at
# tp=1,pp=2,dp=4, tp=4,pp=1,dp=2 and ZeRO-3 dp=4 with reshard resharding weights and optimizer
# state on the fly, train on, and compare with the uninterrupted run. Writes demo_out/report.json
# and a PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the reference trainer (integration/); reshard is installed in .venv
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
# DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer (~70 MB) in /dev/shm per rank
# and run; remove the ones this run made, so repeated runs do not fill the machine's memory.
SHM_MARK=$(mktemp)
trap 'find /dev/shm -maxdepth 1 -name "deepspeed_allreduce_buffer_*" -newer "$SHM_MARK" -delete 2>/dev/null; rm -f "$SHM_MARK"' EXIT
echo "== dry run: GPT-3 175B, tp=8,pp=16,dp=8 -> tp=4,pp=8,dp=32 (ZeRO-1)"
build/bin/reshard plan --model gpt3-175b --source tp=8,pp=16,dp=8,zero=1 --target tp=4,pp=8,dp=32,zero=1
if [[ -f integration/megatron_deepspeed/demo.py ]]; then
  echo "== main job"
  .venv/bin/python -m integration.megatron_deepspeed.demo --out demo_out "$@"
fi
