# The README's two commands. Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of PyTorch; an unpinned torch would pull a multi-GB CUDA build.
# On a CUDA or Apple machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint clean

$(INSTALLED): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[mlx,test]"
	touch $@

demo: $(INSTALLED)
	$(BIN)/python scripts/fleet_demo.py $(DEMO_ARGS)

test: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(INSTALLED)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache
