# `make demo` and `make test` work on a fresh machine: they create .venv/, install the
# pinned dependencies (torch first, from the local CPU wheel), build the native op
# library against that torch, then run their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
PYTEST_ARGS ?=

.PHONY: demo test test-all build bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed on its own first, pinned, so that no later requirement can make pip
# resolve a different (CUDA) build.
$(DEPS): $(BIN)/python requirements.txt requirements-test.txt
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -r requirements.txt -r requirements-test.txt
	touch $@

# --no-build-isolation: compile against the torch we just installed. ninja makes the
# rebuild incremental, so running this every time costs a few seconds.
build: $(DEPS)
	$(BIN)/pip install --no-build-isolation --no-deps -e . -q
	$(BIN)/python setup.py -q build_ext --inplace

demo: build
	$(BIN)/python -m qaic_dynamo demo

test: build
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# Everything, including tests marked slow.
test-all: build
	$(BIN)/python -m pytest tests -m "" $(PYTEST_ARGS)

clean:
	rm -rf build qaic_dynamo/_C*.so *.egg-info .pytest_cache
