# `make demo` and `make test` work on a fresh machine: they create .venv/, install the
# pinned dependencies (torch first, the CPU build: see TORCH_INDEX), build the native op
# library against that torch, then run their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
PYTEST_ARGS ?=
# Test worker processes (pytest-xdist). Two on this project's 2-core machines: most of a
# test is single-threaded Python (Dynamo's trace, lowering), so two workers nearly halve
# the suite (13 -> 7.4 minutes measured). `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2

.PHONY: demo test test-all lint check-install build clean

# Python 3.11: the pinned torch CPU wheel is built for it.
$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "qaic_dynamo needs Python 3.11, found " + sys.version.split()[0] + ": make ... PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)

# torch is installed on its own first, pinned, so that no later requirement can make pip
# resolve a different (CUDA) build. This project's machines serve the CPU wheel from a local
# wheel directory; elsewhere plain PyPI would give the CUDA build, so pass the CPU index:
# `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
$(DEPS): $(BIN)/python requirements.txt requirements-test.txt
	$(BIN)/pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -r requirements.txt -r requirements-test.txt
	touch $@

EDITABLE := $(VENV)/.editable-installed

# The package metadata and entry points (console script, torch_dynamo_backends), installed
# editable once; the extension itself is built by the `build` rule below.
$(EDITABLE): $(DEPS) setup.py
	QAIC_DYNAMO_SKIP_EXT_BUILD=1 $(BIN)/pip install --no-build-isolation --no-deps -e . -q
	touch $@

# Compiled against the torch we just installed (no build isolation). ninja keeps the
# rebuild incremental, so running this every time costs a few seconds.
build: $(EDITABLE)
	$(BIN)/python setup.py -q build_ext --inplace

demo: build
	$(BIN)/python -m qaic_dynamo demo

# Lint, format and the import layers (pyproject.toml): the cheap checks, first.
lint: $(DEPS)
	$(BIN)/ruff check qaic_dynamo tests benchmarks
	$(BIN)/ruff format --check qaic_dynamo tests benchmarks
	$(BIN)/lint-imports

test: build lint
	$(BIN)/python -m pytest tests -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Everything, including tests marked slow.
test-all: build lint
	$(BIN)/python -m pytest tests -m "" -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# What `pip install .` gives a user: a fresh venv with torch (CPU) first, then the package
# and the dependencies setup.py declares, checked from outside the source tree. The
# extension compiles against that torch, hence --no-build-isolation (an isolated build
# would fetch a second, CUDA, torch just to compile against).
FRESH := build/fresh-venv
check-install:
	rm -rf $(FRESH)
	$(PYTHON) -m venv $(FRESH)
	$(FRESH)/bin/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(FRESH)/bin/pip install -q setuptools==84.2.1 ninja==1.13.2
	$(FRESH)/bin/pip install -q --no-build-isolation .
	cd $(FRESH) && bin/python -c "import qaic_dynamo, qaic_dynamo.compiler, qaic_dynamo.deploy.export, torch; \
		assert 'qaic' in torch._dynamo.list_backends(), 'backend not registered'; \
		assert qaic_dynamo.__file__.startswith('$(CURDIR)/$(FRESH)/'), qaic_dynamo.__file__; \
		print('import qaic_dynamo: ok from', qaic_dynamo.__file__)"
	cd $(FRESH) && bin/qaic-dynamo --help > /dev/null && echo "qaic-dynamo --help: ok"

clean:
	rm -rf build qaic_dynamo/_C*.so *.egg-info .pytest_cache
