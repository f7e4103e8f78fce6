#!/bin/bash
# bench.interpreter --limit 20 before (da4155c) and after (HEAD) side by side: one core each, same time
side=$1; core=$2; bench=$3; shift 3
dir=/tmp/wt_$side
cd $dir && echo "START $side $(git rev-parse --short HEAD) $(date)" && \
PYTHONPATH=$dir taskset -c $core python -c "import pasta_jax,sys; print(pasta_jax.__file__)" && \
PYTHONPATH=$dir taskset -c $core python -m bench.$bench "$@"; echo "END $(date)"
