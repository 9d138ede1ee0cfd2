#!/usr/bin/env bash
# Elastic resume under torchrun: two agents of 4 workers train a Megatron-DeepSpeed-style GPT at
# tp=2,pp=2,dp=2; one node is killed, the job goes on at 4 ranks (dp=1), the node comes back, the
# job goes on at 8 again; each restart chooses its layout and reshards the newest complete
# checkpoint. Compares every loss with the uninterrupted run's; writes elastic_out/report.json and
# elastic_out/elastic_loss.png (docs/elastic.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the reference trainer (integration/); reshard is installed in .venv
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
# DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer (~70 MB) in /dev/shm per rank
# and run (killed workers never remove theirs); remove the ones this run made.
SHM_MARK=$(mktemp)
trap 'find /dev/shm -maxdepth 1 -name "deepspeed_allreduce_buffer_*" -newer "$SHM_MARK" -delete 2>/dev/null; rm -f "$SHM_MARK"' EXIT
.venv/bin/python -m integration.megatron_deepspeed.elastic_demo --out elastic_out "$@"
