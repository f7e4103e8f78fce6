#!/usr/bin/env bash
# On a GPU machine (H100 80GB), from the repository root: Gemma 7B in its real shapes with random bf16 weights.
# Decoding at batch 1 against the weight-read roofline, a PASTA step with 8 live lanes against a one-lane step,
# then one masked-SFT step on tpu_configs/gemma7b_sft_h100x1.json (step time, peak memory against `pasta plan`,
# MFU). Writes logs under ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 250 python3 -m bench.seq_cost --config gemma1-7b --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1,8 \
  --buckets on 2>&1 | tee "$out/seq_cost_7b.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 timeout 250 python3 -m bench.train --config tpu_configs/gemma7b_sft_h100x1.json \
  --steps 2 2>&1 | tr '\r' '\n' | grep -v "it/s" | tee "$out/train_7b.txt"
