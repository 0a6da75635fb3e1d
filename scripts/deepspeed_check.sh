#!/usr/bin/env bash
# `make train-deepspeed-check`: the multi-GPU training path (accelerate + DeepSpeed ZeRO-2, recipes/deepspeed/)
# really runs: two CPU processes (gloo) train the tiny recipe for 4 steps and save a DeepSpeed checkpoint and the
# adapter (the test points TORCH_EXTENSIONS_DIR into build/). Installs the `deepspeed` extra without compiled ops (DS_BUILD_OPS=0; the optimizer is torch's AdamW).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! $PY -c "import deepspeed" >/dev/null 2>&1; then
  DS_BUILD_OPS=0 $PY -m pip install -q -e '.[deepspeed]'
fi
exec $PY -m pytest -q -m deepspeed tests/stages/test_train.py -p no:cacheprovider "$@"
