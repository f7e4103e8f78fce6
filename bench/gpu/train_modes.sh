#!/usr/bin/env bash
# On a GPU machine, from the repository root: Pasta-SFT trained once per position mode (train.sft --position-mode)
# with the shipped Pasta-SFT's flags, on records made beforehand on any machine (`python -m train.recipe --out RUN
# --stages records --seq-len 320`) and carried in .stage/records/train.jsonl. Needs what bench/gpu/stage.sh describes
# (the GGUF in parts sent by earlier calls; the wheels and gguf.md5 in .stage/ with this call).
# MODES (default fixed,pred-1x), RUN (default runs/pos_ablation), TRAIN_FLAGS (more train.sft flags); TRAIN_S bounds
# each mode's run (a run cut off resumes from its checkpoint in the next call). On an H200 (2026-11-30): Fixed-40 152 s
# (most of it compiling), Pred-1x 70 s from the persistent compilation cache. Brings back under ${OUT:-runs/gpu}:
# device.txt, train_MODE.txt and MODE.tgz (the exported adapter with its metrics and loss curve, no checkpoints,
# ~14 MB).
stage=${STAGE:-/root/gs}
mkdir -p "$stage" && cp -r .stage/. "$stage/"
source bench/gpu/stage.sh
source bench/gpu/device_info.sh
export JAX_COMPILATION_CACHE_DIR=$stage/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
md5sum "$PASTA_GGUF" | tee -a "$out/device.txt"
MODES=${MODES:-fixed,pred-1x} run=${RUN:-runs/pos_ablation}
for mode in ${MODES//,/ }; do
  start=$(date +%s)
  timeout "${TRAIN_S:-150}" python3 -m train.sft --data "$stage/records/train.jsonl" --objective sft --annotate none \
    --out "$run/${mode}_3ep" --seq-len 320 --epochs 3 --batch-size 8 --lr 3e-4 --warmup-steps 10 \
    --lora-rank 16 --lora-alpha 16 --lora-targets q,k,v,o,gate,up,down --kl-weight 0 --seed 0 \
    --position-mode "$mode" --save-every 50 ${TRAIN_FLAGS:-} 2>&1 | tr '\r' '\n' \
    | grep --line-buffered -v "it/s, loss\|s/it, loss" | tail -25 | tee "$out/train_$mode.txt"
  echo "$mode: $(( $(date +%s) - start )) s" | tee -a "$out/train_$mode.txt"
  [ -d "$run/${mode}_3ep/model" ] && tar czf "$out/$mode.tgz" -C "$run" --exclude=checkpoints "${mode}_3ep"
done
exit 0
