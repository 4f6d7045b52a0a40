#!/usr/bin/env bash
# 50 steps of the BERT-large preset (GBS 768) on one GPU in bf16, plus the GPU test tier.
# Usage: bash perf/bert_large_check.sh OUTDIR
# Writes OUTDIR/run_0.json (samples/s, peak memory), OUTDIR/nvidia-smi.txt and OUTDIR/pytest-gpu.txt.
set -euo pipefail
out=${1:?usage: bert_large_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' | tee "$out/env.txt"
data=${DATA:-/tmp/bert-large-data}
python3 -m trainbench prepare bert --synthetic --preset large --train-samples 40000 --eval-samples 1000 \
    --shards 8 --out "$data"
python3 -m trainbench run bert --preset large data.dir="$data" output.results_dir=/tmp/tb-results \
    schedule.max_samples=38400 eval.every_samples=38400 data.eval_samples=1000 progress=false 2>&1 | tail -25 || true  # 50 steps stop short of the target: status aborted
run=$(ls -d /tmp/tb-results/*/ | tail -1)
cp "$run"/run_0.json "$run"/metrics.jsonl "$out"/ || true
python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.txt" | tail -5 || true
