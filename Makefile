# Thin wrappers; the logic lives in pyproject.toml, dmlbook/ and tests/.
# `make lab` and `make test` create .venv on first use and install from requirements.lock: every
# package pinned exactly (torch's CPU build included), so every learner in a class and every CI run
# gets the same versions. `make lock` regenerates the lock from pyproject.toml's ranges;
# `make test-latest` runs the suite against the newest releases those ranges allow.
VENV    ?= .venv
PYTHON  ?= python3
LOCK    := requirements.lock
PY      := $(VENV)/bin/python
UV      := $(VENV)/bin/uv
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# The installer, pinned like everything else (pip would work too, about 7x slower here).
UV_VERSION := 0.13.9
# The Python the lock is made for (CI's and the reference machine's); its torch is pinned in
# lock-constraints.txt.
LOCK_PYTHON := 3.11
# Where torch's CPU build comes from: this workplace keeps the wheel on disk; elsewhere, PyTorch's
# CPU index. With a GPU, replace the lock's torch: `make install TORCH=torch==2.13.0` (PyPI's CUDA
# build on Linux) or any requirement you like.
TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-*.whl),--find-links /opt/wheels,\
	--index-strategy unsafe-best-match --extra-index-url https://download.pytorch.org/whl/cpu)
TORCH ?=
# JupyterHub's proxy for a class on one server (`make jupyterhub-proxy`). `make test` installs it
# where npm is found, so that the hub test runs (a failed install fails that test, not the whole
# run); without node that test skips and says why.
CHP := jupyterhub/node_modules/.bin/configurable-http-proxy
HUB_PROXY := $(if $(shell command -v npm 2>/dev/null),$(CHP))

.PHONY: install lab test test-unit test-notebooks test-system test-latest lock bench lint format clean \
	copy-exercises grade site gpu-check jupyterhub-proxy

# The README's set-up command. `uv pip sync` makes the venv exactly the lock (and removes what the
# lock does not hold); the package itself goes in editable, without touching the pins.
# --compile-bytecode writes every package's .pyc once, at install: uv does not by default, and
# where PYTHONDONTWRITEBYTECODE is set (as on CI here) every process would compile torch's Python
# again on import (3.1 s against 1.9 s for `import torch` here), every kernel and rank alike.
# BYTECODE= (empty) leaves it to the first import (the newcomer test does,
# tests/system/test_install.py).
BYTECODE ?= --compile-bytecode
$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"

$(STAMP): pyproject.toml $(LOCK) | $(UV)
	$(UV) pip sync --python $(PY) --quiet $(BYTECODE) $(TORCH_SOURCE) $(LOCK)
	$(if $(TORCH),$(UV) pip install --python $(PY) --quiet $(BYTECODE) --reinstall-package torch "$(TORCH)")
	$(UV) pip install --python $(PY) --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# requirements.lock from pyproject.toml's ranges: the newest versions they allow today, for
# Python $(LOCK_PYTHON) with torch's CPU build, less what lock-overrides.txt leaves out (and says
# why). Commit the result; environment.yml reads it too.
lock: lock-constraints.txt lock-overrides.txt | $(UV)
	$(UV) pip compile pyproject.toml --extra dev --extra jupyterhub --python-version $(LOCK_PYTHON) --quiet \
		$(TORCH_SOURCE) --constraint lock-constraints.txt --overrides lock-overrides.txt \
		--no-emit-find-links \
		--custom-compile-command "make lock" --output-file $(LOCK)

# JupyterLab refuses to run as root without --allow-root (containers, cloud VMs).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) chapters/

# The README's test command: every test and every chapter (nbval) with the given Python, on
# TEST_WORKERS pytest-xdist workers (3 by default: on 2 cores a third worker fills the time the
# others wait on subprocesses, sleeps and shaped links), a test file or a notebook per worker at
# a time, the slow tests first, the longest first (conftest.py). TEST_WORKERS=0 runs it in one
# process (about 15 minutes here against 9-10).
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
run_tests = MPLBACKEND=Agg $(1) -m pytest tests chapters --nbval-lax --nbval-current-env $(XDIST) $(PYTEST_ARGS)

test: $(STAMP)
	-$(if $(HUB_PROXY),$(MAKE) --no-print-directory jupyterhub-proxy)
	$(call run_tests,$(PY))

# Parts of it, by the folders of tests/: the package's modules, the chapters (their notebooks
# under nbval and the tests of their text and exercises), the whole system (install, hub,
# browser, concurrency, site).
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-notebooks: $(STAMP)
	MPLBACKEND=Agg $(PY) -m pytest chapters tests/chapters --nbval-lax --nbval-current-env $(PYTEST_ARGS)

test-system: $(STAMP)
	$(PY) -m pytest tests/system $(PYTEST_ARGS)

# Drift before users meet it: a separate environment with the newest release of everything that
# pyproject.toml allows (not the lock), built afresh each time, and the whole suite in it. torch
# comes through pip, which honours a machine's own constraints (this workplace caps torch at the
# builds it keeps on disk); everything else through uv at its highest allowed versions.
LATEST ?= .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)" torch
	$(LATEST)/bin/uv pip install --python $(LATEST)/bin/python --quiet --compile-bytecode --resolution highest -e ".[dev]"
	$(LATEST)/bin/uv pip list --python $(LATEST)/bin/python > $(LATEST)/versions.txt
	$(call run_tests,$(LATEST)/bin/python)

bench: $(STAMP)
	$(PY) -m dmlbook.bench all

# On a machine with a GPU: every gpu-marked test, chapter 8 on the GPU and the GPU benchmarks,
# one table at the end (dmlbook/bench/gpu.py). It installs nothing: it runs with .venv's Python
# where there is one (`make install TORCH=torch==2.13.0` puts a CUDA build there), else with the
# machine's own python3 and its torch, the package taken from this checkout.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_PY) -m dmlbook.bench gpu-check

# The learners' exercise copies (solutions replaced by stubs) in build/exercise-copies/, and
# grading them (or the folder EXERCISE_COPIES names): a table, and grades.json in that folder.
EXERCISE_COPIES ?= build/exercise-copies
copy-exercises: $(STAMP)
	$(PY) -m dmlbook.classroom copy-exercises chapters/ $(EXERCISE_COPIES)

grade: $(STAMP)
	$(PY) -m dmlbook.classroom grade $(EXERCISE_COPIES)

# The book as a static site in build/site/ (open build/site/index.html): the chapters with their
# outputs and plots, the glossary, the guides in docs/, the API reference and an offline search.
# Chapters come from the runs `make test` keeps (build/executed/); those missing run now.
site: $(STAMP)
	$(PY) -m dmlbook.book site build/site

# A class on one server (jupyterhub/, docs/guides/instructors.md): JupyterHub's proxy from npm,
# exactly the versions in jupyterhub/package-lock.json, into jupyterhub/node_modules (not global).
# The hub configuration and the `hub` test find it there. Needs node and npm.
$(CHP): jupyterhub/package.json jupyterhub/package-lock.json
	npm ci --prefix jupyterhub --no-audit --no-fund --loglevel=error
	touch $(CHP)

jupyterhub-proxy: $(CHP)

lint: $(STAMP)
	$(VENV)/bin/ruff check dmlbook tests examples
	$(VENV)/bin/ruff format --check dmlbook tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format dmlbook tests examples
	$(VENV)/bin/ruff check --fix dmlbook tests examples

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .ruff_cache *.egg-info
