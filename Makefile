# Every command in the README is a target here. Each target bootstraps .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck proto bench-cache clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Start the cache service, a worker and the gateway on the embedded default model.
run: $(STAMP)
	$(PY) -m kvserve_launch

# Lint, type-check, then every test (under the fast BLAS the worker uses: kvserve_model/blas.py).
test: $(STAMP) lint typecheck
	$(PY) -m kvserve_model.blas run -- $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvcache_service gateway kvserve_launch kvserve_model worker

# Regenerate kvserve_proto/ from proto/ (tests fail when they disagree).
proto: $(STAMP)
	$(PY) scripts/protogen.py

bench-cache: $(STAMP)
	$(PY) bench/bench_kvcache.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
