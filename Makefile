# Set-up is part of every target: `make run` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: a looser spec pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e ".[test,structured,cuda,bench]" $(TORCH_CPU)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/offline_inference.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
