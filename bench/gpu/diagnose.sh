#!/usr/bin/env bash
# On a GPU machine, from the repository root (JAX with CUDA; no install of this package needed): what the
# interpreter's one-lane step adds to plain decoding's, kernel by kernel. The loop runs as a CUDA graph there
# (pasta_jax/xla_flags.py), so a profiler trace shows one launch a step; the kernels are counted instead in XLA's
# optimized HLO, dumped while bench.seq_cost times plain decoding against the interpreter (1 and 8 lanes, lane
# buckets on), by bench.loop_kernels. With ATTENTION=1, bench.attention (the GPU kernel against XLA) follows.
# Brings back device.txt, seq_cost.txt, loop_kernels.txt, hlo.tgz (the decode modules), attention.txt under
# ${OUT:-runs/gpu}. About 4 minutes on a fresh machine (5 with ATTENTION=1).
source bench/gpu/device_info.sh
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*prefill_and_run.*" \
  timeout "${SEQ_S:-300}" python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1,8 \
  --buckets on 2>&1 | tee "$out/seq_cost.txt"
modules=$(ls /tmp/dump/*prefill_and_run*after_optimizations.txt)
python3 -m bench.loop_kernels $modules 2>&1 | tee "$out/loop_kernels.txt"
tar czf "$out/hlo.tgz" $modules
[ "${ATTENTION:-0}" = 1 ] && timeout "${ATTN_S:-100}" python3 -m bench.attention --runs 3 --visible 0.1,1.0 2>&1 \
  | tee "$out/attention.txt"
exit 0
