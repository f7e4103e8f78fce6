#!/bin/bash
# A bench before and after, side by side: one pinned core per side, started together. First:
#   git worktree add /tmp/wt_before da4155c && git worktree add /tmp/wt_after 819ecac
#   ln -s "$(realpath ../shared)" /tmp/shared   # the worktrees find their data in ../shared
# then: side_by_side.sh before 0 interpreter --limit 20 & side_by_side.sh after 1 interpreter --limit 20
side=$1; core=$2; bench=$3; shift 3
dir=/tmp/wt_$side
cd $dir && echo "START $side $(git rev-parse --short HEAD) $(date)" && \
PYTHONPATH=$dir taskset -c $core python -c "import pasta_jax,sys; print(pasta_jax.__file__)" && \
PYTHONPATH=$dir taskset -c $core python -m bench.$bench "$@"; echo "END $(date)"
