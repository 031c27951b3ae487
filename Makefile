# Quick start: `make demo` (set up + simulate the default preset), `make test` (set up + tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install when the project's requirements change. The executor extra pins torch to the
# CPU build found locally (a bare torch would pull a multi-GB CUDA build); its tests need it.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,executor]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlsched simulate

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/sim_effects.py
	$(BIN)/python bench/sim_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache
