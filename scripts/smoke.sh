#!/usr/bin/env bash
# The whole chain on tiny data and tiny random models, on CPU, in a few minutes (`make smoke`; CI runs it).
# Outputs go to data/smoke/ and checkpoints/smoke/ so a smoke run never mixes with real runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RAW=${OOO_RAW_DATA:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
SMOKE=data/smoke
mkdir -p "$SMOKE" checkpoints/smoke

echo "== data: a slice of every benchmark"
$PY -m pipeline.stages.data --recipe recipes/data/smoke.yaml data.raw_root="$RAW" --force

echo "== tiny models"
$PY -m pipeline.testing checkpoints/smoke/tiny-qwen2 --family qwen2
