# The README's two commands. Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of PyTorch; an unpinned torch would pull a multi-GB CUDA build.
# On a CUDA or Apple machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint clean tools

$(INSTALLED): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[mlx,test]"
	touch $@

demo: $(INSTALLED)
	$(BIN)/python scripts/fleet_demo.py $(DEMO_ARGS)

# The agent's unit-file test runs `systemd-analyze verify`; Debian-like machines get it here.
tools:
	@command -v systemd-analyze >/dev/null || ! command -v apt-get >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq systemd >/dev/null; } || \
		echo "systemd-analyze is missing: the unit-file test will be skipped"

test: $(INSTALLED) tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(INSTALLED)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache
