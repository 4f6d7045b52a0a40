# Two entry points: `make demo` (prepare tiny data, train to target, print time and report)
# and `make test` (lint and the fast tier of the tests); `make test-all` runs the whole suite (docs/testing.md).
# All create .venv and install on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

DEMO_DATA    ?= data/bert-tiny
DEMO_RESULTS ?= results

# Independent test modules run in parallel, one worker per core; a module's tests stay on one worker.
PYTEST := $(BIN)/python -m pytest -n auto --dist loadgroup

# The GPU tiers (docs/testing.md) run on a machine with NVIDIA GPUs, in .venv where make built one, else with the
# python3 that holds torch (a GPU machine's own image: trainbench from src/).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_PYTEST := PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -q --dist load
# The single-GPU tier's modules, one a subject: every tests/test_gpu_*.py but the multi-GPU one.
GPU_TESTS := $(filter-out tests/test_gpu_multi.py,$(sort $(wildcard tests/test_gpu_*.py)))

.PHONY: demo test test-all test-gpu test-gpu-multi lint clean image

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,fp8,tensorboard,mlflow]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainbench prepare bert --synthetic --preset tiny --out $(DEMO_DATA)
	$(BIN)/trainbench run bert --preset tiny data.dir=$(DEMO_DATA) output.results_dir=$(DEMO_RESULTS)
	$(BIN)/trainbench report $$(ls -td $(DEMO_RESULTS)/*-bert-tiny*/ | head -n 1)

test: lint
	$(PYTEST) -q -m "not full"

test-all: lint
	$(PYTEST) -q

# One GPU: three workers share it, then the tests that measure its speed run with it to themselves.
test-gpu:
	$(GPU_PYTEST) -n 3 -m "gpu and not multigpu and not alone" $(GPU_TESTS)
	$(GPU_PYTEST) -n 0 -m "gpu and alone" $(GPU_TESTS)

# Two GPUs or more of one host: every parallel path over NCCL, three workers sharing the first two GPUs.
test-gpu-multi:
	$(GPU_PYTEST) -n 3 -m multigpu tests/test_gpu_multi.py

# The container image from the package registries alone (podman, mmdebstrap): docs/containers.md.
image:
	containers/image.sh cpu

lint: $(STAMP)
	$(BIN)/ruff check src tests examples perf
	$(BIN)/ruff format --check src tests examples perf

clean:
	rm -rf $(VENV) $(DEMO_DATA) $(DEMO_RESULTS)
