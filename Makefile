# Quick start: `make demo` (set up + simulate the default preset), `make test` (set up + tests).
# `make lint` (ruff, its formatter, mypy) and `make test-fast` (no slow or vLLM tests) while working.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SIM_STAMP := $(VENV)/.installed-sim
ALL_STAMP := $(VENV)/.installed-all
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-rlsched

.PHONY: demo lint test test-fast test-vllm fuzz bench bench-rl clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The simulator alone: no torch.
$(SIM_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(SIM_STAMP)

# Everything the tests need. torch is installed first, as TORCH_SPEC says: the CPU build by
# default (a bare torch would pull a multi-GB CUDA build); on a GPU machine, for example,
# `make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"`. The
# executor extra accepts what is installed. Re-installed when the requirements change.
TORCH_SPEC ?= torch==2.13.0
$(ALL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[dev,executor,distributed]'
	touch $(ALL_STAMP) $(SIM_STAMP)

demo: $(SIM_STAMP)
	$(BIN)/rlsched simulate

# ruff's rules and formatter over the code, mypy over the torch-free packages ([tool.mypy]).
lint: $(ALL_STAMP)
	$(BIN)/ruff check rlsched tests bench
	$(BIN)/ruff format --check rlsched tests bench
	$(BIN)/python -m mypy

# The main suite on two workers, each taking whole test files (a file's module fixtures are
# built once): half the tests wait on subprocesses and imports, not on the cores.
PYTEST_MAIN := $(BIN)/python -m pytest -n 2 --dist loadfile

# Lint, the main suite, then the vLLM tests (pytest -m vllm) in .venv-vllm, vLLM's CPU build.
# The vLLM tests run even when the main suite failed; make reports both and fails if either did.
test: lint $(VLLM_STAMP)
	@main=0; vllm=0; \
	$(PYTEST_MAIN) || main=$$?; \
	$(VLLM_VENV)/bin/python -m pytest -m vllm -p no:cacheprovider || vllm=$$?; \
	echo "make test: main suite exit $$main, vLLM suite exit $$vllm (0: passed)"; \
	[ $$main -eq 0 ] && [ $$vllm -eq 0 ]

# The main suite without the slow, the vLLM and the end-to-end (e2e) tests: minutes, while working.
test-fast: $(ALL_STAMP)
	$(PYTEST_MAIN) -m 'not slow and not vllm and not e2e'

# The input fuzzer (tests/test_fuzz.py, docs/testing.md) at 20,000 random examples a property
# (the main suite runs it derandomized, at RLSCHED_FUZZ_EXAMPLES's default); a failure prints
# hypothesis's seed and a reproduction blob.
FUZZ_EXAMPLES ?= 20000
fuzz: $(ALL_STAMP)
	RLSCHED_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/test_fuzz.py

# .venv-vllm: vLLM's CPU build (bench/peers/setup_vllm.sh, idempotent) plus rlsched installed
# editable. Everything vLLM already installed (torch 2.13.0+cpu, transformers, tokenizers,
# safetensors, numpy, ...) is pinned as a constraint, so pip only adds what rlsched needs and
# replaces nothing. `make test-vllm` runs the vLLM tests alone.
$(VLLM_STAMP): pyproject.toml bench/peers/setup_vllm.sh
	bash bench/peers/setup_vllm.sh >/dev/null
	$(VLLM_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^rlsched' > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -c $(VLLM_VENV)/constraints.txt \
		-e '.[dev,distributed]' safetensors tokenizers
	$(VLLM_VENV)/bin/python -c "import torch, vllm, rlsched; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m vllm

bench: $(ALL_STAMP)
	$(BIN)/python bench/sim_effects.py
	$(BIN)/python bench/sim_speed.py
	$(BIN)/python bench/policies.py
	$(BIN)/python bench/engine.py   # vLLM-CPU rows need bench/peers/setup_vllm.sh first

# The RL loop on CPU (about 40 minutes on 2 cores): end-to-end speedup, drafter freshness,
# simulator fidelity against real runs, the closed loop profile -> fit -> learn -> run, and
# live reallocation on two Ray instances.
bench-rl: $(ALL_STAMP)
	$(BIN)/python bench/rl_e2e.py
	$(BIN)/python bench/drafter_fresh.py
	$(BIN)/python bench/fidelity.py
	bench/closed_loop.sh
	$(BIN)/python bench/realloc.py

clean:
	rm -rf $(VENV) runs .pytest_cache
