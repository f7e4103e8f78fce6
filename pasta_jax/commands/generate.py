"""`pasta generate`: stream a plain decode, or run the PASTA interpreter and show its threads."""

from __future__ import annotations

import dataclasses
import sys
import time

import jax.numpy as jnp

from pasta_jax.commands.pasta_view import speculation_line
from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError
from pasta_jax.model.load import GENERATION_FILE, generation_defaults, load_model


def _sampling(args) -> SamplingConfig:
  """The flags' sampling, checked before any model loads (a setting not given is off here: see _model_defaults)."""
  try:
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty,
                          distinct_topics=bool(getattr(args, "distinct_topics", None)))
  except ValueError as err:
    raise PastaError(str(err)) from None


def _model_defaults(sampling: SamplingConfig, args, model, method: str = "pasta") -> SamplingConfig:
  """Settings not given on the command line come from the model's `generation.json`, said aloud: its repetition
  penalty, and (for method pasta, the one that keeps it) its distinct_topics."""
  defaults = generation_defaults(model)
  changes = {}
  if args.repetition_penalty is None and defaults.get("repetition_penalty", 1.0) != 1.0:
    changes["repetition_penalty"] = defaults["repetition_penalty"]
  if getattr(args, "distinct_topics", None) is None and defaults.get("distinct_topics") and method == "pasta":
    changes["distinct_topics"] = True
  if changes:
    said = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changes.items())
    off = {"repetition_penalty": "--repetition-penalty 1", "distinct_topics": "--no-distinct-topics"}
    print(f"[{said}: this model's {GENERATION_FILE}; {' / '.join(off[k] for k in changes)} "
          f"turn{'s' if len(changes) == 1 else ''} {'it' if len(changes) == 1 else 'them'} off]", file=sys.stderr)
  return dataclasses.replace(sampling, **changes)


def _method(args, model) -> str:
  """--method, else --pasta, else the method the model's `generation.json` names, said aloud (a PASTA model's
  promised blocks are written only by the interpreter: decoded plainly, their text would be missing), else
  sequential."""
  if args.method or args.pasta:
    method = args.method or "pasta"
    if args.pasta and method != "pasta":
      raise PastaError(f"--pasta and --method {method} disagree: give one")
    return method
  method = generation_defaults(model).get("method", "sequential")
  if method != "sequential":
    print(f"[method {method}: this model's {GENERATION_FILE} (it was trained to write {method}'s tags, which only "
          f"the interpreter decodes in full); --method sequential streams it plainly]", file=sys.stderr)
  return method


def _prompt_ids(model, text: str, chat: bool) -> list[int]:
  if not text.strip():
    raise PastaError("empty prompt: give some text to continue")
  tok = model.tokenizer
  return tok.encode(tok.format_chat(text) if chat else text, add_bos=True)


def _mesh(args):
  """--mesh data,fsdp,tensor -> a jax Mesh over all devices (after the multi-host start-up), or None."""
  from pasta_jax.training.distributed import maybe_initialize_distributed
  maybe_initialize_distributed(force=args.multi_host)
  if not args.mesh:
    return None
  from pasta_jax.commands.plan import _parse_mesh
  from pasta_jax.training.config import MeshConfig
  from pasta_jax.training.partitioning import make_mesh
  return make_mesh(MeshConfig(**_parse_mesh(args.mesh)))


def run_generate(args) -> int:
  if args.max_new_tokens < 1:
    raise PastaError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
  if not args.prompt.strip():
    raise PastaError("empty prompt: give some text to continue")
  sampling = _sampling(args)
  dtype = jnp.dtype(args.dtype)
  args.mesh_obj = _mesh(args)
  model = load_model(args.model)
  print(f"[model: {model.describe()}]", file=sys.stderr)
  method = _method(args, model)
  sampling = _model_defaults(sampling, args, model, method)
  if args.chat is None:
    args.chat = model.adapter is not None
  prompt_ids = _prompt_ids(model, args.prompt, args.chat)
  if method == "superposed":
    if args.certify_head:
      raise PastaError("--certify-head certifies greedy argmax choices; --method superposed reads its drafts' "
                       "probabilities from the logits")
    return run_superposed(model, prompt_ids, args, dtype)
  if args.drafts != 3:
    raise PastaError("--drafts is for --method superposed")
  if (args.heads or args.tree_size) and method not in api.TREE_METHODS:
    raise PastaError("--heads and --tree-size are for --method medusa, propd or pasta+medusa")
  extra = tree_options(model, prompt_ids, args, method) if method in api.TREE_METHODS else {}
  if args.certify_head:
    extra["certify_head"] = True
    if dtype == jnp.float32:  # another dtype is refused by generate; here the measured plan may skip the
      # certificate at the row counts where this machine's float32 head is no slower: say so
      print(f"[{api.head_plan_line(model.config, dtype, certify_head=True)}]", file=sys.stderr)
  if method in ("pasta", "pasta-v0", "pasta+medusa"):
    from pasta_jax.commands.pasta_view import run_pasta

    return run_pasta(model, prompt_ids, args, sampling, dtype, method, extra)
  start = time.perf_counter()
  first_token_at = None
  shown, tokens = "", 0
  for [result] in api.stream_ids(model, [prompt_ids], method=method, chunk_steps=8, mesh=args.mesh_obj,
                                 max_new_tokens=args.max_new_tokens, sampling=sampling, dtype=dtype, **extra):
    if first_token_at is None:
      first_token_at = time.perf_counter() - start
    tokens = len(result.records)
    sys.stdout.write(result.text[len(shown):])
    sys.stdout.flush()
    shown = result.text
  total = time.perf_counter() - start
  decode_time = max(total - first_token_at, 1e-9)
  rate = (tokens - 1) / decode_time if tokens > 1 else 0.0
  print(f"\n\n[{tokens} tokens; time to first token {first_token_at:.2f}s (includes compile on the first run); "
        f"{rate:.1f} tok/s after it]", file=sys.stderr)
  if result.speculation:
    print(speculation_line(method, result.speculation), file=sys.stderr)
  if note := unkept_promises_note(result.annotated, method):
    print(note, file=sys.stderr)
  return 0


def unkept_promises_note(annotated: str, method: str) -> str:
  """A PASTA model decoded by a method that runs no forks writes promises whose blocks nobody writes: their text is
  missing from the answer. Say so, and how to get it ('' when the answer made no promise)."""
  promises = annotated.count("<promise")
  if not promises:
    return ""
  return (f"[the model wrote {promises} promise{'s' if promises > 1 else ''} whose block{'s' if promises > 1 else ''} "
          f"only the PASTA interpreter writes: {'their' if promises > 1 else 'its'} text is missing from this "
          f"{method} answer; --pasta decodes them]")


def tree_options(model, prompt_ids: list[int], args, method: str) -> dict:
  """--method medusa / propd / pasta+medusa: the heads, the tree size, and for ProPD a latency model measured here."""
  from pasta_jax.decode.latency import calibrate_latency
  from pasta_jax.decode.speculation import default_tree_size, load_drafter
  drafter = load_drafter(model, args.heads)
  options = {"heads": drafter, "tree_size": args.tree_size or default_tree_size(method)}
  if method == "propd":
    print("[propd: timing each tree size on this device (calibration)...]", file=sys.stderr)
    certify = {"certify_head": True} if args.certify_head else {}  # time the steps it will run
    cal = calibrate_latency(model, [prompt_ids], drafter, tree_size=options["tree_size"], steps=8, repeats=1,
                            run_tokens=args.max_new_tokens, **certify)
    options["latency"], options["tree_size"] = cal["table"], cal["tree_size"]
    if not cal["tree_pays"]:
      print(f"[propd: no tree of {cal['timed_tree']} nodes can beat a plain step here (T(1) "
            f"{1e3 * cal['table'][1]:.1f} ms, T(2) {1e3 * cal['table'][2]:.1f} ms; speculation.tree_pays): "
            "decoding plainly]", file=sys.stderr)
  return options


def run_superposed(model, prompt_ids: list[int], args, dtype) -> int:
  """Prints the k drafts, most probable first, with their log probabilities."""
  if args.temperature or args.top_k or args.top_p != 1.0:
    raise PastaError("--method superposed searches its drafts deterministically (tau 0.06, as the paper): "
                     "drop --temperature/--top-k/--top-p")
  ngram = None if args.ngram == "none" else args.ngram
  if ngram == "default":
    from pasta_jax.data.ngram_corpus import ensure_default_index
    ngram = str(ensure_default_index(model.tokenizer, model.describe()))
  [result] = api.generate_ids(model, [prompt_ids], method="superposed", drafts=args.drafts, ngram=ngram,
                              mesh=args.mesh_obj,
                              max_new_tokens=args.max_new_tokens, dtype=dtype)
  for i, (text, score) in enumerate(zip(result.drafts, result.draft_scores, strict=True), start=1):
    print(f"--- draft {i} (log p {score:.2f})\n{text}")
  smoothing = "no n-gram smoothing" if ngram is None else f"n-gram index: {ngram}"
  print(f"\n[{len(result.drafts)} drafts of up to {args.max_new_tokens} tokens in {result.steps} steps, "
        f"{result.seconds:.2f}s; {smoothing}; {result.stop_reason}]", file=sys.stderr)
  return 0
