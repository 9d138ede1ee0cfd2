#!/usr/bin/env bash
# Elastic resume under torchrun: two agents of 4 workers train a Megatron-DeepSpeed-style GPT at
# tp=2,pp=2,dp=2; one node is killed, the job goes on at 4 ranks (dp=1), the node comes back, the
# job goes on at 8 again; each restart chooses its layout and reshards the newest complete
# checkpoint. Compares every loss with the uninterrupted run's; writes elastic_out/report.json and
# elastic_out/elastic_loss.png (docs/elastic.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/job_env.sh
.venv/bin/python -m integration.megatron_deepspeed.elastic_demo --out elastic_out "$@"
