# k8s-vgpu — the one entry point.  `make` builds all C into build/;
# `make test` runs the suites; `make demo` runs the node stack; `make bench-*`.
SHELL := /bin/bash
BUILD   ?= build
VENV    ?= .venv
PYTHON  ?= python3
CC      ?= cc
PY      := $(VENV)/bin/python
CSTD    := -std=c11 -D_GNU_SOURCE
CWARN   := -Wall -Wextra -Werror
COPT    ?= -O2 -g
CFLAGS_LIB  := $(CSTD) $(CWARN) $(COPT) -fPIC -fvisibility=hidden
CFLAGS_PROG := $(CSTD) $(CWARN) $(COPT)
PYTEST_ARGS ?= --durations=40

# Every fragment appends its outputs to ALL_TARGETS.
ALL_TARGETS :=

.PHONY: all venv test test-frameworks test-cluster lint demo clean proto bench-intercept bench-hook bench-plugin bench-shares bench-scheduler bench-dra bench-oversub deb rpm test-asan

all: build-all

include sim/fakegpu/build.mk
include libcuda_intercept/build.mk

build-all: $(ALL_TARGETS)

$(BUILD):
	mkdir -p $@

# --- Python environment -------------------------------------------------------
venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# --- tests --------------------------------------------------------------------
test: host-deps-test venv build-all
	$(PY) -m pytest $(PYTEST_ARGS)

# PyTorch with CUDA (and CuPy for CUDA 13) on the simulated GPU against a slice (tests/frameworks;
# `make test` skips it): torch from PyPI (several GB) in a venv of its own.  On this kind of machine pip takes
# torch==$(TORCH_VERSION) from local disk for Python 3.11.
FRAMEWORKS_VENV ?= .venv-frameworks
TORCH_VERSION ?= 2.14.1
test-frameworks: host-deps-test venv build-all
	test -x $(FRAMEWORKS_VENV)/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python -c 'import torch, cupy, sys; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)")' \
	    2>/dev/null || $(FRAMEWORKS_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) 'cupy-cuda13x>=14,<15'
	VGPU_TEST_FRAMEWORKS=1 VGPU_FRAMEWORKS_PYTHON=$(FRAMEWORKS_VENV)/bin/python \
	    $(PY) -m pytest tests/frameworks tests/gpu/test_frameworks_gpu.py $(PYTEST_ARGS)

# The acceptance suite against the cluster $KUBECONFIG names (tests/cluster; `make test` never
# runs it). VGPU_TEST_* variables: docs/operators/install.md, "Acceptance suite".
test-cluster: venv
	$(PY) -m pytest tests/cluster $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=.:packaging/demo $(VENV)/bin/lint-imports --no-cache

# --- demo ---------------------------------------------------------------------
demo: host-deps-demo venv build-all
	$(PY) packaging/demo/demo.py $(DEMO_ARGS)

# --- packages (packaging/build-packages.sh; outputs in $(BUILD)/pkg/) ---------------
deb: host-deps-deb venv build-all
	packaging/build-packages.sh deb
rpm: host-deps-rpm venv build-all
	packaging/build-packages.sh rpm
# Missing Debian packages of these targets are installed (root) or named (packaging/host-deps.sh).
host-deps-demo host-deps-deb host-deps-rpm host-deps-test host-deps-image:
	@packaging/host-deps.sh $(@:host-deps-%=%)
.PHONY: host-deps-demo host-deps-deb host-deps-rpm host-deps-test host-deps-image

# --- container image (packaging/image/build.py; outputs in $(BUILD)/image/) -------------
# IMAGE_REPO=registry/name to tag it elsewhere; cached by content under /var/cache/k8s-vgpu.
IMAGE_REPO ?= ghcr.io/k8s-vgpu/k8s-vgpu
image: host-deps-image venv build-all
	IMAGE_REPO=$(IMAGE_REPO) $(PY) packaging/image/build.py
.PHONY: image

# --- benchmarks (each prints name=value lines, last line a summary) -------------
bench-intercept: venv build-all
	$(PY) tests/bench/bench_intercept.py
# BENCH_HOOK_BASELINE=<git revision>: an interleaved A/B against that revision's hook in the same run.
bench-hook: venv build-all
	BENCH_HOOK_BASELINE=$(BENCH_HOOK_BASELINE) $(PY) tests/bench/bench_hook.py
bench-plugin: venv build-all
	$(PY) tests/bench/bench_plugin.py
bench-shares: venv build-all
	$(PY) tests/bench/bench_shares.py
bench-scheduler: venv
	$(PY) tests/bench/bench_scheduler.py
bench-dra: venv build-all
	$(PY) tests/bench/bench_dra.py
bench-oversub: venv build-all
	$(PY) tests/bench/bench_oversub.py

# --- generated gRPC code of the device plugin (committed; regenerate after editing the .proto) ---
proto: venv
	device_plugin/api/gen.sh $(PY)
	dra_plugin/api/gen.sh $(PY)

clean:
	rm -rf $(BUILD)
