# megatron-prt on NVIDIA's NGC PyTorch image: upstream Megatron-LM at a pinned tag with
# patches/ applied, megatron-prt installed next to it. The image's torch, apex and
# transformer-engine are used as they are (megatron-prt is installed with --no-deps).
#
#   make docker                      # docker build -t megatron-prt .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       megatron-prt torchrun --nproc-per-node 8 pretrain_bert.py ... --pipeline-reuse 4
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_LM_REF=core_v0.16.1
ARG MEGATRON_LM_REPO=https://github.com/NVIDIA/Megatron-LM.git

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_CONSTRAINT="" \
    PYTHONDONTWRITEBYTECODE=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace
COPY patches/ /opt/megatron-prt/patches/
# Megatron-LM at the tag the patches target; its megatron/ package shadows any pip megatron-core.
RUN git clone --depth 1 --branch "${MEGATRON_LM_REF}" "${MEGATRON_LM_REPO}" /workspace/Megatron-LM \
    && git -C /workspace/Megatron-LM apply /opt/megatron-prt/patches/*.patch \
    && make -C /workspace/Megatron-LM/megatron/core/datasets

COPY pyproject.toml README.md /opt/megatron-prt/
COPY megatron_prt/ /opt/megatron-prt/megatron_prt/
COPY examples/ /opt/megatron-prt/examples/
COPY scripts/ /opt/megatron-prt/scripts/
COPY tests/ /opt/megatron-prt/tests/
RUN python -m pip install --no-cache-dir --no-deps -e /opt/megatron-prt \
    && chmod -R a+rwX /workspace

ENV PYTHONPATH=/workspace/Megatron-LM
WORKDIR /workspace/Megatron-LM
CMD ["bash"]
