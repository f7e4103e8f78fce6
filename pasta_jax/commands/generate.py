"""`pasta generate`: stream a plain decode, or run the PASTA interpreter and show its threads."""

from __future__ import annotations

import dataclasses
import sys
import time

from pasta_jax.commands.method_flags import method_from_flags
from pasta_jax.commands.pasta_view import Run, run_pasta, speculation_line
from pasta_jax.decode import api, streaming
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError
from pasta_jax.methods import Method, Pasta, Sequential, Setup, generate_ids, prepared, registry, stream_ids
from pasta_jax.model.load import GENERATION_FILE, generation_defaults, load_model


def _sampling(args) -> SamplingConfig:
  """The flags' sampling, checked before any model loads (a setting not given is off here: see _model_defaults)."""
  try:
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty,
                          distinct_topics=bool(getattr(args, "distinct_topics", None)),
                          fork_bias=getattr(args, "fork_bias", 0.0),
                          max_topic_tokens=getattr(args, "max_topic_tokens", 0))
  except ValueError as err:
    raise PastaError(str(err)) from None


def _model_defaults(sampling: SamplingConfig, args, model, method: Method) -> SamplingConfig:
  """Settings not given on the command line come from the model's `generation.json`, said aloud: its repetition
  penalty, and (for a method that keeps it) its distinct_topics."""
  defaults = generation_defaults(model)
  changes = {}
  if args.repetition_penalty is None and defaults.get("repetition_penalty", 1.0) != 1.0:
    changes["repetition_penalty"] = defaults["repetition_penalty"]
  if (getattr(args, "distinct_topics", None) is None and defaults.get("distinct_topics")
      and method.capabilities.distinct_topics):
    changes["distinct_topics"] = True
  if changes:
    said = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changes.items())
    off = {"repetition_penalty": "--repetition-penalty 1", "distinct_topics": "--no-distinct-topics"}
    print(f"[{said}: this model's {GENERATION_FILE}; {' / '.join(off[k] for k in changes)} "
          f"turn{'s' if len(changes) == 1 else ''} {'it' if len(changes) == 1 else 'them'} off]", file=sys.stderr)
  return dataclasses.replace(sampling, **changes)


def _method(args, model) -> Method:
  """--method (with its option flags), else --pasta, else the method the model's `generation.json` names, said
  aloud (a PASTA model's promised blocks are written only by the interpreter: decoded plainly, their text would be
  missing), else sequential."""
  given = _given_method(args)
  if given is not None:
    return given
  name = generation_defaults(model).get("method")
  if name is None:
    return method_from_flags(Sequential.name, args)
  if name not in registry.METHODS:
    raise PastaError(f"{model.source}/{GENERATION_FILE}: unknown method {name!r}; use one of "
                     f"{', '.join(registry.METHODS)}")
  print(f"[method {name}: this model's {GENERATION_FILE} (it was trained to write {name}'s tags, which only the "
        f"interpreter decodes in full); --method sequential decodes it plainly]", file=sys.stderr)
  return method_from_flags(name, args)


def _given_method(args) -> Method | None:
  """The method the command line names (--method or --pasta) with its option flags, checked before any model
  loads; None when it names none."""
  if args.pasta and args.method and registry.METHODS[args.method] is not Pasta:
    raise PastaError(f"--pasta and --method {args.method} disagree: give one")
  name = args.method or (Pasta.name if args.pasta else None)
  return None if name is None else method_from_flags(name, args)


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
  from pasta_jax.model.mesh import make_mesh, parse_mesh
  return make_mesh(parse_mesh(args.mesh))


def run_generate(args) -> int:
  if args.max_new_tokens < 1:
    raise PastaError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
  if not args.prompt.strip():
    raise PastaError("empty prompt: give some text to continue")
  sampling = _sampling(args)
  given = _given_method(args)  # a bad method flag is said before the model loads
  if given is not None and (sampling.biases_forks or sampling.caps_topics):  # and a knob it has no promise for
    given.check_request(sampling=sampling, runtime=Runtime(), forced=False)
  runtime = Runtime(dtype=args.dtype, mesh=_mesh(args), certify_head=args.certify_head)
  model = load_model(args.model)
  print(f"[model: {model.describe()}]", file=sys.stderr)
  method = _method(args, model)
  sampling = _model_defaults(sampling, args, model, method)
  if args.chat is None:
    args.chat = model.adapter is not None
  prompt_ids = _prompt_ids(model, args.prompt, args.chat)
  method.check_request(sampling=sampling, runtime=runtime, forced=False)  # before any preparation
  if runtime.certify_head and runtime.dtype == "float32":  # another dtype is refused by generate; here the measured
    # plan may skip the certificate at the row counts where this machine's float32 head is no slower: say so
    print(f"[{api.head_plan_line(model.config, runtime.dtype, certify_head=True)}]", file=sys.stderr)
  method = prepared(method, model, Setup([prompt_ids], args.max_new_tokens, runtime))
  run = Run(model, prompt_ids, method, args.max_new_tokens, sampling, runtime)
  if method.capabilities.drafts:
    return show_drafts(run)
  if method.capabilities.threads:
    return run_pasta(run)
  return stream_answer(run)


def stream_answer(run: Run) -> int:
  """Prints the answer as it settles, then its token rate (and what a tree did, or promises it left unkept). Each
  partial result's text is its settled text, which the next one extends (`methods.stream_ids`), so what is
  printed is the final result's text exactly, wherever the chunks end."""
  start = time.perf_counter()
  first_token_at = None
  shown, tokens = "", 0
  for [result] in stream_ids(run.model, [run.prompt_ids], run.method, chunk_steps=8,
                             max_new_tokens=run.max_new_tokens, sampling=run.sampling, runtime=run.runtime):
    if first_token_at is None:
      first_token_at = time.perf_counter() - start
    tokens = len(result.records)
    new = streaming.delta(shown, result.text)
    if new is None:  # printed text cannot be taken back: say so, and print the answer whole
      print("\n[the answer changed after it was printed; in full:]", file=sys.stderr)
      new = result.text
    sys.stdout.write(new)
    sys.stdout.flush()
    shown = result.text
  total = time.perf_counter() - start
  decode_time = max(total - first_token_at, 1e-9)
  rate = (tokens - 1) / decode_time if tokens > 1 else 0.0
  print(f"\n\n[{tokens} tokens; time to first token {first_token_at:.2f}s (includes compile on the first run); "
        f"{rate:.1f} tok/s after it]", file=sys.stderr)
  if result.speculation:
    print(speculation_line(run.method.name, result.speculation), file=sys.stderr)
  if note := unkept_promises_note(result.annotated, run.method.name):
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


def show_drafts(run: Run) -> int:
  """Prints the k drafts, most probable first, with their log probabilities."""
  [result] = generate_ids(run.model, [run.prompt_ids], run.method, max_new_tokens=run.max_new_tokens,
                          sampling=run.sampling, runtime=run.runtime)
  for i, (text, score) in enumerate(zip(result.drafts, result.draft_scores, strict=True), start=1):
    print(f"--- draft {i} (log p {score:.2f})\n{text}")
  print(f"\n[{len(result.drafts)} drafts of up to {run.max_new_tokens} tokens in {result.steps} steps, "
        f"{result.seconds:.2f}s; {run.method.described()}; {result.stop_reason}]", file=sys.stderr)
  return 0
