#!/usr/bin/env bash
# `trainbench bench` at full size on the GPU machine, each bench.json copied to $OUT/<name>.json with its console.
#   perf/bench_figures.sh lora      the 70B LoRA, FP8 base, 40 blocks' activations offloaded, none recomputed
#   perf/bench_figures.sh lora-auto the 70B LoRA with no layout keys: the layout planned for this GPU
#   perf/bench_figures.sh llm       Llama 3.1 8B in FP8, 2 and 6 blocks measured, extrapolated to 32
#   perf/bench_figures.sh llm-row   the same with an optimizer step per row (global batch 1)
#   perf/bench_figures.sh bert      BERT-large at MLPerf's batch (768 = 48 x 16 accumulation on one GPU), fixed rows
#   perf/bench_figures.sh bert-packed  the same on packed rows (about 2 samples a row), as the run trains
#   perf/bench_figures.sh llm-hf bert-hf lora-hf   the same with HF transformers (+ peft) beside, --compare hf
#   perf/bench_figures.sh gpt-oss-hf  gpt_oss_20b with GPT-OSS's block and vocabulary, 2 and 4 blocks to 24, with
#                                     transformers' GptOssForCausalLM beside (--compare hf)
#   perf/bench_figures.sh gpt-oss     gpt_oss_20b with the reference's block, 2 and 4 blocks to 24
#   perf/bench_figures.sh flux-hf     flux1's MMDiT, 2 and 4 blocks (2 + 4 and 4 + 8 double + single) to 19, with
#                                     diffusers' FluxTransformer2DModel beside (--compare hf); a step of 64
#                                     samples (16 micro-batches), not the preset's 512, to keep the call short
# Run from the repository root with trainbench importable (pip install -e . or PYTHONPATH=src).
set -euo pipefail
OUT=${OUT:-/tmp/bench_out}
RESULTS=${RESULTS:-/tmp/bench_results}
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1

bench() {  # NAME ARGS...: one measurement; its bench.json and console into $OUT
    local name=$1
    shift
    python3 -m trainbench bench "$@" output.results_dir="$RESULTS/$name" progress=false 2>&1 | tee "$OUT/$name.log"
    local folder
    folder=$(ls -d "$RESULTS/$name"/*/ | tail -n 1)
    cp "$folder/bench.json" "$OUT/$name.json"
}

for what in "$@"; do
    case $what in
    lora) bench lora llama2_70b_lora --preset llama2-70b perf.layout=manual model.base_precision=fp8 \
        perf.offload_blocks=40 --steps 2 --warmup 1 ;;
    lora-auto) bench lora_auto llama2_70b_lora --preset llama2-70b --steps 2 --warmup 1 --profile-steps 0 ;;
    llm) bench llm llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        --steps 3 --warmup 2 ;;
    llm-row) bench llm_row llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        data.global_batch_size=1 --steps 8 --warmup 3 ;;  # an optimizer step per row
    bert) bench bert bert --preset large perf.compile=true --steps 5 --warmup 3 ;;
    bert-packed) bench bert_packed bert --preset large perf.compile=true data.layout=packed --steps 5 --warmup 3 ;;
    llm-hf) bench llm_hf llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        --steps 3 --warmup 2 --compare hf ;;
    bert-hf) bench bert_hf bert --preset large perf.compile=true data.layout=packed --steps 2 --warmup 1 \
        --compare hf ;;  # HF on fixed rows of the same samples (it has no packed rows)
    lora-hf) bench lora_hf llama2_70b_lora --preset llama2-70b perf.layout=manual model.base_precision=fp8 \
        --blocks 4,8 --steps 2 --warmup 1 --compare hf ;;
    gpt-oss-hf) bench gpt_oss_hf gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true --blocks 2,4 \
        --steps 3 --warmup 2 --compare hf ;;
    gpt-oss) bench gpt_oss gpt_oss_20b --preset gpt-oss-20b perf.compile=true --blocks 2,4 --steps 3 --warmup 2 ;;
    flux-hf) bench flux_hf flux1 --preset flux1-schnell perf.compile=true --blocks 2,4 data.global_batch_size=64 \
        --steps 3 --warmup 2 --compare hf ;;
    *) echo "unknown measurement $what (lora, lora-auto, llm, llm-row, bert, bert-packed, llm-hf, bert-hf, lora-hf," \
        "gpt-oss-hf, gpt-oss, flux-hf)" >&2; exit 2 ;;
    esac
done
