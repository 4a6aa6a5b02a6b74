# specdeploy: `make engine` (the pipeline) and `make test` are the two set-up commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdeploy-installed

MODEL ?= smollm2-135m
SPEC ?= eagle
QUANT ?= fp8
DRAFT ?=
BUILD ?= build
ENGINE_ARGS ?=

.PHONY: venv engine serve verify bench loadtest test clean

venv: $(STAMP)

# The venv is rebuilt when the pins change; torch 2.13.0 CPU comes from the machine's wheel cache.
$(STAMP): pyproject.toml requirements-data.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	touch $@

engine: venv
	$(PY) -m specdeploy engine --model $(MODEL) --spec $(SPEC) --quant $(QUANT) \
		$(if $(DRAFT),--draft $(DRAFT)) --build-root $(BUILD) $(ENGINE_ARGS)

serve: venv
	$(PY) -m specdeploy serve --model $(MODEL) --build-root $(BUILD)

verify: venv
	$(PY) -m specdeploy verify --model $(MODEL) --build-root $(BUILD)

bench: venv
	$(PY) -m specdeploy bench --build-root $(BUILD)

loadtest: venv
	$(PY) -m specdeploy loadtest --model $(MODEL) --build-root $(BUILD)

test: venv
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(BUILD)
