#!/usr/bin/env bash
# Upstream Megatron-LM with patches/ applied, trained end to end on 4 CPU ranks by its own
# megatron.training loop (get_model, train_step, save/load_checkpoint, logging) with PRT as
# the forward-backward function: P=2, R=2 wave, uni and bi, local layer spec, for
# pretrain_gpt.py (--mock-data) and pretrain_bert.py (examples/bert/ from core_v0.18; a tiny
# real corpus and tokenizer, below). Each case trains 6 iterations saving at 3, then a second
# run loads the iteration-3 checkpoint and must continue the same losses (megatron_lm_check),
# once per checkpoint format in FORMATS (default "torch torch_dist": Megatron's legacy format
# and its default, distributed one, saved fully parallel over the data-parallel ranks).
# Also: --pipeline-reuse-* without --pipeline-reuse must stop the run naming the flag, and
# --pipeline-reuse auto's pick, made before the save, must be run by the resumed run, and a
# --pipeline-reuse-plan run must resume.
# Dropout is 0: on CPU, "CUDA" RNG is the CPU generator, which the resumed run's DataLoaders
# draw their seeds from after load_checkpoint restored it (on GPU they draw from the CPU
# generator, dropout from the CUDA one), so with dropout a resumed CPU run masks differently.
#
# Usage: scripts/megatron_lm_smoke.sh MEGATRON_LM_DIR [OUT_DIR]
#   MEGATRON_LM_DIR: a Megatron-LM checkout with its tag's patches applied (patches/README.md:
#                    core_v0.16.1 or core_v0.19.0)
#   PYTHON: an interpreter with torch (CPU), megatron-core and Megatron-LM's requirements
#           (six regex einops triton pyyaml pydantic pybind11 psutil; sentencepiece, and
#           transformers from core_v0.19); docs/gpu.md has the venvs.
#   FORMATS: the --ckpt-format values to save and resume with (default "torch torch_dist").
#   AUTO_FORMATS: those of the --pipeline-reuse auto and --pipeline-reuse-plan cases, GPT
#                 (default "torch_dist").
#   RUN_TIMEOUT: seconds one training run may take before it counts as failed (default 1200).
# Never on a GPU process: the CPU harness (megatron_prt/megatron/megatron_lm_cpu.py) refuses.
set -euo pipefail
mlm=$(cd "${1:?usage: $0 MEGATRON_LM_DIR [OUT_DIR]}" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-$root/out/megatron_lm_smoke}
PY=${PYTHON:-python3}
pybin=$(dirname "$(command -v "$PY")")
mkdir -p "$out"
bert_script=pretrain_bert.py  # examples/bert/ from core_v0.18
[ -f "$mlm/$bert_script" ] || bert_script=examples/bert/pretrain_bert.py
for script in pretrain_gpt.py "$bert_script"; do
    grep -q megatron_prt "$mlm/$script" || {
        echo "$mlm/$script: patches not applied; run: git -C $mlm apply $root/patches/<its tag>/*.patch" >&2
        exit 2; }
done
(cd "$mlm" && PYTHONPATH=$mlm "$PY" -W ignore -c 'import torch, megatron.core as m
print(f"torch {torch.__version__}, megatron-core {m.__version__} from {m.__path__[0]}")')

# Megatron's dataset index helpers, built for this interpreter (its Makefile asks python3-config,
# which may be another Python).
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
make -s -C "$mlm/megatron/core/datasets" LIBEXT="$suffix" CPPFLAGS="$("$PY" -m pybind11 --includes)"
# BERT's tokenizer. Up to core_v0.18 Megatron-LM has its own tokenizers (--legacy-tokenizer):
# the SentencePiece model bert_data.py trains. From core_v0.19 only megatron-core's remain,
# whose SentencePiece library gives BERT its [CLS]/[SEP]/[MASK] ids only for special tokens
# named in a dict, which Megatron-LM's command line cannot pass (--tokenizer-special-tokens is
# a list): there a WordPiece vocab (trained here with Hugging Face `tokenizers`) through
# HuggingFaceTokenizer, which needs `transformers`.
if [ -d "$mlm/megatron/training/tokenizer" ]; then
    bert_data=$out/bert
    [ -f "$bert_data/tokenizer.model" ] || PYTHONPATH=$root "$PY" "$root/examples/bert_data.py" \
        prepare --out "$bert_data" --vocab-size 2048
    bert_tokenizer=(--tokenizer-type SentencePieceTokenizer
        --tokenizer-model "$bert_data/tokenizer.model" --legacy-tokenizer)
else
    bert_data=$out/bert-wordpiece
    if [ ! -f "$bert_data/tokenizer_config.json" ]; then
        mkdir -p "$bert_data/train"
        "$PY" -c 'import sys, pydoc_data.topics as t; from tokenizers import BertWordPieceTokenizer
wordpiece = BertWordPieceTokenizer(lowercase=True)
wordpiece.train_from_iterator(list(t.topics.values()), vocab_size=2048,
    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
wordpiece.save_model(sys.argv[1])' "$bert_data/train"
        PYTHONPATH=$root "$PY" "$root/examples/bert_data.py" prepare --out "$bert_data" \
            --vocab-file "$bert_data/train/vocab.txt"
        echo '{"tokenizer_class": "BertTokenizer", "do_lower_case": true}' \
            >"$bert_data/tokenizer_config.json"
    fi
    bert_tokenizer=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$bert_data")
fi

common=(--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
    --transformer-impl local --no-masked-softmax-fusion --no-bias-gelu-fusion
    --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8
    --lr 1e-3 --lr-decay-style constant --train-iters 6 --eval-iters 0 --eval-interval 1000
    --log-interval 1 --pipeline-model-parallel-size 2
    --hidden-dropout 0 --attention-dropout 0)
gpt=(pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 1,0,0)
bert=("$bert_script" --spec local --data-path "$bert_data/pydoc_text_sentence"
    "${bert_tokenizer[@]}" --split 100,0,0)

train() {  # train LOG ARGS...: 4 CPU ranks, one thread each, through the CPU harness
    local log=$1; shift
    (cd "$mlm" && PATH=$pybin:$PATH PYTHONPATH=$mlm:$root OMP_NUM_THREADS=1 \
        timeout "${RUN_TIMEOUT:-1200}" "$PY" -m torch.distributed.run --nproc-per-node 4 --master-port "${PORT:-29531}" \
        -m megatron_prt.megatron.megatron_lm_cpu "$@") >"$log" 2>&1
}

failed=0
echo "== refusal: --pipeline-reuse-placement wave --pipeline-reuse-direction bi, no --pipeline-reuse"
if train "$out/refuse.log" "${gpt[@]}" "${common[@]}" --pipeline-reuse-placement wave \
    --pipeline-reuse-direction bi; then
    echo "FAIL: trained without --pipeline-reuse"; failed=1
elif grep -q "pipeline-reuse-direction given without --pipeline-reuse" "$out/refuse.log"; then
    grep -m1 -o "megatron-prt: error: .*" "$out/refuse.log"
else
    echo "FAIL: stopped for another reason, see $out/refuse.log"; failed=1
fi

for format in ${FORMATS:-torch torch_dist}; do
    for model in gpt bert; do
        for direction in uni bi; do
            name=$model-wave-$direction-$format
            declare -n script=$model
            reuse=(--pipeline-reuse 2 --pipeline-reuse-placement wave
                --pipeline-reuse-direction "$direction" --ckpt-format "$format")
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
done
resume_case() {  # resume_case NAME ARGS...: GPT, 6 iterations saving at 3, resumed at 3
    local name=$1; shift
    rm -rf "$out/$name.ckpt"
    echo "== $name: 6 iterations, checkpoint at 3"
    train "$out/$name.log" "${gpt[@]}" "${common[@]}" "$@" \
        --save "$out/$name.ckpt" --save-interval 3 || { echo "FAIL, see $out/$name.log"; return 1; }
    echo "== $name: resumed from iteration 3"
    train "$out/$name.resumed.log" "${gpt[@]}" "${common[@]}" "$@" \
        --load "$out/$name.ckpt" --ckpt-step 3 || { echo "FAIL, see $out/$name.resumed.log"; return 1; }
    PYTHONPATH=$root "$PY" -m megatron_prt.megatron.megatron_lm_check \
        "$out/$name.log" "$out/$name.resumed.log" --resumed-at 3
}

# --pipeline-reuse auto: profiled iterations 1-3, then its pick (one candidate: the tuned
# plan, no measured pick); the checkpoint at 3 holds the pick in Megatron-LM's args and the
# resumed run runs it from its first iteration, profiling nothing. --pipeline-reuse-plan: a
# plan file's run resumes (the saved args hold the plan).
plan_file=$out/plan-wave-bi.json
PYTHONPATH=$root "$PY" -c 'import sys
from megatron_prt.core import Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.tune.plan_file import PlanFile
PlanFile(build_plan(Placement(2, 2, "wave", "bi"), 2), (1, 1, 1, 1)).write(sys.argv[1])' "$plan_file"
for format in ${AUTO_FORMATS:-torch_dist}; do
    name=gpt-auto-$format
    if resume_case "$name" --pipeline-reuse auto:2 --pipeline-reuse-placement wave \
        --pipeline-reuse-auto-candidates 1 --ckpt-format "$format"; then
        grep -m1 -o "megatron-prt: --pipeline-reuse auto: running .*" "$out/$name.resumed.log" || {
            echo "FAIL: the resumed run did not run the checkpoint's pick, see $out/$name.resumed.log"
            failed=1; }
    else failed=1; fi
    resume_case "gpt-plan-$format" --pipeline-reuse-plan "$plan_file" --ckpt-format "$format" \
        || failed=1
done
[ $failed = 0 ] && echo "megatron_lm_smoke: all passed" || echo "megatron_lm_smoke: FAILED"
exit $failed
