#!/usr/bin/env bash
# On a GPU machine, from the repository root, random weights (nothing staged): plain decoding's step and the
# interpreter's (bench.seq_cost), then each variant of bench/gpu/step_variants.py in its own process, with its
# optimized HLO dumped: kernels per decode step (the loop body's fusions and custom calls), the first variant's
# HLO brought back (one tgz), and each variant's first 8 replayed logits set against the base's.
# VARIANTS (default base,rowpad,fused); SEQ_S and VARIANT_S bound each part. Logs go under ${OUT:-runs/gpu}.
source bench/gpu/device_info.sh
VARIANTS=${VARIANTS:-base,rowpad,fused}
[ "${SEQ_S:-150}" -gt 0 ] && timeout "${SEQ_S:-150}" python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 \
  --repeats 3 --blocks 1,8 --buckets on 2>&1 | tee "$out/seq_cost.txt"
logits=$(mktemp -d)
first=1
for v in ${VARIANTS//,/ }; do
  flags="${XLA_FLAGS_EXTRA:-} --xla_dump_to=$logits/hlo_$v --xla_dump_hlo_as_text"
  XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout "${VARIANT_S:-100}" python3 -m bench.gpu.step_variants --variant "$v" \
    --logits-to "$logits/$v.npy" ${VARIANT_FLAGS:-} 2>&1 | grep -v "^W0\|^I0" | tail -4 | tee -a "$out/variants.txt"
  python3 -m bench.loop_kernels $(ls "$logits/hlo_$v"/*jit_prefill_and_run*after_optimizations.txt | head -1) 2>&1 \
    | tail -3 | tee -a "$out/variants.txt"
  [ "$first" = 1 ] && (cd "$logits/hlo_$v" \
    && tar czf "$out/hlo.tgz" $(ls | grep "prefill_and_run.*after_optimizations.txt$"))
  first=0
done
python3 - "$logits" <<'EOF' 2>&1 | tee -a "$out/variants.txt"
import glob, os, sys
import numpy as np
folder = sys.argv[1]
base = np.load(f"{folder}/base.npy") if os.path.exists(f"{folder}/base.npy") else None
for path in sorted(glob.glob(f"{folder}/*.npy")):
  got = np.load(path)
  if base is not None:
    print(f"{os.path.basename(path)}: max |logit - base| {np.abs(got - base).max():.4f} (|base| up to "
          f"{np.abs(base).max():.1f}); argmax equal on {(got.argmax(-1) == base.argmax(-1)).mean():.2f} of rows")
EOF
