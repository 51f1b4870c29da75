# E3 on Triton. The two commands: `make demo` and `make test` (both run `make setup`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.e3-setup-stamp
SETUP_INPUTS := requirements.txt requirements-nodeps.txt requirements.lock pyproject.toml deploy/install_system_deps.sh \
	deploy/grpc_front/build.sh $(wildcard deploy/grpc_front/*.cc deploy/grpc_front/*.h)
export PATH := $(CURDIR)/$(BIN):$(PATH)
export E3_DEPS_DIR := $(CURDIR)/.deps

.PHONY: setup demo test reliability clean help gpu-wheels docs

help:
	@echo "make demo       set up, export the demo model, serve it on the embedded Triton, print a side-by-side table"
	@echo "make test       set up and run the test suite (unit + end-to-end on the real tritonserver)"
	@echo "make reliability  long fault, fuzz and security runs; one line per item with its figure (docs/reliability.md)"
	@echo "make setup      create .venv with the pinned dependencies (idempotent)"
	@echo "make gpu-wheels the server and client a bare GPU host needs, into .gpu_wheels/ (docs/gpu.md)"
	@echo "make docs       docs/cli.md, the command-line reference, from the argparse definitions"
	@echo "make clean      remove generated artifacts (keeps .venv)"

setup: $(STAMP)

# Re-runs only when a dependency file changes; a second `make setup` does nothing.
# (The grep drops this machine's pip notices about absent local index folders.)
# --no-compile: no byte-compiling of every installed module (torch alone has thousands); Python compiles
# what it imports, on first import.
define pip
	@echo "pip install $(1)"
	@set -o pipefail; $(BIN)/python -m pip install --quiet --no-compile $(1) 2>&1 | { grep -v "neither a file nor a directory" || true; }
endef

$(STAMP): $(SETUP_INPUTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call pip,-r requirements.txt -c requirements.lock)
	$(call pip,--no-deps -r requirements-nodeps.txt)
	$(call pip,--no-deps --no-build-isolation -e .)
	@bash deploy/install_system_deps.sh
	@PYTHON=$(BIN)/python bash deploy/grpc_front/build.sh
	@touch $(STAMP)
	@echo "setup: done (.venv ready)"

demo: setup
	$(BIN)/e3 demo

# Two parts: the tests in TEST_WORKERS processes (pytest-xdist, a test file per worker at a time: a file's server
# fixture stays in one process), then the `serial` ones alone (they measure time, batch fill or order under load).
# Both parts always run; the target fails if either did. Example: make test PYTEST_ARGS="-k scheduler".
TEST_WORKERS ?= 2
test: setup
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS); a=$$?; \
	echo "== the serial tests, alone"; \
	$(BIN)/python -m pytest -m serial $(PYTEST_ARGS); b=$$?; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then echo "WARNING: pytest collected NO tests (exit 5): nothing was checked"; fi

# The long versions of the reliability tests (5,000 fuzzed bodies, a crash loop, destructive controls, a soak of 1,000,000
# requests); `make test` runs the short ones. Options (benchmarks/reliability.py --help) go in RELIABILITY_ARGS,
# e.g. make reliability RELIABILITY_ARGS="--items 8,9 --soak-requests 50000".
reliability: setup
	$(BIN)/python benchmarks/reliability.py $(RELIABILITY_ARGS)

# The server and client a bare GPU host needs for benchmarks/gpu_side_by_side.py (docs/gpu.md), into .gpu_wheels/.
gpu-wheels: setup
	bash deploy/gpu_wheels.sh .gpu_wheels

# docs/cli.md from the argparse definitions (tests/test_cli_reference.py fails when it is stale).
docs: setup
	$(BIN)/python -m e3.cli.reference > docs/cli.md

clean:
	@if [ -x $(BIN)/e3 ]; then $(BIN)/e3 clean; else rm -rf artifacts; fi
