# specdeploy: `make engine` (the pipeline) and `make test` are the two set-up commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdeploy-installed

MODEL ?= smollm2-135m
DEVICE ?= auto
SPEC ?= eagle
QUANT ?= fp8
DRAFT ?=
MODULE ?=
BUILD ?= build
ENGINE_ARGS ?=
BENCH_ARGS ?=
LOADTEST_ARGS ?=
# the suite's workers (pytest-xdist): a test file stays on one worker, so its module fixtures are built once
TEST_WORKERS ?= 2

.PHONY: venv oracles engine serve verify bench loadtest test test-gpu clean

venv: $(STAMP)

# The venv is rebuilt when the pins change; torch 2.13.0 CPU comes from the machine's wheel cache.
# --no-compile: pip would byte-compile every installed module (~50 s of a fresh install on 2 cores);
# Python compiles the ones a run imports on first use and caches them. That cache needs bytecode
# writes: an environment's PYTHONDONTWRITEBYTECODE (some images set it) would have every process
# compile its imports again (~4 s each with ModelOpt and transformers), so make's commands run without it.
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): pyproject.toml requirements-data.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e ".[cpu,test]"
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-data.txt
	touch $@

# serve/verify/loadtest find the build `make engine` wrote from the same variables
# MODULE=<folder>: the spec stage imports that module instead of training one (it names the build too)
BUILD_ARGS = --model $(MODEL) --spec $(SPEC) --quant $(QUANT) --build-root $(BUILD) $(if $(MODULE),--module $(MODULE))

engine: venv
	$(PY) -m specdeploy engine $(BUILD_ARGS) --device $(DEVICE) $(if $(DRAFT),--draft $(DRAFT)) $(ENGINE_ARGS)

serve: venv
	$(PY) -m specdeploy serve $(BUILD_ARGS)

verify: venv
	$(PY) -m specdeploy verify $(BUILD_ARGS) --device $(DEVICE)

bench: venv
	$(PY) -m specdeploy bench --build-root $(BUILD) --device $(DEVICE) $(BENCH_ARGS)

loadtest: venv
	$(PY) -m specdeploy loadtest $(BUILD_ARGS) $(LOADTEST_ARGS)

# The test suite's oracle environments (tests/oracle.py), started in the background before the venv:
# pip works on one core, so a fresh venv install leaves the other idle for a minute. A test that needs
# one still being made waits on its lock; a failure is reported again by that test.
oracles:
	$(PYTHON) -m tests.oracle > /dev/null &

test: oracles venv
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests

# The CUDA tests only (tiny models end to end on the GPU); on a host without CUDA they report as skipped.
test-gpu: venv
	$(PY) -m pytest -q -ra -m gpu tests

clean:
	rm -rf $(BUILD)
