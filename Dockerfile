# Image for every task of the workflows on a GPU cluster (README, "Run on a Flyte cluster"):
#   make image IMAGE=REGISTRY/flyte-rlhf:TAG && docker push REGISTRY/flyte-rlhf:TAG
#   make package IMAGE=REGISTRY/flyte-rlhf:TAG      (or: pyflyte run --remote --image REGISTRY/flyte-rlhf:TAG ...)
# DEPLOY_PRESET / DEPLOY_OVERRIDES must be the ones the workflows are registered with: a task pod
# re-imports the task modules, and actor_update's elastic topology is read from them (tasks/deploy.py).
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ARG DEPLOY_PRESET=configs/llama8b_ppo_gpu.yaml
ARG DEPLOY_OVERRIDES=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /root
COPY pyproject.toml README.md ./
COPY workflows ./workflows
COPY tasks ./tasks
COPY models ./models
COPY kernels ./kernels
COPY configs ./configs
# The GPU build of vLLM; torch comes from the base image.
RUN pip install ".[gpu]"
ENV PYTHONPATH=/root \
    RLHF_DEPLOY_PRESET=${DEPLOY_PRESET} \
    RLHF_DEPLOY_OVERRIDES=${DEPLOY_OVERRIDES}
