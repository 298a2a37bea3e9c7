#!/usr/bin/env bash
# First thing to run on a GPU machine: megatron-prt's CUDA paths, with a short report.
#   any GPU:     the runtime on one CUDA rank (a plain-PyTorch plan with R=4 chunks) against
#                the unpipelined losses; the runtime parity grid (scripts/gpu_parity.py) and
#                the megatron-core parity subset (scripts/gpu_megatron_parity.py) with 2 and
#                4 ranks sharing the GPUs over gloo (activations through host shared
#                memory); activation memory measured on CUDA against the simulator
#                (scripts/gpu_memory.py); the cost profiler on CUDA; with Transformer Engine
#                installed, the TE-spec parity check (scripts/gpu_te_parity.py, bf16 and fp32,
#                PRT vs megatron's no-pipelining schedule, tolerances in its docstring) on 2
#                ranks over gloo and the profiler with --transformer-impl transformer_engine
#   several GPUs: both parity checks over NCCL, one rank per GPU, the message costs over NCCL
#                (megatron-prt profile --comm nccl: a hop and the bi replica sum between GPUs
#                0 and 1), and the megatron-core GPT
#                example with PRT (megatron's DDP, Adam) on all GPUs (and, with Transformer
#                Engine, examples/pretrain_bert.py on TE layers in bf16). These need NCCL:
#                megatron's DDP all-reduces coalesced CUDA buffers, which gloo refuses.
# Usage: scripts/gpu_smoke.sh [--full]   (from the repository root or inside the image)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
report=()
step() {  # step NAME COMMAND...: run, time, record ok/FAIL
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*" >&2
    if "$@"; then report+=("ok    $name ($((SECONDS - start)) s)")
    else report+=("FAIL  $name ($((SECONDS - start)) s)"); fi
}
echo "GPUs: $gpus; torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')" >&2
if [ "$gpus" -lt 1 ]; then echo "no CUDA GPU visible" >&2; exit 2; fi

step "runtime, 1 rank, R=4 on CUDA" $PY - <<'PY'
import torch, torch.distributed as dist
from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
torch.cuda.set_device(0)
plan = build_plan(Placement(1, 4), 8)
make = lambda i: (torch.manual_seed(i), torch.nn.Linear(256, 256))[1]
stages = {s: m.cuda() for s, m in build_stages(plan.placement, 0, make, 8).items()}
runtime = PipelineRuntime(plan, stages, torch.nn.functional.mse_loss, device="cuda")
xs = [torch.randn(32, 256) for _ in range(8)]
losses = runtime.step(xs, [torch.zeros(32, 256)] * 8)
ref = torch.nn.Sequential(*[make(i) for i in range(8)]).cuda()
want = [torch.nn.functional.mse_loss(ref(x.cuda()), torch.zeros(32, 256, device="cuda")) for x in xs]
assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(losses, want)), (losses, want)
print("runtime on CUDA matches the unpipelined losses")
PY

RUN="$PY -m torch.distributed.run --standalone"
megatron=$($PY -c "import megatron.core" 2>/dev/null && echo yes)
for p in 2 4; do
    step "runtime parity, P=$p ranks sharing $gpus GPU(s) over gloo" $RUN \
        --nproc-per-node $p scripts/gpu_parity.py --backend gloo "$@"
    if [ -n "$megatron" ]; then
        step "megatron-core parity, P=$p ranks sharing $gpus GPU(s) over gloo" $RUN \
            --nproc-per-node $p scripts/gpu_megatron_parity.py --backend gloo "$@"
    fi
done
if [ -n "$megatron" ]; then
    step "activation memory on CUDA vs the simulator, 2 ranks over gloo" $RUN \
        --nproc-per-node 2 scripts/gpu_memory.py --backend gloo
fi

if $PY -c "import megatron_prt.megatron.profile" 2>/dev/null; then
    step "profiler on CUDA" $PY -m megatron_prt profile --model bert --num-layers 4 \
        --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 \
        --vocab-size 1024 --device cuda -o /tmp/prt-costs.json
fi

te=$($PY -c "import transformer_engine" 2>/dev/null && echo yes)
if [ -n "$megatron" ] && [ -n "$te" ]; then
    for dtype in bf16 fp32; do
        step "TE-spec parity $dtype, P=2 ranks sharing $gpus GPU(s) over gloo" $RUN \
            --nproc-per-node 2 scripts/gpu_te_parity.py --backend gloo --dtype $dtype
    done
    step "profiler on CUDA, TE spec" $PY -m megatron_prt profile --model gpt --num-layers 4 \
        --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 \
        --vocab-size 1024 --device cuda --transformer-impl transformer_engine --comm none \
        -o /tmp/prt-costs-te.json
elif [ -n "$megatron" ]; then
    report+=("skip  TE-spec parity (Transformer Engine not importable)")
fi

if [ "$gpus" -ge 2 ]; then
    if [ -n "$megatron" ] && [ -n "$te" ]; then
        step "TE-spec parity bf16 over NCCL, P=$gpus" $RUN --nproc-per-node "$gpus" \
            scripts/gpu_te_parity.py --dtype bf16
    fi
    step "runtime parity over NCCL, P=$gpus" $RUN --nproc-per-node "$gpus" \
        scripts/gpu_parity.py "$@"
    step "megatron-core parity over NCCL, P=$gpus" $RUN --nproc-per-node "$gpus" \
        scripts/gpu_megatron_parity.py "$@"
    if $PY -c "import megatron_prt.megatron.profile" 2>/dev/null; then
        step "message costs over NCCL, GPUs 0 and 1" $PY -m megatron_prt profile --model bert \
            --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
            --micro-batch-size 4 --vocab-size 1024 --device cuda --comm nccl \
            -o /tmp/prt-costs-nccl.json
    fi
    step "megatron-core GPT with PRT, P=$gpus" $RUN --nproc-per-node "$gpus" \
        examples/megatron_gpt.py --device cuda --pipeline-model-parallel-size "$gpus" \
        --num-layers $((4 * gpus)) --pipeline-reuse 2 --pipeline-reuse-placement wave
    if [ -n "$megatron" ] && [ -n "$te" ]; then
        step "examples/pretrain_bert.py, TE layers, bf16, PRT R=2 wave, P=$gpus" $RUN \
            --nproc-per-node "$gpus" examples/pretrain_bert.py --device cuda --bf16 \
            --transformer-impl transformer_engine --pipeline-model-parallel-size "$gpus" \
            --num-layers $((2 * gpus)) --hidden-size 256 --num-attention-heads 4 \
            --seq-length 128 --micro-batch-size 4 --global-batch-size $((8 * gpus)) \
            --pipeline-reuse 2 --pipeline-reuse-placement wave --train-iters 8 --lr 1e-4
    fi
fi

printf '%s\n' "" "gpu_smoke report ($gpus GPU(s)):" "${report[@]}"
! printf '%s\n' "${report[@]}" | grep -q FAIL
