#!/usr/bin/env bash
# The main job: train a Megatron-DeepSpeed-style GPT at tp=2,pp=2,dp=2, save, restart at
# tp=1,pp=2,dp=4, tp=4,pp=1,dp=2 and ZeRO-3 dp=4 with reshard resharding weights and optimizer
# state on the fly, train on, and compare with the uninterrupted run. Writes demo_out/report.json
# and a PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/job_env.sh
echo "== dry run: GPT-3 175B, tp=8,pp=16,dp=8 -> tp=4,pp=8,dp=32 (ZeRO-1)"
build/bin/reshard plan --model gpt3-175b --source tp=8,pp=16,dp=8,zero=1 --target tp=4,pp=8,dp=32,zero=1
if [[ -f integration/megatron_deepspeed/demo.py ]]; then
  echo "== main job"
  .venv/bin/python -m integration.megatron_deepspeed.demo --out demo_out "$@"
fi
