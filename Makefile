# Thin wrappers; the logic lives in pyproject.toml, dmlbook/ and tests/.
# `make lab` and `make test` create .venv on first use. On a machine with GPUs, choose the torch
# build you want, e.g. `make test TORCH=torch` (the default pins the CPU build used in CI).
VENV    ?= .venv
PYTHON  ?= python3
TORCH   ?= torch==2.13.0
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install lab test test-unit test-notebooks bench lint format clean student grade book

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# JupyterLab refuses to run as root without --allow-root (containers, cloud VMs).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) chapters/

test: $(STAMP)
	MPLBACKEND=Agg $(PY) -m pytest tests chapters --nbval-lax --nbval-current-env $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-notebooks: $(STAMP)
	MPLBACKEND=Agg $(PY) -m pytest chapters --nbval-lax --nbval-current-env $(PYTEST_ARGS)

# Student copies (solutions replaced by stubs) in student/, and grading them: a table and JSON.
student: $(STAMP)
	$(PY) -m dmlbook.classroom student chapters/ student/

grade: $(STAMP)
	$(PY) -m dmlbook.classroom grade student/

# Every chapter executed and written as HTML with its plots, for reading without Jupyter.
book: $(STAMP)
	env -u MPLBACKEND $(VENV)/bin/jupyter nbconvert --to html --execute --ExecutePreprocessor.timeout=900 \
		--output-dir build/book chapters/*.ipynb

bench: $(STAMP)
	$(PY) -m dmlbook.bench all

lint: $(STAMP)
	$(VENV)/bin/ruff check dmlbook tests examples
	$(VENV)/bin/ruff format --check dmlbook tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format dmlbook tests examples
	$(VENV)/bin/ruff check --fix dmlbook tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
