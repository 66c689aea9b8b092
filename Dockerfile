# Image for every task of the workflows on a GPU cluster:
#   docker build -t REGISTRY/flyte-rlhf:TAG . && docker push REGISTRY/flyte-rlhf:TAG
#   pyflyte run --remote --image REGISTRY/flyte-rlhf:TAG workflows/ppo.py ppo_training ...
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

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
ENV PYTHONPATH=/root
