# megatron-prt on NVIDIA's NGC PyTorch image: upstream Megatron-LM at a pinned tag with
# patches/ applied, megatron-prt installed next to it. The image's torch, apex and
# transformer-engine are used as they are (megatron-prt is installed with --no-deps).
#
#   make docker                      # docker build -t megatron-prt .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       megatron-prt torchrun --nproc-per-node 8 pretrain_bert.py ... --pipeline-reuse 4
# BASE_IMAGE: the NGC release the Megatron-LM tag itself builds on (its docker/.ngc_version.dev:
# 25.11-py3 at core_v0.16.1). Another MEGATRON_LM_REF needs its patches/ series and its NGC tag.
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
# Megatron-LM at a tag with patches (patches/<tag>/series), installed editable so that the
# megatron-core the image runs is the tag's own, with its [mlm] extra; the image's torch,
# apex and transformer-engine satisfy the rest and are left as they are. einops, pydantic,
# pyyaml, regex and six are imported by megatron.training at this tag without being declared;
# pytest-timeout and hypothesis run our unit tests below. Versions follow the tag (unpinned
# there), hence DL3013.
# hadolint ignore=DL3013
RUN git clone --depth 1 --branch "${MEGATRON_LM_REF}" "${MEGATRON_LM_REPO}" /workspace/Megatron-LM \
    && head -n1 "/opt/megatron-prt/patches/${MEGATRON_LM_REF}/series" | grep -q "^${MEGATRON_LM_REF} " \
    && git -C /workspace/Megatron-LM apply /opt/megatron-prt/patches/"${MEGATRON_LM_REF}"/*.patch \
    && python -m pip install --no-cache-dir --no-build-isolation -e "/workspace/Megatron-LM[mlm]" \
    && python -m pip install --no-cache-dir einops pydantic pyyaml regex six pytest-timeout hypothesis \
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
# Build-time checks (no GPU here): Megatron-LM's training package imports; the patched
# pretrain_bert.py (examples/bert/ from core_v0.18) parses and lists the --pipeline-reuse flags (through the CPU harness, as
# Megatron-LM asserts CUDA before it parses); our unit tests that need no GPU pass.
RUN python -c "import megatron.training.training, megatron_prt.megatron.megatron_lm" \
    && script=pretrain_bert.py && { [ -f "$script" ] || script=examples/bert/pretrain_bert.py; } \
    && python -m megatron_prt.megatron.megatron_lm_cpu "$script" --spec local --help \
        > /tmp/pretrain_bert.help \
    && grep -q -- "--pipeline-reuse-placement" /tmp/pretrain_bert.help \
    && python -m pytest -q -x -p no:cacheprovider --rootdir /opt/megatron-prt \
        /opt/megatron-prt/tests/test_megatron_args.py /opt/megatron-prt/tests/test_megatron_lm_glue.py \
        /opt/megatron-prt/tests/test_megatron_lm_cpu.py /opt/megatron-prt/tests/test_placement.py \
        /opt/megatron-prt/tests/test_sim.py
CMD ["bash"]
