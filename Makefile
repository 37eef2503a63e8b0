# Both entry points create .venv and install what they need on a fresh machine.
# torch is pinned first so pip takes the CPU build on this machine's disk, never a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.customgrad-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test lint typecheck pytest examples docs gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

lint: $(STAMP)
	$(VENV)/bin/ruff check customgrad tests examples benchmarks
	$(VENV)/bin/ruff format --check customgrad tests examples benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest -q customgrad tests

examples: $(STAMP)
	$(PY) examples/quickstart.py

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir .site

test: lint typecheck pytest examples docs

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache
