# Both entry points create .venv and install what they need on a fresh machine.
# torch is pinned first so pip takes the CPU build on this machine's disk, never a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.customgrad-installed
TORCH_PIN ?= torch==2.13.0
# Triton kernels run in the tests on CPU through Triton's interpreter. torch's CPU build pins no
# triton, so the test venv gets this one; make compat's CUDA builds keep the triton they bring.
TRITON_PIN ?= triton==3.9.0
# Real libraries' autograd.Functions for tests/test_real_functions*.py (their kernels in
# Triton's interpreter); --no-deps: they need only torch and triton here.
LIGER_PIN ?= liger-kernel==0.8.5
# A real Hugging Face Llama for tests/test_hf_llama.py, and every package it needs, pinned
# exactly (with torch on the same line: pip never resolves torch); about a minute.
TRANSFORMERS_PINS ?= transformers==5.24.0 huggingface_hub==2.4.0 regex==2026.11.19 \
	safetensors==0.8.0 tokenizers==0.23.3 tqdm==4.70.1 typer==0.29.2 annotated-doc==0.0.7 \
	hf-xet==1.8.0 httpx2==2.16.2 httpcore2==2.16.2 pydantic==2.14.4 pydantic_core==2.50.5 \
	rich==15.0.0 shellingham==1.5.4 annotated-types==0.8.0 anyio==4.16.0 markdown-it-py==4.3.0 \
	truststore==0.10.5 typing-inspection==0.4.5 h11==0.16.0 mdurl==0.1.2
# torchtitan's own models (Llama 3, Qwen3-MoE, DeepSeek-V3) for tests/test_llama_stages.py,
# tests/test_moe_stages.py and tests/test_grouped_mm.py: torchtitan and the packages its model
# code imports with --no-deps (torchtitan's own requirements pull its data and training stack),
# then what those need, pinned exactly.
TORCHTITAN_PINS ?= torchtitan==0.3.0 spmd-types==0.3.1 einops==0.8.2 tyro==1.0.17
TORCHTITAN_DEPS ?= docstring-parser==0.18.0 typeguard==4.6.1

.PHONY: install demo test lint typecheck pytest examples docs gpu-check compat clean pictures

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TRITON_PIN)" "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(LIGER_PIN)" "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check $(TRANSFORMERS_PINS) "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(TORCHTITAN_PINS) "$(TORCH_PIN)"
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCHTITAN_DEPS) "$(TORCH_PIN)"
	touch $(STAMP)

install: $(STAMP)

# A small language model of customgrad ops trained through ScheduleZBVZeroBubble on 2 local
# processes: first-step gradient check, loss, where the bubble comes from, and the measured
# schedule and loss curve in out/zero_bubble.png and out/loss.png.
demo: $(STAMP)
	$(PY) examples/zero_bubble.py

# Every picture of the README and the docs (docs/img/*.png), regenerated from the current code:
# the demo's measured schedule and its replay, its loss curve, explain_split's drawing, the
# predicted bubble at scale, and a measured MoE step with and without W hiding the all-to-all.
# Timings are this machine's: run it on an idle one.
pictures: $(STAMP)
	$(PY) examples/zero_bubble.py --out docs/img
	$(PY) examples/zero_bubble.py --compile --out docs/img/compiled
	$(PY) -m examples.split_picture --out docs/img/explain_split.png
	$(PY) -m benchmarks.scale --out docs/img/scale.png
	$(PY) -m benchmarks.scale --compile --rows 8 --out docs/img/scale_compiled.png
	$(PY) -m benchmarks.moe_overlap --out docs/img/moe_overlap.png

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
	$(PY) examples/zero_bubble.py --check --compile
	$(PY) examples/llama_stages.py --steps 2 --backend aot_eager

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .site

test: lint typecheck pytest examples docs

# On a GPU machine, with the Python and torch installed there (no venv, no downloads): the CUDA
# tests, a zero-bubble step on one GPU against the unsplit step, and the split and compiled
# benchmarks as one table (benchmarks/gpu_check.py; README: On a GPU machine).
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check

# Release check on the other supported torch releases (2.11.0, 2.12.1, 2.14.1 and the newest
# below 2.16): a venv per release (.compat/venv-<v>), the test suite (with CI=true, so a skip
# outside tests/_skips.py's named reasons fails it) and the demo's check in each, one table at
# the end (also in .compat/results.tsv); the target fails if any release failed. Those releases
# come from the registry as CUDA builds (several GB each; they run on the CPU) with the triton
# they were built with; "newest" upgrades its venv to the newest torch below 2.16 on each run.
# PIP_CONSTRAINT=/dev/null lifts this machine's pip cap for these venvs only; CI (make test)
# stays on $(TORCH_PIN). One release, some tests: make compat COMPAT_TORCH=2.12.1
# COMPAT_TESTS=tests/test_releases.py
COMPAT_TORCH ?= 2.11.0 2.12.1 2.14.1 newest
COMPAT_TESTS ?= customgrad tests

compat:
	@mkdir -p .compat; rm -f .compat/results.tsv
	@for v in $(COMPAT_TORCH); do \
	  if [ "$$v" = newest ]; then pin='torch<2.16'; up=--upgrade; else pin="torch==$$v"; up=; fi; \
	  dir=".compat/venv-$$v"; log=".compat/$$v.log"; \
	  echo "== $$pin ($$dir, log $$log)"; \
	  { test -x $$dir/bin/python || $(PYTHON) -m venv $$dir; } > $$log 2>&1; \
	  pip="$$dir/bin/python -m pip install --quiet --disable-pip-version-check"; \
	  if ! { PIP_CONSTRAINT=/dev/null $$pip $$up "$$pin" && PIP_CONSTRAINT=/dev/null $$pip -e ".[dev]"; } >> $$log 2>&1; then \
	    printf '%s\t%s\t%s\t%s\n' "$$pin" "install failed" "-" "-" >> .compat/results.tsv; continue; \
	  fi; \
	  version=$$($$dir/bin/python -c 'import torch; print(torch.__version__)'); \
	  CI=true $$dir/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) >> $$log 2>&1; rc=$$?; \
	  tests=$$(grep -E '(passed|failed|errors?|skipped|no tests ran).* in [0-9.]+s' $$log | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$$//'); \
	  if [ $$rc -ne 0 ]; then tests="$$tests (exit $$rc)"; fi; \
	  if $$dir/bin/python examples/zero_bubble.py --check >> $$log 2>&1; then demo=ok; else demo=FAILED; fi; \
	  printf '%s\t%s\t%s\t%s\n' "$$pin" "$$version" "$$tests" "$$demo" >> .compat/results.tsv; \
	done
	@printf '\n%-14s %-14s %-60s %s\n' "asked" "torch" "pytest" "zero_bubble --check"
	@awk -F'\t' '{ printf "%-14s %-14s %-60s %s\n", $$1, $$2, $$3, $$4 }' .compat/results.tsv
	@! grep -qE 'install failed|\(exit [0-9]+\)|FAILED' .compat/results.tsv

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache .compat
