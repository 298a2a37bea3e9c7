# megatron-prt on NVIDIA's NGC PyTorch image: upstream Megatron-LM at a pinned tag with
# patches/ applied, megatron-prt installed next to it. The image's torch, apex and
# transformer-engine are used as they are (megatron-prt is installed with --no-deps).
#
#   make docker                      # docker build -t megatron-prt .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       megatron-prt torchrun --nproc-per-node 8 pretrain_bert.py ... --pipeline-reuse 4
# BASE_IMAGE: the NGC release the Megatron-LM tag itself builds on (its docker/.ngc_version.dev;
# the build stops on another). The pairs patches/ has (megatron-core is the tag's own):
#   MEGATRON_LM_REF=core_v0.16.1  BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3  megatron-core 0.16.1
#   MEGATRON_LM_REF=core_v0.19.0  BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3  megatron-core 0.19.1
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
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
    && { grep -qxF "${BASE_IMAGE}" /workspace/Megatron-LM/docker/.ngc_version.dev \
        || { echo "${MEGATRON_LM_REF} builds on $(cat /workspace/Megatron-LM/docker/.ngc_version.dev), not ${BASE_IMAGE}: pass --build-arg BASE_IMAGE=$(cat /workspace/Megatron-LM/docker/.ngc_version.dev)" >&2; exit 1; }; } \
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
# Build-time checks (no GPU here): Megatron-LM's training package imports; the megatron-core
# imported is the tag's; the patched pretrain_bert.py (examples/bert/ from core_v0.18) and
# pretrain_gpt.py take the --pipeline-reuse* flags and their validation hook runs (a PRT
# flag without --pipeline-reuse is refused by name; through the CPU harness, as Megatron-LM
# asserts CUDA first; not --help, which core_v0.19.0's own argparse help text breaks: an
# unescaped % in --moe-paged-stash-buffer-size-factor-cuda); our unit tests that need no GPU.
RUN python -c "import megatron.training.training, megatron_prt.megatron.megatron_lm" \
    && python -c "import megatron.core as m; assert m.__file__.startswith('/workspace/Megatron-LM/'), m.__file__; print('megatron-core', m.__version__)" \
    && bert=pretrain_bert.py && { [ -f "$bert" ] || bert=examples/bert/pretrain_bert.py; } \
    && for script in "$bert" pretrain_gpt.py; do \
        { python -m megatron_prt.megatron.megatron_lm_cpu "$script" --spec local \
            --pipeline-reuse-placement wave > /tmp/refusal.log 2>&1 || true; } \
        && grep -q -- "--pipeline-reuse-placement given without --pipeline-reuse" /tmp/refusal.log \
        || { echo "$script: the patched flags are not validated" >&2; cat /tmp/refusal.log >&2; exit 1; }; \
    done \
    && python -m pytest -q -x -p no:cacheprovider --rootdir /opt/megatron-prt \
        /opt/megatron-prt/tests/megatron/test_megatron_args.py \
        /opt/megatron-prt/tests/megatron/test_megatron_lm_glue.py \
        /opt/megatron-prt/tests/megatron/test_megatron_lm_cpu.py \
        /opt/megatron-prt/tests/megatron/test_megatron_lm_ckpt.py \
        /opt/megatron-prt/tests/core/test_placement.py /opt/megatron-prt/tests/sim/test_sim.py
CMD ["bash"]
