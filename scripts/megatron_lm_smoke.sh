#!/usr/bin/env bash
# Upstream Megatron-LM with patches/ applied, trained end to end on 4 CPU ranks by its own
# megatron.training loop (get_model, train_step, save/load_checkpoint, logging) with PRT as
# the forward-backward function: P=2, R=2 wave, uni and bi, local layer spec, for
# pretrain_gpt.py (--mock-data) and pretrain_bert.py (a tiny real corpus made by
# examples/bert_data.py). Each case trains 6 iterations saving at 3, then a second run loads
# the iteration-3 checkpoint and must continue the same losses (megatron_lm_check). Also:
# --pipeline-reuse-* without --pipeline-reuse must stop the run naming the flag.
# Dropout is 0: on CPU, "CUDA" RNG is the CPU generator, which the resumed run's DataLoaders
# draw their seeds from after load_checkpoint restored it (on GPU they draw from the CPU
# generator, dropout from the CUDA one), so with dropout a resumed CPU run masks differently.
#
# Usage: scripts/megatron_lm_smoke.sh MEGATRON_LM_DIR [OUT_DIR]
#   MEGATRON_LM_DIR: a checkout of core_v0.16.1 with patches/core_v0.16.1 applied (later tags
#                    moved pretrain_bert.py and build GPT from a config: not covered here)
#   PYTHON: an interpreter with torch (CPU), megatron-core and Megatron-LM's requirements
#           (six regex einops triton pyyaml pydantic pybind11); docs/gpu.md has the venv.
# Never on a GPU process: the CPU harness (megatron_prt/megatron/megatron_lm_cpu.py) refuses.
set -euo pipefail
mlm=$(cd "${1:?usage: $0 MEGATRON_LM_DIR [OUT_DIR]}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-$root/out/megatron_lm_smoke}
PY=${PYTHON:-python3}
pybin=$(dirname "$(command -v "$PY")")
mkdir -p "$out"
grep -q megatron_prt "$mlm/pretrain_bert.py" || {
    echo "$mlm: patches not applied; run: git -C $mlm apply $root/patches/<its tag>/*.patch" >&2; exit 2; }

# Megatron's dataset index helpers, built for this interpreter (its Makefile asks python3-config,
# which may be another Python).
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
make -s -C "$mlm/megatron/core/datasets" LIBEXT="$suffix" CPPFLAGS="$("$PY" -m pybind11 --includes)"
[ -f "$out/bert/vocab.txt" ] || PYTHONPATH=$root "$PY" "$root/examples/bert_data.py" prepare \
    --out "$out/bert" --vocab-size 2048

common=(--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
    --transformer-impl local --no-masked-softmax-fusion --no-bias-gelu-fusion
    --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8
    --lr 1e-3 --lr-decay-style constant --train-iters 6 --eval-iters 0 --eval-interval 1000
    --log-interval 1 --ckpt-format torch --pipeline-model-parallel-size 2
    --hidden-dropout 0 --attention-dropout 0)
gpt=(pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 1,0,0)
bert=(pretrain_bert.py --spec local --data-path "$out/bert/pydoc_text_sentence"
    --vocab-file "$out/bert/vocab.txt" --tokenizer-type BertWordPieceLowerCase
    --legacy-tokenizer --split 100,0,0)

train() {  # train LOG ARGS...: 4 CPU ranks, one thread each, through the CPU harness
    local log=$1; shift
    (cd "$mlm" && PATH=$pybin:$PATH PYTHONPATH=$mlm:$root OMP_NUM_THREADS=1 \
        "$PY" -m torch.distributed.run --nproc-per-node 4 --master-port "${PORT:-29531}" \
        -m megatron_prt.megatron.megatron_lm_cpu "$@") >"$log" 2>&1
}

failed=0
echo "== refusal: --pipeline-reuse-placement wave --pipeline-reuse-direction bi, no --pipeline-reuse"
if train "$out/refuse.log" "${gpt[@]}" "${common[@]}" --pipeline-reuse-placement wave \
    --pipeline-reuse-direction bi; then
    echo "FAIL: trained without --pipeline-reuse"; failed=1
elif grep -q "pipeline-reuse-direction given without --pipeline-reuse" "$out/refuse.log"; then
    grep -m1 -o "ConfigError: .*" "$out/refuse.log"
else
    echo "FAIL: stopped for another reason, see $out/refuse.log"; failed=1
fi

for model in gpt bert; do
    for direction in uni bi; do
        name=$model-wave-$direction
        declare -n script=$model
        reuse=(--pipeline-reuse 2 --pipeline-reuse-placement wave
            --pipeline-reuse-direction "$direction")
        rm -rf "$out/$name.ckpt"
        echo "== $name: 6 iterations, checkpoint at 3"
        train "$out/$name.log" "${script[@]}" "${common[@]}" "${reuse[@]}" \
            --save "$out/$name.ckpt" --save-interval 3 || { echo "FAIL, see $out/$name.log"; failed=1; continue; }
        echo "== $name: resumed from iteration 3"
        train "$out/$name.resumed.log" "${script[@]}" "${common[@]}" "${reuse[@]}" \
            --load "$out/$name.ckpt" --ckpt-step 3 \
            || { echo "FAIL, see $out/$name.resumed.log"; failed=1; continue; }
        PYTHONPATH=$root "$PY" -m megatron_prt.megatron.megatron_lm_check \
            "$out/$name.log" "$out/$name.resumed.log" --resumed-at 3 || failed=1
    done
done
[ $failed = 0 ] && echo "megatron_lm_smoke: all passed" || echo "megatron_lm_smoke: FAILED"
exit $failed
