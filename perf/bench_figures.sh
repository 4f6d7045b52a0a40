#!/usr/bin/env bash
# `trainbench bench` at full size on the GPU machine, each bench.json copied to $OUT/<name>.json with its console.
#   perf/bench_figures.sh lora      the 70B LoRA, FP8 base, 40 blocks' activations offloaded, none recomputed
#   perf/bench_figures.sh lora-auto the 70B LoRA with no layout keys: the layout planned for this GPU
#   perf/bench_figures.sh lora-auto-80 the same within an H100 80GB's memory on a larger GPU (perf.gpu_memory_gib=79.2:
#                                     78.7 GiB usable, what one H100 had free), profiled
#   perf/bench_figures.sh llm       Llama 3.1 8B in FP8, 2 and 6 blocks measured, extrapolated to 32
#   perf/bench_figures.sh llm-row   the same with an optimizer step per row (global batch 1)
#   perf/bench_figures.sh llm-auto  the same as llm with the layout planned for this GPU at each depth
#                                     (perf.plan=auto: the rows a micro-batch, blocks recomputed only where needed)
#   perf/bench_figures.sh llm-shard1  the same as llm sharded by FSDP2 over the one GPU (distributed.shard_one_rank),
#                                     the FP8 weights gathered in FP8: run beside llm, in the same call
#   perf/bench_figures.sh bert      BERT-large at MLPerf's batch (768 = 48 x 16 accumulation on one GPU), fixed rows
#   perf/bench_figures.sh bert-packed  the same on packed rows (about 2 samples a row), as the run trains
#   perf/bench_figures.sh llm-hf bert-hf lora-hf   the same with HF transformers (+ peft) beside, --compare hf
#   perf/bench_figures.sh gpt-oss-hf  gpt_oss_20b with GPT-OSS's block and vocabulary, 2 and 4 blocks to 24, with
#                                     transformers' GptOssForCausalLM beside (--compare hf)
#   perf/bench_figures.sh gpt-oss     gpt_oss_20b with the reference's block, 2 and 4 blocks to 24
#   perf/bench_figures.sh gpt-oss-fp8 gpt_oss_20b (GPT-OSS's block) in FP8 (model.precision=fp8: the experts' grouped
#                                     products and the attention projections), micro-batches of 4, profiled
#   perf/bench_figures.sh gpt-oss-fp8-hf  the same unprofiled, transformers compiled beside at micro-batches of 4
#                                     (--compare hf-compiled: its eager step does not fit at 4 blocks)
#   perf/bench_figures.sh gpt-oss-fp8-ref the reference's block in FP8, micro-batches of 4
#   perf/bench_figures.sh gpt-oss-mb4 gpt_oss_20b (GPT-OSS's block) in bf16, micro-batches of 4: FP8's baseline
#   perf/bench_figures.sh gpt-oss-fp8-hf-80  gpt-oss-fp8-hf within an 80 GB GPU: micro-batches of 1, 1 and 3 blocks
#                                     (a whole repeat of windowed and whole-prefix blocks apart; 4 blocks' fp32
#                                     weights and AdamW state do not leave room on an H100), transformers compiled
#                                     beside
#   perf/bench_figures.sh flux-hf     flux1's MMDiT, 2 and 4 blocks (2 + 4 and 4 + 8 double + single) to 19, with
#                                     diffusers' FluxTransformer2DModel beside (--compare hf); a step of 64
#                                     samples (16 micro-batches), not the preset's 512, to keep the call short
#   perf/bench_figures.sh flux        flux1's MMDiT in bf16, 1 and 2 blocks (1 + 2 and 2 + 4 double + single) to 19,
#                                     the same 64-sample step as micro-batches of 16 (4 accumulated)
#   perf/bench_figures.sh flux-fp8    the same with model.precision=fp8 (torchao's float8 training in the blocks)
#   perf/bench_figures.sh flux-fp8-hf the same as flux-fp8 with diffusers' FluxTransformer2DModel beside (--compare hf)
#   perf/bench_figures.sh flux-bf16-hf  the same as flux (bf16) with diffusers beside
# On one node of several GPUs (NPROC, default: every GPU nvidia-smi lists), each with telemetry in its bench.json:
#   perf/bench_figures.sh node-lora   the 70B LoRA with its layout planned for NPROC GPUs (replicas or a sharded base)
#   perf/bench_figures.sh node-llm    Llama 3.1 8B in FP8, the whole 32-block model sharded over NPROC GPUs, the
#                                     blocks recomputed planned for them (perf.plan=auto: none where they fit)
#   perf/bench_figures.sh node-moe    gpt_oss_20b, experts spread over NPROC GPUs (distributed.ep); the whole model
#                                     on 8 GPUs, 2 and 4 blocks extrapolated on fewer; in FP8:
#                                     EXTRA=model.precision=fp8 TAG=-fp8 perf/bench_figures.sh node-moe
#   perf/bench_figures.sh node-moe-hf the same with GPT-OSS's block and vocabulary (--preset gpt-oss-20b-hf)
#   perf/bench_figures.sh node-moe-fsdp  the reference's block with the layout `--nproc` gives it unasked: every
#                                     parameter, the experts too, sharded by FSDP2 (no distributed.ep), each rank its
#                                     own tokens through every expert; the same depths as node-moe
#   perf/bench_figures.sh node-bert   BERT-large at NVIDIA's node shapes (48 rows x 1 and x 2 accumulation a GPU) on
#                                     NPROC GPUs and on one, for the scaling (BERT_ACCUMULATION=1 takes the x 1 shape
#                                     alone)
#   perf/bench_figures.sh node-flux   flux1's MMDiT in FP8, 1 and 2 blocks to 19, under FSDP2 on NPROC GPUs, each GPU the
#                                     one-GPU figure's step of 64 samples in micro-batches of 16 (flux-fp8)
#   perf/bench_figures.sh node-flux-512  the same at the preset's global batch of 512 samples (MLPerf's first
#                                     reference point) on one GPU and on NPROC, each of those GPUs 512 / NPROC a step:
#                                     the ratio a run of the recipe sees, with a projected time to train
#   perf/bench_figures.sh node-flux-whole  the whole 19-block model the same way on NPROC GPUs alone: what the line
#                                     through 1 and 2 blocks says of its memory and rate, measured
#   perf/bench_figures.sh dlrmv4      dlrmv4's reference layers on one GPU with every table cut to 1 M rows, sharded
#                                     (perf.sharded_tables), micro-batches of 128, a step of 512, profiled
#   perf/bench_figures.sh node-dlrmv4 the same on one GPU and on NPROC, each GPU a step of 512 (the tables' rows
#                                     sharded over the GPUs, the lookups exchanged by all-to-all)
#   perf/bench_figures.sh node-dlrmv4-full  dlrmv4's reference tables whole (293 M rows, 560 GiB with their
#                                     accumulators) sharded over NPROC GPUs (at least 5 H200), GBS 8,192
#   perf/bench_figures.sh node-lora-run  `trainbench run llama2_70b_lora --preset llama2-70b` on NPROC GPUs over
#                                     synthetic rows of MLPerf's GovReport shape, its base drawn from the seed, for
#                                     LORA_SAMPLES samples (default 1,536: the first eval MLPerf's cadence makes at
#                                     GBS 8): a throughput-and-cadence check, not a convergence result
#   perf/bench_figures.sh node-tiny   every benchmark's tiny preset to its target over NCCL on NPROC GPUs; each run's
#                                     summary.json (its compliance verdict) into $OUT; TINY="gpt_oss_20b flux1"
#                                     runs only those
# EXTRA="key=value ..." adds config keys to every bench of the call, TAG=-x appends -x to each result's name, e.g.
#   EXTRA=model.attention=cudnn TAG=-cudnn perf/bench_figures.sh gpt-oss-fp8
# NODE_EXTRA="key=value ..." adds config keys to the benches on more than one GPU alone (keys that one GPU refuses as
# having no effect there), so that a ratio's two runs go in one call, e.g.
#   NPROC=2 NODE_EXTRA=distributed.keep_gathered=true TAG=-kept perf/bench_figures.sh llm-auto node-llm
#   NPROC=2 BERT_ACCUMULATION=1 NODE_EXTRA=distributed.bucket_cap_mb=400 TAG=-b400 perf/bench_figures.sh node-bert
# INDUCTOR="key=value,..." sets torch._inductor options process-wide for every bench of the call (1 and 0 are true and
# false; perf/inductor_options/sitecustomize.py), to compare Inductor's choices without a change to the code, e.g.
#   INDUCTOR=triton.coordinate_descent_tuning=1 TAG=-cdt perf/bench_figures.sh llm
# Run from the repository root with trainbench importable (pip install -e . or PYTHONPATH=src).
set -euo pipefail
OUT=${OUT:-/tmp/bench_out}
RESULTS=${RESULTS:-/tmp/bench_results}
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c ^GPU || echo 1)}
if [ -n "${INDUCTOR:-}" ]; then
    export PYTHONPATH="$PWD/perf/inductor_options${PYTHONPATH:+:$PYTHONPATH}" TRAINBENCH_INDUCTOR_OPTIONS=$INDUCTOR
fi

failed=()
current=""    # the measurement under way, for the trap below
measuring=""  # its process
keep_partial() {  # NAME: a measurement that did not finish: each depth it measured (bench_raw_<depth>.json) into $OUT
    local folder raw
    folder=$(ls -d "$RESULTS/$1"/*/ 2>/dev/null | tail -n 1)
    [ -n "$folder" ] || return 0
    for raw in "$folder"bench_raw_*.json; do
        [ -e "$raw" ] || continue
        cp "$raw" "$OUT/$1.${raw##*/bench_}"
        echo "kept $OUT/$1.${raw##*/bench_}: a depth measured before $1 stopped" >&2
    done
}
# Stopped from outside (a time limit's TERM): the measurement under way is stopped too (`trainbench bench` ends its
# ranks), and what it had measured comes back.
stop() {
    if [ -n "$measuring" ]; then
        kill -TERM "$measuring" 2>/dev/null || true
        wait "$measuring" 2>/dev/null || true
    fi
    [ -n "$current" ] && keep_partial "$current"
    exit 143
}
trap stop TERM INT

bench() {  # NAME ARGS...: one measurement; its bench.json and console into $OUT. A failed one is named at the end
    local name=$1${TAG:-}     # and does not stop the measurements after it (the call's exit code says it failed);
    shift                     # the depths it measured before it failed come back as NAME.raw_<depth>.json
    current=$name
    local node=() previous=""
    for a in "$@"; do  # on more than one GPU: NODE_EXTRA's keys too
        if [ "$previous" = --nproc ] && [ "$a" -gt 1 ]; then read -r -a node <<< "${NODE_EXTRA:-}"; fi
        previous=$a
    done
    # In the background and waited for, so that a TERM reaches stop() at once, not after the measurement.
    # shellcheck disable=SC2086  # EXTRA: keys split on spaces
    python3 -m trainbench bench "$@" ${EXTRA:-} "${node[@]}" output.results_dir="$RESULTS/$name" progress=false \
        > >(trap '' TERM INT; exec tee "$OUT/$name.log") 2>&1 &  # tee outlives a TERM to the group: the last words kept
    measuring=$!
    local code=0
    wait "$measuring" || code=$?
    measuring=""
    if [ "$code" -ne 0 ]; then
        failed+=("$name")
        keep_partial "$name"
        current=""
        return 0
    fi
    current=""
    local folder
    folder=$(ls -d "$RESULTS/$name"/*/ | tail -n 1)
    cp "$folder/bench.json" "$OUT/$name.json"
}

dlrm_bench() {  # NAME N: dlrmv4's reference layers on N GPUs, tables cut to 1 M rows, a step of 512 a GPU, the
    # learning rate the rules' 1e-6 x GBS / 8192
    bench "$1" dlrmv4 --preset dlrmv4 --table-rows 1000000 perf.sharded_tables=true device=cuda perf.compile=true \
        --nproc "$2" data.global_batch_size=$(($2 * 512)) data.micro_batch_size=128 \
        optimizer.lr="$(awk "BEGIN { print 1e-6 * $2 * 512 / 8192 }")" --steps 3 --warmup 2 --profile-steps 1
}

flux_node_bench() {  # NAME N GBS [DEPTH...]: flux1's MMDiT in FP8 on N GPUs, micro-batches of 16; DEPTH: bench's
    local name=$1 n=$2 gbs=$3  # depth arguments (--blocks 1,2: 1 and 2 blocks to 19; none: the whole model)
    shift 3
    bench "$name" flux1 --preset flux1-schnell perf.compile=true model.precision=fp8 "$@" --nproc "$n" \
        data.global_batch_size="$gbs" data.micro_batch_size=16 --steps 3 --warmup 2
}

for what in "$@"; do
    case $what in
    lora) bench lora llama2_70b_lora --preset llama2-70b perf.plan=manual model.base_precision=fp8 \
        perf.offload_blocks=40 --steps 2 --warmup 1 ;;
    lora-auto) bench lora_auto llama2_70b_lora --preset llama2-70b --steps 2 --warmup 1 --profile-steps 0 ;;
    lora-auto-80) bench lora_auto_80 llama2_70b_lora --preset llama2-70b perf.gpu_memory_gib=79.2 --steps 2 --warmup 1 \
        --profile-steps 1 ;;
    llm) bench llm llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        --steps 3 --warmup 2 ;;
    llm-shard1) bench llm_shard1 llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        distributed.shard_one_rank=true --steps 3 --warmup 2 ;;
    llm-auto) bench llm_auto llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true perf.plan=auto \
        --blocks 2,6 --steps 3 --warmup 2 ;;
    llm-row) bench llm_row llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        data.global_batch_size=1 --steps 8 --warmup 3 ;;  # an optimizer step per row
    bert) bench bert bert --preset large perf.compile=true --steps 5 --warmup 3 ;;
    bert-packed) bench bert_packed bert --preset large perf.compile=true data.layout=packed --steps 5 --warmup 3 ;;
    llm-hf) bench llm_hf llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --blocks 2,6 \
        --steps 3 --warmup 2 --compare hf ;;
    bert-hf) bench bert_hf bert --preset large perf.compile=true data.layout=packed --steps 2 --warmup 1 \
        --compare hf ;;  # HF on fixed rows of the same samples (it has no packed rows)
    lora-hf) bench lora_hf llama2_70b_lora --preset llama2-70b perf.plan=manual model.base_precision=fp8 \
        --blocks 4,8 --steps 2 --warmup 1 --compare hf ;;
    gpt-oss-hf) bench gpt_oss_hf gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true --blocks 2,4 \
        --steps 3 --warmup 2 --compare hf ;;
    gpt-oss) bench gpt_oss gpt_oss_20b --preset gpt-oss-20b perf.compile=true --blocks 2,4 --steps 3 --warmup 2 ;;
    gpt-oss-fp8) bench gpt_oss_fp8 gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true model.precision=fp8 \
        --blocks 2,4 data.micro_batch_size=4 --steps 3 --warmup 2 --profile-steps 1 ;;
    gpt-oss-fp8-hf) bench gpt_oss_fp8_hf gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true model.precision=fp8 \
        --blocks 2,4 data.micro_batch_size=4 --steps 3 --warmup 2 --profile-steps 0 --compare hf-compiled ;;
    gpt-oss-fp8-hf-80) bench gpt_oss_fp8_hf_80 gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true \
        model.precision=fp8 --blocks 1,3 data.micro_batch_size=1 --steps 3 --warmup 2 --profile-steps 0 \
        --compare hf-compiled ;;
    gpt-oss-mb4) bench gpt_oss_mb4 gpt_oss_20b --preset gpt-oss-20b-hf perf.compile=true --blocks 2,4 \
        data.micro_batch_size=4 --steps 3 --warmup 2 --profile-steps 0 ;;
    gpt-oss-fp8-ref) bench gpt_oss_fp8_ref gpt_oss_20b --preset gpt-oss-20b perf.compile=true model.precision=fp8 \
        --blocks 2,4 data.micro_batch_size=4 --steps 3 --warmup 2 --profile-steps 0 ;;
    flux-hf) bench flux_hf flux1 --preset flux1-schnell perf.compile=true --blocks 2,4 data.global_batch_size=64 \
        --steps 3 --warmup 2 --compare hf ;;
    flux) bench flux flux1 --preset flux1-schnell perf.compile=true --blocks 1,2 data.global_batch_size=64 \
        data.micro_batch_size=16 --steps 3 --warmup 2 ;;
    flux-fp8) bench flux_fp8 flux1 --preset flux1-schnell perf.compile=true model.precision=fp8 --blocks 1,2 \
        data.global_batch_size=64 data.micro_batch_size=16 --steps 3 --warmup 2 ;;
    flux-fp8-hf) bench flux_fp8_hf flux1 --preset flux1-schnell perf.compile=true model.precision=fp8 --blocks 1,2 \
        data.global_batch_size=64 data.micro_batch_size=16 --steps 5 --warmup 2 --profile-steps 0 --compare hf ;;
    flux-bf16-hf) bench flux_bf16_hf flux1 --preset flux1-schnell perf.compile=true --blocks 1,2 \
        data.global_batch_size=64 data.micro_batch_size=16 --steps 5 --warmup 2 --profile-steps 0 --compare hf ;;
    node-lora) bench node_lora llama2_70b_lora --preset llama2-70b --nproc "$NPROC" --steps 2 --warmup 1 ;;
    node-llm) bench node_llm llama31_8b --preset llama31-8b model.precision=fp8 perf.compile=true --nproc "$NPROC" \
        perf.plan=auto --steps 3 --warmup 2 ;;
    node-moe | node-moe-hf | node-moe-fsdp)
        if [ "$NPROC" -ge 8 ]; then depth=(); else depth=(--blocks 2,4); fi
        if [ "$what" = node-moe-hf ]; then preset=gpt-oss-20b-hf; else preset=gpt-oss-20b; fi
        if [ "$what" = node-moe-fsdp ]; then layout=(); else layout=(distributed.ep="$NPROC"); fi
        bench "${what//-/_}" gpt_oss_20b --preset "$preset" perf.compile=true "${layout[@]}" \
            --nproc "$NPROC" "${depth[@]}" --steps 3 --warmup 2 ;;
    node-bert)
        for accumulation in ${BERT_ACCUMULATION:-1 2}; do
            for n in 1 "$NPROC"; do
                bench "node_bert_${n}x48x${accumulation}" bert --preset large perf.compile=true data.layout=packed \
                    --nproc "$n" data.micro_batch_size=48 data.global_batch_size=$((n * 48 * accumulation)) \
                    --steps 5 --warmup 3
            done
        done ;;
    node-flux) flux_node_bench node_flux "$NPROC" $((NPROC * 64)) --blocks 1,2 ;;
    node-flux-512) for n in 1 "$NPROC"; do flux_node_bench "node_flux_${n}x512" "$n" 512 --blocks 1,2; done ;;
    node-flux-whole) flux_node_bench node_flux_whole "$NPROC" 512 ;;
    dlrmv4) dlrm_bench dlrmv4 1 ;;
    node-dlrmv4) for n in 1 "$NPROC"; do dlrm_bench "node_dlrmv4_$n" "$n"; done ;;
    node-dlrmv4-full) bench node_dlrmv4_full dlrmv4 --preset dlrmv4 device=cuda perf.compile=true --nproc "$NPROC" \
        data.micro_batch_size=128 --steps 3 --warmup 2 --profile-steps 1 ;;
    node-lora-run)
        python3 -m trainbench prepare llama2_70b_lora --synthetic --preset llama2-70b --out "$RESULTS/data_lora_rows" \
            --force --no-progress
        python3 -m trainbench run llama2_70b_lora --preset llama2-70b data.dir="$RESULTS/data_lora_rows" device=cuda \
            --nproc "$NPROC" schedule.max_samples="${LORA_SAMPLES:-1536}" output.results_dir="$RESULTS/run_lora" \
            progress=false 2>&1 | tee "$OUT/run_lora.log" || true  # its summary says how it ended
        cp "$(ls -d "$RESULTS/run_lora"/*/ | tail -n 1)summary.json" "$OUT/run_lora.json" || failed+=(node-lora-run) ;;
    node-tiny)
        for name in ${TINY:-bert llama31_8b gpt3 llama2_70b_lora gpt_oss_20b flux1 dlrmv4}; do
            python3 -m trainbench prepare "$name" --synthetic --preset tiny --out "$RESULTS/data_$name" --force
            python3 -m trainbench run "$name" --preset tiny data.dir="$RESULTS/data_$name" device=cuda \
                --nproc "$NPROC" output.results_dir="$RESULTS/tiny_$name" progress=false 2>&1 | tee "$OUT/tiny_$name.log" \
                || true  # the summary says how each ended; one failure does not stop the others
            cp "$(ls -d "$RESULTS/tiny_$name"/*/ | tail -n 1)summary.json" "$OUT/tiny_$name.json" || true
        done ;;
    *) echo "unknown measurement $what (lora, lora-auto, lora-auto-80, llm, llm-auto, llm-shard1, llm-row, bert, bert-packed, llm-hf, bert-hf, lora-hf," \
        "gpt-oss-hf, gpt-oss, gpt-oss-fp8, gpt-oss-fp8-hf, gpt-oss-fp8-hf-80, gpt-oss-fp8-ref, gpt-oss-mb4, flux-hf, flux, flux-fp8, flux-fp8-hf, flux-bf16-hf, dlrmv4, node-lora, node-llm, node-moe, node-moe-hf, node-moe-fsdp, node-bert, node-flux, node-flux-512, node-flux-whole, node-dlrmv4, node-dlrmv4-full, node-lora-run, node-tiny)" >&2; exit 2 ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]} (their consoles: $OUT/<name>.log)" >&2
    exit 1
fi
