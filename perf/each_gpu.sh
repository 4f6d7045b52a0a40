#!/usr/bin/env bash
# perf/bench_figures.sh's one-GPU measurements on each GPU of this host alone, side by side, then each one's figure
# and the slowest GPU's: a synchronous step on several GPUs goes at its slowest GPU's pace, so that is the one-GPU
# figure a node's ratio is taken against (two H200 of one host measured up to 1 % apart alone: docs/notes/node.md).
#   perf/each_gpu.sh llm-auto           the 8B's one-GPU figure on GPU 0, GPU 1, ... at once
#   NPROC=2 NODE_EXTRA=distributed.grad_reduce_dtype=bf16 perf/each_gpu.sh llm-auto && perf/bench_figures.sh node-llm
# Each GPU's results are named with -gpuN after TAG (llm_auto-gpu0.json in $OUT, its console beside it) and its
# measurements' folders go under $RESULTS/gpuN; EXTRA, TAG and INDUCTOR reach each as bench_figures.sh reads them.
# GPUS=N takes the first N GPUs (default: every GPU nvidia-smi lists). Ends non-zero where any GPU's measurement
# failed; a TERM or INT stops every GPU's.
# ONE_EACH=1 gives each measurement a GPU of its own instead (the first on GPU 0, the next on GPU 1, ...), all at once:
# several benchmarks' one-GPU figures in the time of the longest, before the node's own measurements, e.g.
#   ONE_EACH=1 perf/each_gpu.sh gpt-oss flux-fp8 llm-auto && NPROC=4 perf/bench_figures.sh node-moe node-flux node-llm
set -euo pipefail
OUT=${OUT:-/tmp/bench_out}
RESULTS=${RESULTS:-/tmp/bench_results}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c ^GPU || true)}
if [ "$#" -eq 0 ] || ! [ "$GPUS" -ge 1 ] 2>/dev/null; then
    echo "usage: perf/each_gpu.sh MEASUREMENT... (perf/bench_figures.sh's one-GPU names), on a host with GPUs" \
        "(GPUS=N where nvidia-smi lists none: found '${GPUS}')" >&2
    exit 2
fi
for what in "$@"; do
    case $what in
    node-*)
        echo "perf/each_gpu.sh measures one GPU at a time; $what runs on NPROC GPUs: give it to" \
            "perf/bench_figures.sh" >&2
        exit 2 ;;
    esac
done
jobs=()  # the measurements of GPU 0, GPU 1, ...
if [ "${ONE_EACH:-0}" = 1 ]; then
    if [ "$#" -gt "$GPUS" ]; then
        echo "perf/each_gpu.sh: ONE_EACH=1 gives each of the $# measurements a GPU of its own, and $GPUS are" \
            "listed: give fewer" >&2
        exit 2
    fi
    jobs=("$@")
else
    for ((gpu = 0; gpu < GPUS; gpu++)); do jobs+=("$*"); done
fi
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
pids=()
stop() {
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    exit 143
}
trap stop TERM INT
for gpu in "${!jobs[@]}"; do
    read -r -a measurements <<< "${jobs[$gpu]}"
    CUDA_VISIBLE_DEVICES=$gpu NPROC=1 TAG="${TAG:-}-gpu$gpu" RESULTS="$RESULTS/gpu$gpu" OUT="$OUT" \
        bash "$here/bench_figures.sh" "${measurements[@]}" > "$OUT/each_gpu$gpu.log" 2>&1 &
    pids+=($!)
done
failed=()
for gpu in "${!jobs[@]}"; do
    wait "${pids[$gpu]}" || failed+=("GPU $gpu ($OUT/each_gpu$gpu.log)")
done
figure() {  # FILE: its tokens/s, else its samples/s, with the unit ("" where neither is there)
    local key value
    for key in tokens_per_s samples_per_s; do
        value=$(grep -o "\"$key\": *[0-9.eE+-]*" "$1" | head -n 1 | sed 's/.*: *//')
        if [ -n "$value" ]; then
            echo "$value ${key%_per_s}/s"
            return
        fi
    done
}
names=()  # each measurement's name, from its results (NAME-gpuN.json, not NAME-gpuN.raw_D.json)
for file in "$OUT"/*"${TAG:-}"-gpu*.json; do
    [[ $file =~ ^.*/(.+)-gpu[0-9]+\.json$ ]] || continue
    [[ " ${names[*]} " == *" ${BASH_REMATCH[1]} "* ]] || names+=("${BASH_REMATCH[1]}")
done
for name in "${names[@]}"; do
    line="" slowest="" at=""
    for gpu in "${!jobs[@]}"; do
        f="$OUT/$name-gpu$gpu.json"
        [ -e "$f" ] || continue
        read -r value unit <<< "$(figure "$f")"
        [ -n "${value:-}" ] || continue
        line+=" GPU $gpu $(printf '%.0f' "$value"),"
        if [ -z "$slowest" ] || awk "BEGIN { exit !($value < $slowest) }"; then
            slowest=$value at=$gpu
        fi
    done
    [ -n "$slowest" ] || continue
    if [ "${ONE_EACH:-0}" = 1 ]; then  # (a GPU of its own: no other GPU's figure of it)
        echo "$name:${line%,} $unit"
    else
        echo "$name:${line%,} $unit; the slowest GPU $at: $(printf '%.0f' "$slowest")"
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed on ${failed[*]}" >&2
    exit 1
fi
