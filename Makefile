# Set-up is part of every target: `make run` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: a looser spec pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed
# Test processes (pytest-xdist): CI has two cores; whole files go to one worker (module fixtures stay shared),
# in collection order (tests/conftest.py puts the longest files first; xdist would sort by test count).
TEST_WORKERS ?= 2

# torch_npu is never installed here (without CANN it breaks `import torch`): its wheel is only
# downloaded, to re-extract the pinned op schemas that kernels_ascend is checked against.
TORCH_NPU := 2.14.0
NPU_CACHE := .cache/torch_npu

.PHONY: run test lint install clean check-npu-schemas

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e ".[test,structured,cuda,bench,serve]" $(TORCH_CPU)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/offline_inference.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m kernels_ascend.schemas.check
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The committed kernels_ascend/schemas/torch_npu-$(TORCH_NPU).json must equal a fresh extraction from
# the wheel (downloaded once into $(NPU_CACHE); fails loudly when the download fails).
check-npu-schemas: $(STAMP)
	ls $(NPU_CACHE)/torch_npu-$(TORCH_NPU)-*.whl >/dev/null 2>&1 || \
		$(BIN)/python -m pip download -q --no-deps torch-npu==$(TORCH_NPU) -d $(NPU_CACHE) || \
		{ echo "check-npu-schemas: cannot download torch-npu==$(TORCH_NPU) (network?)" >&2; exit 1; }
	$(BIN)/python -m kernels_ascend.schemas.extract --check $(NPU_CACHE)/torch_npu-$(TORCH_NPU)-*.whl

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
