#!/usr/bin/env bash
# The whole chain on tiny data and tiny random models, on CPU, in a few minutes (`make smoke`; CI runs it):
#   data (a slice of every benchmark) -> traces (tiny model; gold backend) -> labels -> train (tiny LoRA)
#   -> a wave prediction -> the runtime, every method == ar -> eval (one request) + report.
# Outputs go to data/smoke/ and checkpoints/smoke/ so a smoke run never mixes with real runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RAW=$($PY -c "from pipeline.sources import raw_data_root; print(raw_data_root())")  # $OOO_RAW_DATA, else ../shared/data
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
SMOKE=data/smoke
T0=$SECONDS
step() { echo; echo "== [$((SECONDS - T0)) s] $*"; }
mkdir -p "$SMOKE" checkpoints/smoke

step "data: a slice of every benchmark"
if [ -d "$RAW" ]; then
  $PY -m pipeline.stages.data --recipe recipes/data/smoke.yaml data.raw_root="$RAW" --force
else
  # No raw benchmarks on this machine: the committed fixture requests stand in for every split.
  echo "no raw data at $RAW (set OOO_RAW_DATA): using tests/fixtures/requests.jsonl as bfcl train/dev/test"
  mkdir -p "$SMOKE/requests/bfcl"
  for split in train dev test; do cp tests/fixtures/requests.jsonl "$SMOKE/requests/bfcl/$split.jsonl"; done
fi

step "tiny models (random weights, locally trained BPE tokenizer)"
$PY -m pipeline.testing checkpoints/smoke/tiny-qwen2 --family qwen2
$PY -m pipeline.testing checkpoints/smoke/tiny-llama --family llama

step "traces: tiny teacher (transformers backend) and gold backend"
$PY -m pipeline.stages.traces --recipe recipes/teacher/tiny.yaml data_dir=$SMOKE
$PY -m pipeline.stages.traces --recipe recipes/teacher/gold.yaml data_dir=$SMOKE teacher=gold-tiny \
  traces.model=checkpoints/smoke/tiny-qwen2

step "labels"
$PY -m pipeline.stages.labels --recipe recipes/teacher/tiny.yaml data_dir=$SMOKE
$PY -m pipeline.stages.labels --recipe recipes/teacher/gold.yaml data_dir=$SMOKE teacher=gold-tiny \
  traces.model=checkpoints/smoke/tiny-qwen2

step "train: tiny LoRA sidecar on the gold labels' rows (packed, prefix once)"
$PY -m pipeline.stages.train --recipe recipes/sidecar/tiny.yaml train.model=checkpoints/smoke/tiny-qwen2 \
  "train.rows=[$SMOKE/labels/gold-tiny/rows/train.jsonl]" \
  "train.requests=[$SMOKE/requests/*/train.jsonl]" sft.output_dir=checkpoints/smoke/sidecar train.overwrite=true
test -f checkpoints/smoke/sidecar/adapter_model.safetensors

step "a wave prediction with the adapter (accuracy on 2 test requests; random model: numbers mean nothing)"
$PY -m pipeline.stages.sidecar_eval --recipe recipes/sidecar/tiny.yaml sidecar_eval.model=checkpoints/smoke/tiny-qwen2 \
  sidecar_eval.adapter=checkpoints/smoke/sidecar "sidecar_eval.requests=[$SMOKE/requests/bfcl/test.jsonl]" \
  sidecar_eval.limit=2 sidecar_eval.out="$SMOKE/sidecar_eval" sidecar_eval.fresh=true

step "runtime: tiny targets of three families, every method == ar"
$PY scripts/smoke_runtime.py --max-new-tokens 32

step "eval: one request, every method and the transformers peers, report"
rm -rf "$SMOKE/eval"
$PY -m pipeline.stages.eval --recipe recipes/eval/tiny.yaml
test -f "$SMOKE/eval/smoke/summary.md"
head -12 "$SMOKE/eval/smoke/summary.md"
step "smoke OK"
