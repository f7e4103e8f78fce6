#!/usr/bin/env bash
# On a GPU machine that cannot reach PyPI, from the repository root: the PASTA recipe (train.recipe) on the real
# Gemma 3 270M, from records made beforehand on any machine (`python -m train.recipe --out $RUN --stages records
# --seq-len 320`, carried with the call), then bench.learned on what it trained, in free decoding.
# Needs what bench/gpu/stage.sh describes. STAGES: the recipe's stages (default baseline_sft,pasta_sft,bonbon;
# the shipped adapters' SFT stages: STAGES=baseline_sft,pasta_sft). RECIPE_FLAGS: its flags after --out and --stages;
# RECIPE_S and LEARNED_S bound the two runs (LEARNED_S=0 skips bench.learned); LIMIT and LEARNED_FLAGS: bench.learned's
# prompts and decoding flags (default --repetition-penalty 1.1, the shipped default's settings).
# On an H200 (2026-11-28), with --seq-len 320 --epochs 3 on 613 records: each SFT stage (228 steps) took about
# 2 minutes, 93 s of the first one compiling, and BoNBoN's sampling had only begun at RECIPE_S=330; the whole
# recipe in one call wants RECIPE_S of about 540 and LEARNED_S=0. A stage cut off resumes in the next call.
# Brings back under ${OUT:-runs/gpu}: device.txt, recipe.txt, learned.txt and learned.md, and one tgz per trained
# adapter (model/ with its metrics and loss curve, no checkpoints), each ~15 MB.
source bench/gpu/stage.sh
source bench/gpu/device_info.sh
run=${RUN:-runs/gpu16}
md5sum "$PASTA_GGUF" | tee -a "$out/device.txt"
start=$(date +%s)
timeout "${RECIPE_S:-300}" python3 -m train.recipe --out "$run" --stages "${STAGES:-baseline_sft,pasta_sft,bonbon}" \
  ${RECIPE_FLAGS:-} 2>&1 | tr '\r' '\n' | grep --line-buffered -v "it/s\]$" | tee "$out/recipe.txt"
echo "recipe: $(( $(date +%s) - start )) s" | tee -a "$out/recipe.txt"
bundle() {  # bundle NAME FOLDER: an adapter and its training curves, small enough to come back
  [ -f "$run/$2/model/adapter.safetensors" ] || return 0
  tar czf "$out/$1.tgz" -C "$run" --exclude=checkpoints --exclude=pairs "$2"
}
bundle baseline_sft baseline_sft; bundle pasta_sft pasta_sft
pasta=$run/pasta_sft/model
for round in "$run"/bonbon_l*/round_1/train; do  # every lambda's round; bench.learned takes the last
  [ -d "$round/model" ] || continue
  lam=${round#"$run"/bonbon_}; lam=${lam%%/*}; bundle "bon_$lam" "${round#"$run"/}"; pasta=$round/model
done
[ "${LEARNED_S:-200}" -gt 0 ] || exit 0
timeout "${LEARNED_S:-200}" python3 -m bench.learned --limit "${LIMIT:-100}" ${LEARNED_FLAGS:---repetition-penalty 1.1} \
  --model "$pasta" --baseline "$run/baseline_sft/model" --out runs/gpu_learned 2>&1 \
  | tr '\r' '\n' | grep --line-buffered -v "it/s\]$" | tee "$out/learned.txt"
cp runs/gpu_learned/learned.md "$out/" 2>/dev/null
exit 0
