#!/usr/bin/env bash
# On a GPU machine that cannot reach PyPI, from the repository root: the shipped Pasta-BoN against the shipped
# Baseline-SFT in free decoding (bench.learned), then Medusa and ProPD (bench.medusa), on the real Gemma 3 270M.
# What earlier calls staged (bench/gpu/stage.sh), plus adapters/ there: the shipped adapters (baseline-sft,
# pasta-bon with its Medusa heads), which stay behind while the GGUF travels.
# Writes logs under ${OUT:-runs/gpu}; LIMIT, LEARNED_S and MEDUSA_S size the runs.
source bench/gpu/stage.sh
source bench/gpu/device_info.sh
mkdir -p pasta_jax/adapters && cp -rn "$stage"/adapters/* pasta_jax/adapters/
md5sum "$PASTA_GGUF" | tee -a "$out/device.txt"
timeout "${LEARNED_S:-300}" python3 -m bench.learned --limit "${LIMIT:-100}" --repetition-penalty 1.1 \
  --out runs/gpu_learned 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tee "$out/learned.txt"
cp runs/gpu_learned/learned.md runs/gpu_learned/quality_pareto.png "$out/" 2>/dev/null
tar czf "$out/learned_run.tgz" -C runs gpu_learned
timeout "${MEDUSA_S:-170}" python3 -m bench.medusa --runs 2 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
  | tee "$out/medusa.txt"
