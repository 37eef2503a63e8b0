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

# A small language model of customgrad ops trained through ScheduleZBVZeroBubble on 2 local
# processes: first-step gradient check, loss, where the bubble comes from, and the measured
# schedule and loss curve in out/zero_bubble.png and out/loss.png.
demo: $(STAMP)
	$(PY) examples/zero_bubble.py

lint: $(STAMP)
	$(VENV)/bin/ruff check customgrad tests examples benchmarks
	$(VENV)/bin/ruff format --check customgrad tests examples benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(PY) -m pytest -q customgrad tests

examples: $(STAMP)
	$(PY) examples/quickstart.py
	$(PY) -m examples.ops
	$(PY) examples/zero_bubble.py --check

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .site

test: lint typecheck pytest examples docs

# On a GPU machine: the CUDA tests (pipelines on 1 or 2 GPUs with NCCL), then the pipeline
# benchmark on the GPUs as one table, with a model big enough for a GPU.
gpu-check: $(STAMP)
	$(PY) -m pytest -q -m cuda -p no:cacheprovider customgrad tests
	$(PY) benchmarks/pipeline.py --device cuda --dim 2048 --hidden 8192 --batch 8192 --rounds 5

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache
