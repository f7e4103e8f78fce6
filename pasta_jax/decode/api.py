"""The public decode API: `generate(model, prompts, method=...)` -> one `Result` per prompt.

One entry for every method the interpreter runs: "pasta" (PASTA-LANG tags fork threads), "apar"
(APAR's fork/child tokens), "sot" (Skeleton-of-Thought's point fan-out: give the point prompts
as `scripts`; the skeleton stage is `pasta_jax.baselines.sot`), "sequential" (plain decoding, one
lane) and "superposed" (Superposed Decoding: k drafts from one decode). It tokenizes (Gemma chat
turns by default), sizes a bucketed pool, runs the jitted loop (`loop.prefill_and_run`,
`step.decode_step` with the method's rules) and turns the records into text, the tagged text, a trace
and speed metrics (`result.py`). `forced_answers` replays given
answers (promise form, or APAR's text form for "apar") instead of sampling; `stream` returns the
results so far after each chunk of steps, the loop staying on device in between.

Compiles are rare by construction: one Gemma module per (config, dtype) keeps `model_fn` stable (a
jit static argument), prompts and the pool are bucketed to powers of two, and forced scripts are
padded to the pool size, so only the prompt bucket and the pool bucket select a compiled loop. The
compiled executable is built ahead of time and kept in a bounded cache (`COMPILED`), so `seconds`
is the device run alone.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import certified_head, loop
from pasta_jax.decode.apar_text import encode_apar_text
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import RunOutput, bucket, pool_size
from pasta_jax.decode.reference.scoped import run_scoped_reference
from pasta_jax.decode.result import (
  PastaResult,
  Result,
  ThreadTrace,
  content_ids,
  drafts_result,
  pasta_result,
  scoped_result,
  tree_result,
)
from pasta_jax.decode.rules import (
    AparRules,
    MedusaRules,
    PastaRules,
    PastaTreeRules,
    Rules,
    ScopedRules,
    SequentialRules,
    SotRules,
    SuperposedRules,
)
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.sharding import DecodeSharding
from pasta_jax.decode.state import PositionMode
from pasta_jax.decode.tokenizing import LangTokenizer, chat_text, prompt_ids
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import apar_tree as tree
from pasta_jax.lang import scoped
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.layout import answer_for_mode
from pasta_jax.lang.tags import TagVocab, tag_vocab_for
from pasta_jax.model import thread_attention
from pasta_jax.model.head_plan import HeadPlan, describe
from pasta_jax.model.head_timing import measured_plan
from pasta_jax.model.kv_rows import defer_by_default

__all__ = ["GREEDY", "METHODS", "LangTokenizer", "PastaResult", "Result", "ThreadTrace", "chat_text", "content_ids",
           "generate", "generate_ids", "prompt_ids", "stream",
           "stream_ids"]

GREEDY = SamplingConfig()  # frozen: safe as a default argument
METHODS = ("pasta", "pasta-v0", "apar", "sot", "sequential", "superposed", "medusa", "propd", "pasta+medusa")
TREE_METHODS = ("medusa", "propd", "pasta+medusa")
PASTA = PastaRules()


def rules_for(method: str, *, max_depth: int = 3, fan_out: int = 1, ignore_eos: bool = False, drafts: int = 3,
              ngram_weight: float = 0.0) -> Rules:
  """The rule object of a method name (decode/rules/)."""
  if method == "superposed":
    return SuperposedRules(drafts=drafts, ngram_weight=ngram_weight)
  if method == "pasta":
    return PastaRules()
  if method == "pasta-v0":
    return ScopedRules(max_depth=max_depth)
  if method == "apar":
    return AparRules(max_depth=max_depth)
  if method == "sot":
    return SotRules(initial_threads=fan_out)
  if method == "sequential":
    return SequentialRules(ignore_eos=ignore_eos)
  if method in TREE_METHODS:
    raise PastaError(f"method {method!r} needs Medusa heads: use prepare_method / generate (heads=...)")
  raise PastaError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


# --- model plumbing ----------------------------------------------------------------------------------
def model_fn(config, dtype, attention: str = "xla", head_dtype: str | None = None) -> callable:
  """The decode-step model: Gemma in the decode layout, taking `decode_params`. One module per (config,
  dtype, attention, head_dtype, this machine's head plan): its `apply` is a jit static argument, so it must be
  stable. attention: "xla" (the default) or "pallas" (the kernel over the thread metadata,
  model/thread_attention.py). head_dtype: the output head's narrower dtype (`check_head_dtype`), None: `dtype`."""
  return _model_fn(config, jnp.dtype(dtype), attention, head_dtype, head_plan(config, dtype, head_dtype))


@functools.lru_cache(maxsize=8)
def _model_fn(config, dtype, attention: str, head_dtype: str | None, plan: HeadPlan) -> callable:
  from pasta_jax.model.gemma import Gemma
  return Gemma(config, dtype=dtype, decode_layout=True, attention=attention, head_dtype=head_dtype,
               head_plan=plan).apply


def head_plan(config, dtype, head_dtype: str | None = None) -> HeadPlan:
  """The output head's form per row count for this model on this machine (model/head_plan.py): measured once
  per process on a CPU, the same plan for the model and a certified head's own multiply."""
  return measured_plan(config.vocab_size, config.embed_dim, jnp.dtype(dtype).name, head_dtype)


def head_plan_line(config, dtype, head_dtype: str | None = None, certify_head: bool = False) -> str:
  """`head_plan`'s plan for a decode with these settings, as one line (`head_plan.describe`): where a certified
  head skips its certificate on this machine, which decides what `certify_head` buys here."""
  return describe(head_plan(config, dtype, narrow_head_dtype(head_dtype, certify_head)), narrow=certify_head)


def narrow_head_dtype(head_dtype: str | None, certify_head: bool) -> str | None:
  """The narrow head a decode compiles: `head_dtype`; for a certified head that names none, int8 on a CPU (on
  the 2-core AMD EPYC of sessions 24-30 its 2-3 row product costs ~25% under float32's, where the bfloat16 copy
  costs more than float32 at every row count: `model/int8_head.py`), bfloat16 elsewhere. The head plan still
  sends each row count where the narrow product is not clearly faster to the float32 head."""
  if not certify_head or head_dtype is not None:
    return head_dtype
  return "int8" if jax.default_backend() == "cpu" else "bfloat16"


def check_head_dtype(head_dtype: str | None, dtype, certify_head: bool = False) -> str | None:
  """None, or the name of a float dtype narrower than `dtype` for the output head (e.g. "bfloat16" under float32:
  on a CPU the head then costs the same for 1 to 8 rows, `python -m bench.head_precision`; greedy tokens change
  where the top two logits are closer than its rounding), or "int8" for a certified head only (its rounding would
  change far more tokens; `model/int8_head.py`)."""
  if head_dtype is None:
    return None
  try:
    narrow = jnp.dtype(head_dtype)
  except TypeError:
    raise PastaError(f"head_dtype must be a float dtype name such as 'bfloat16', or 'int8', "
                     f"got {head_dtype!r}") from None
  if narrow == jnp.int8:
    if not certify_head:
      raise PastaError("head_dtype='int8' runs only as a certified head (certify_head=True): uncertified, its "
                       "rounding changes greedy tokens")
    return narrow.name
  if not jnp.issubdtype(narrow, jnp.floating) or narrow.itemsize >= jnp.dtype(dtype).itemsize:
    raise PastaError(f"head_dtype must be a float dtype narrower than the model's {jnp.dtype(dtype).name}, "
                     f"or 'int8' with certify_head, got {narrow.name}")
  return narrow.name


def pool_spec(config, dtype) -> tuple:
  return (config.num_layers, config.num_kv_heads, config.head_dim, jnp.dtype(dtype))


_PARAMS_CACHE: dict = {}


def decode_params(params, dtype, sharding: DecodeSharding | None = None, head_dtype: str | None = None):
  """Training-layout params -> device arrays of `dtype` in the decode layout (`model_fn`'s), placed on the
  mesh by the trainer's rules when `sharding` is given; with `head_dtype`, plus the tied head's copy in it
  (`gemma.HEAD_COPY`) and the per-token norms of its rounding (`certified_head.BOUNDS`). Cached for the last
  model (a 270M conversion costs ~1 s)."""
  from pasta_jax.model.gemma import to_decode_layout
  key = (id(params), jnp.dtype(dtype).name, sharding, head_dtype)
  hit = _PARAMS_CACHE.get(key)
  if hit is not None and hit[0] is params:
    return hit[1]
  if head_dtype is not None and sharding is not None:
    raise PastaError("head_dtype is a single-device option: the mesh's sharding rules do not place the head copy")
  converted = jax.jit(to_decode_layout)(jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
  if head_dtype is not None:
    tree = converted["params"]
    added = jax.jit(certified_head.narrow_params, static_argnums=1)(tree["embedder"], head_dtype)
    converted = {**converted, "params": {**tree, **added}}
  if sharding is not None:
    converted = sharding.put_params(converted)
  _PARAMS_CACHE.clear()
  _PARAMS_CACHE[key] = (params, converted)
  return converted


# --- forced scripts ----------------------------------------------------------------------------------
def forced_scripts(answer: str, tokenizer: LangTokenizer, vocab: TagVocab, where: str = "",
                   mode: PositionMode = "pred") -> list[list[int]]:
  """Promise-form answer -> per-thread scripts: main (blocks removed) + end id; each fork: content + </async>.
  Its promises are tagged as `mode` trains them (`lang.layout.answer_for_mode`: Pred-1x exact lengths...)."""
  try:
    ids = answer_for_mode(tok.encode_answer(answer, tokenizer, vocab), vocab, mode)
  except TagError as err:
    raise TagError(f"{where}{err}") from None
  return scripts_from_ids(ids, vocab)


def scripts_from_ids(ids: Sequence[int], vocab: TagVocab) -> list[list[int]]:
  main, forks = [], []
  for seg in tok.parse_tokens(ids, vocab):
    if isinstance(seg, tok.TokBlock):
      forks.append(list(seg.content) + [vocab.async_close])
    else:
      main += list(seg.all_ids)
  return [main + [vocab.eos_ids[0]]] + forks


def scoped_scripts(answer: str, tokenizer: LangTokenizer, vocab: TagVocab, lanes: int, max_threads: int,
                   max_depth: int, where: str = "") -> list[list[int]]:
  """Scoped text form -> per-thread scripts by thread id. Thread ids follow the spawn order, which depends on
  timing, so a schedule-only run of the reference interpreter (no model: forced tokens need none) assigns them
  with the same lanes and thread ids as the jitted run."""
  try:
    items = scoped.parse(answer, max_depth)
  except TagError as err:
    raise TagError(f"{where}{err}") from None
  script = scoped.answer_script(scoped.encode(items, tokenizer.encode, vocab), vocab)
  run = run_scoped_reference(None, None, [[0]], vocab, lanes=lanes, max_threads=max_threads, pool_slots=2**30,
                             max_steps=2**30, sampling=GREEDY, scripts=[script], max_depth=max_depth)[0]
  return run.scripts_by_thread


def apar_scripts(answer: str, tokenizer: LangTokenizer, vocab: TagVocab, lanes: int, max_threads: int,
                 where: str = "") -> list[list[int]]:
  """APAR text form -> per-thread scripts (tree.thread_scripts: main first, children in spawn order)."""
  return tree.thread_scripts(tree.parse_tree(encode_apar_text(answer, tokenizer, vocab, where), vocab), vocab, lanes,
                             max_threads)


# --- preparation and the run -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prepared:
  """Everything one interpreter call needs, with host-padded inputs (also used by bench for naive runs)."""

  cfg: InterpreterConfig
  model_fn: callable
  params: object
  vocab_size: int
  pool_spec: tuple
  tokens: np.ndarray  # [B, P]
  lengths: np.ndarray  # [B]
  script: np.ndarray  # [B, U, L]
  script_len: np.ndarray  # [B, U]
  forced: bool
  vocab: TagVocab
  rule_inputs: object = None  # read-only device arrays of the rules (Superposed Decoding's n-gram index)


def pad_scripts(scripts, batch: int, max_threads: int, length: int):
  """loop.pad_scripts, then padded to `length` (the pool size) so its shape never varies."""
  script, script_len = loop.pad_scripts(scripts, batch, max_threads)
  if script.shape[-1] > length:
    raise PastaError(f"a forced thread of {script.shape[-1]} tokens does not fit a pool of {length} slots")
  return np.pad(script, ((0, 0), (0, 0), (0, length - script.shape[-1]))), script_len


def prepare(model, ids: Sequence[Sequence[int]], *, rules: Rules = PASTA, params=None,
            max_new_tokens: int = 256, lanes: int = 8, max_threads: int = 64, sampling: SamplingConfig = GREEDY,
            position_mode: PositionMode = "pred", dtype=jnp.float32, scripts=None, record_logits: bool = False,
            lane_buckets: bool = True, rule_inputs=None, mesh=None, attention: str = "xla",
            head_dtype: str | None = None, certify_head: bool = False, pool_tokens: int | None = None,
            defer_kv_writes: bool | None = None) -> Prepared:
  """Pads prompts (and scripts) and sizes the pool and step budget for `ids` (prompt token ids).

  max_new_tokens: in free decoding, the content-token budget of each answer (its text tokens, whatever
  the parallelism; tags and topics are not counted): a request is cut once it has written that many,
  and the pool holds them plus a margin for tags (loop.POOL_MARGIN). Forced scripts replay whole.

  params: training-layout params (default `model.params`); they are converted (and cached) by `decode_params`.
  mesh: a (data, fsdp, tensor) `jax.sharding.Mesh` to decode on (decode/sharding.py); None: one device.
  attention: "xla" (default) or "pallas": attention read from the thread metadata by a kernel (on CPU it runs in
  interpret mode: correct and slow, for tests).
  head_dtype: the output head in a narrower float dtype, float32 accumulation (`check_head_dtype`); None: `dtype`.
  certify_head: greedy choices certified against the float32 head at the narrow head's cost (head_dtype, default
  `narrow_head_dtype`'s; decode/certified_head.py): the float32 model's tokens, faster on a CPU for 2-3 rows.
  pool_tokens: size the pool for this many new tokens, not max_new_tokens (when larger): a short run then steps
  in the pool of a longer one, as ProPD's step-time calibration needs (`decode.latency`).
  defer_kv_writes: `InterpreterConfig.defer_kv_writes`: whether the model's new K/V rows are written after the
  lane-count switch (True) or inside it (False); None: the backend's choice (deferred on a CPU only), resolved
  here so that the compiled programs' cache keys say which.
  """
  head_dtype = check_head_dtype(narrow_head_dtype(head_dtype, certify_head), dtype, certify_head)
  if attention not in thread_attention.CHOICES:
    raise PastaError(f"attention must be one of {', '.join(thread_attention.CHOICES)}, got {attention!r}")
  if max_new_tokens < 1:
    raise PastaError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
  if lanes < 1:
    raise PastaError(f"lanes must be at least 1, got {lanes}")
  vocab = tag_vocab_for(model.tokenizer, position_mode)
  new = max_new_tokens
  if scripts is not None:  # a forced answer is replayed whole, however long
    new = max(new, max(sum(len(t) for t in s) + 2 * len(s) for s in scripts))
  if not ids or any(len(p) == 0 for p in ids):
    raise PastaError("empty prompt: give at least one token of prompt")
  prompt_len = bucket(max(len(p) for p in ids))
  slots = pool_size(prompt_len, new, lanes)
  free = scripts is None
  # The content budget (free decoding) or the end of the scripts (forced) ends a run; every step writes
  # at least one token, so the pool's room bounds the steps. Bounding them by the pool, not by each
  # script's length, keeps one compiled loop per pool bucket for every forced answer that fits it.
  steps, content_budget = rules.budgets(new, slots - prompt_len)
  slots = max(slots, pool_size(prompt_len, pool_tokens or 0, lanes))  # wider, with the budgets of `new`
  content_budget = content_budget if free else 0
  try:
    cfg = InterpreterConfig(vocab=vocab, lanes=lanes, max_threads=max_threads, pool_slots=slots, max_steps=steps,
                            max_content=content_budget,
                            sampling=sampling, position_mode=position_mode, rules=rules, record_logits=record_logits,
                            lane_buckets=lane_buckets, sharding=None if mesh is None else DecodeSharding(mesh),
                            certify_head=certify_head, final_softcap=model.config.final_logit_softcap,
                            head_plan=head_plan(model.config, dtype, head_dtype),
                            defer_kv_writes=defer_by_default() if defer_kv_writes is None else defer_kv_writes)
  except ValueError as err:
    raise PastaError(f"bad {rules.name} settings: {err}") from None
  loop.check_runnable(cfg, forced=scripts is not None)
  tokens, lengths = loop.pad_prompts(ids, slots)
  script, script_len = pad_scripts(scripts, len(ids), max_threads, slots)
  converted = decode_params(model.params if params is None else params, dtype, cfg.sharding, head_dtype)
  return Prepared(cfg, model_fn(model.config, jnp.dtype(dtype), attention, head_dtype), converted,
                  model.config.vocab_size,
                  pool_spec(model.config, dtype), tokens, lengths, script, script_len, scripts is not None, vocab,
                  rules.bind_inputs(rule_inputs, converted))


class CompileCache:
  """Ahead-of-time compiled loops by (runner, static config, argument shapes): least recently used out."""

  def __init__(self, maxsize: int = 16):
    self.maxsize, self.entries = maxsize, collections.OrderedDict()

  def clear(self) -> None:
    """Drops every program (`jax.clear_caches` does not reach these): a process that compiles many, such as a
    bench, keeps its memory maps bounded."""
    self.entries.clear()

  def get(self, prep: Prepared, runner):
    cfg = loop.static_config(prep.cfg)
    static = dict(cfg=cfg, forced=prep.forced, vocab_size=prep.vocab_size, pool_spec=prep.pool_spec)
    args = dynamic_args(prep)
    leaves, treedef = jax.tree.flatten(args)
    key = (runner, prep.model_fn, cfg, prep.forced, prep.vocab_size, prep.pool_spec, treedef,
           tuple((x.shape, str(x.dtype)) for x in leaves))
    if key in self.entries:
      self.entries.move_to_end(key)
    else:
      self.entries[key] = runner.lower(prep.model_fn, *args, **static).compile()
      while len(self.entries) > self.maxsize:
        self.entries.popitem(last=False)
    return self.entries[key]


COMPILED = CompileCache()


def dynamic_args(prep: Prepared) -> tuple:
  requests = (prep.tokens, prep.lengths, prep.script, prep.script_len)  # [B, ...] each
  shared = (np.uint32(prep.cfg.sampling.seed), prep.rule_inputs)
  sharding = prep.cfg.sharding
  if sharding is None:
    return (prep.params, *jax.tree.map(jnp.asarray, requests), *jax.tree.map(jnp.asarray, shared))
  return (prep.params, *sharding.put_requests(requests), *sharding.put_replicated(shared))


def run_prepared(prep: Prepared, runner=loop.prefill_and_run) -> tuple[list[RunOutput], float]:
  """Runs the compiled loop; returns the per-request outputs and the wall time of the run."""
  executable = COMPILED.get(prep, runner)
  args = dynamic_args(prep)
  jax.block_until_ready(args)
  start = time.perf_counter()
  final = jax.block_until_ready(executable(*args))
  seconds = time.perf_counter() - start
  return loop.unpack(final, prep.cfg), seconds


def to_result(run: RunOutput, seconds: float, tokenizer: LangTokenizer, prep: Prepared) -> Result:
  rules = prep.cfg.rules
  build = tree_result if isinstance(rules, AparRules) else drafts_result if isinstance(rules, SuperposedRules) \
      else scoped_result if isinstance(rules, ScopedRules) else pasta_result
  result = build(run, seconds, tokenizer, prep.vocab, prep.cfg.rules.name)
  if isinstance(rules, (MedusaRules, PastaTreeRules)):
    result = dataclasses.replace(result, speculation=run.rule_outputs)
  return result


# --- the API -----------------------------------------------------------------------------------------
def prepare_method(model, ids: Sequence[Sequence[int]], *, method: str = "pasta", forced_answers=None, scripts=None,
                   lanes: int = 8, max_threads: int = 64, max_depth: int = 3, return_logits: bool = False,
                   ignore_eos: bool = False, drafts: int | None = None, ngram="default", **kw) -> Prepared:
  """`prepare` for a method name, with its forced answers (or raw per-thread `scripts`) turned into scripts.
  drafts, ngram: Superposed Decoding's k (default 3) and n-gram index (`superposed_index`)."""
  if model.tokenizer is None:
    raise PastaError(f"this model has no tokenizer; {method} decoding needs one for its tags and end ids")
  if drafts is not None and method != "superposed":
    raise PastaError(f"drafts is for method='superposed', not {method!r}")
  if kw.get("sampling", GREEDY).distinct_topics and method in ("pasta+medusa", "pasta-v0"):
    raise PastaError(f"distinct_topics is PASTA's flat-promise rule; method={method!r} does not implement it "
                     "(methods without promises ignore it)")
  if method in TREE_METHODS:
    return prepare_tree(model, ids, method, forced=forced_answers is not None or scripts is not None,
                        return_logits=return_logits, ignore_eos=ignore_eos, lanes=lanes, max_threads=max_threads,
                        **kw)
  if method in ("sequential", "superposed"):
    lanes = max_threads = 1
  index = superposed_index(ngram) if method == "superposed" else None
  if method == "superposed" and (forced_answers is not None or scripts is not None):
    raise PastaError("method='superposed' searches its own drafts: it replays no forced answers")
  if forced_answers is not None:
    if scripts is not None:
      raise PastaError("give forced_answers or scripts, not both")
    if len(forced_answers) != len(ids):
      raise PastaError(f"got {len(forced_answers)} forced answers for {len(ids)} prompts")
    mode = kw.get("position_mode", "pred")
    vocab, lang = tag_vocab_for(model.tokenizer, mode), LangTokenizer(model.tokenizer)
    if method in ("apar", "sot"):
      scripts = [apar_scripts(a, lang, vocab, lanes, max_threads, f"forced answer {i}: ")
                 for i, a in enumerate(forced_answers)]
    elif method == "pasta-v0":
      scripts = [scoped_scripts(a, lang, vocab, lanes, max_threads, max_depth, f"forced answer {i}: ")
                 for i, a in enumerate(forced_answers)]
    else:
      scripts = [forced_scripts(a, lang, vocab, f"forced answer {i}: ", mode) for i, a in enumerate(forced_answers)]
  if method == "sequential" and scripts is not None and any(len(s) > 1 for s in scripts):
    raise PastaError("method='sequential' replays tag-free answers; this one has blocks (use method='pasta')")
  fan_out = len(scripts[0]) if method == "sot" and scripts else 1
  if method == "sot" and (scripts is None or len({len(s) for s in scripts}) != 1):
    raise PastaError("method='sot' expands points: give each prompt the same number of point prompts as `scripts` "
                     "(pasta_jax.baselines.sot builds them from a skeleton)")
  if kw.get("certify_head") and method == "superposed":
    raise PastaError("certify_head certifies greedy argmax choices; method='superposed' reads its drafts' "
                     "probabilities from the logits")
  if ignore_eos and method != "sequential":
    raise PastaError("ignore_eos is for method='sequential' (a tagged method ends its threads with end ids)")
  rules = rules_for(method, max_depth=max_depth, fan_out=fan_out, ignore_eos=ignore_eos, drafts=drafts or 3,
                    ngram_weight=0.0 if index is None else SuperposedRules.ngram_weight)
  return prepare(model, ids, rules=rules, scripts=scripts, lanes=lanes, max_threads=max_threads,
                 record_logits=return_logits, rule_inputs=None if index is None else index.device_arrays(), **kw)


def prepare_tree(model, ids, method: str, *, forced: bool, return_logits: bool, ignore_eos: bool, lanes: int,
                 max_threads: int, heads=None, tree_size: int | None = None, choices=None, acceptance: str = "greedy",
                 latency=None, prune=None, **kw) -> Prepared:
  """Medusa (fixed tree) or ProPD (dynamic tree size, early pruning) on the model's Medusa heads; "pasta+medusa":
  PASTA with a tree on each of its `lanes` thread lanes."""
  from pasta_jax.decode.speculation import (
      default_tree_size,
      early_prune,
      load_drafter,
      pasta_tree_rules,
      rules_and_inputs,
  )
  if forced:
    raise PastaError(f"method={method!r} speculates on the model's own tokens: it replays no forced answers")
  if kw.get("certify_head") and acceptance != "greedy":
    raise PastaError("certify_head certifies greedy choices; typical acceptance reads probabilities from the logits")
  drafter = load_drafter(model, heads)
  size = tree_size or default_tree_size(method)
  if method == "pasta+medusa":
    if acceptance != "greedy" or latency is not None or prune not in (None, False) or ignore_eos:
      raise PastaError("method='pasta+medusa' accepts greedily, on a fixed tree: acceptance, latency, prune and "
                       "ignore_eos are for medusa / propd")
    rules, inputs = pasta_tree_rules(drafter, tree_size=size, thread_lanes=lanes, threads=max_threads,
                                     choices=choices, softcap=model.config.final_logit_softcap)
    return prepare(model, ids, rules=rules, lanes=rules.thread_lanes * rules.tree.size,
                   max_threads=max_threads + rules.node_lanes, record_logits=return_logits, rule_inputs=inputs, **kw)
  if method == "propd" and size == 1:  # the root alone every step: plain decoding (`speculation.tree_pays`)
    return prepare(model, ids, rules=SequentialRules(ignore_eos=ignore_eos), lanes=1, max_threads=1,
                   record_logits=return_logits, **kw)
  pruning = early_prune(method, prune, drafter)
  rules, inputs = rules_and_inputs(drafter, tree_size=size, dynamic=method == "propd", acceptance=acceptance,
                                   latency=latency, choices=choices, prune=pruning)
  rules = dataclasses.replace(rules, ignore_eos=ignore_eos, softcap=model.config.final_logit_softcap)
  return prepare(model, ids, rules=rules, lanes=rules.tree.size, max_threads=rules.tree.size,
                 record_logits=return_logits, rule_inputs=inputs, **kw)


def superposed_index(ngram):
  """Superposed Decoding's n-gram index: None (smoothing off), an `NgramIndex`, a folder, or "default"
  (`ngram.default_index_dir()`, which `pasta ngram build` and `pasta generate --method superposed` fill)."""
  from pasta_jax.decode.ngram import NgramIndex, default_index_dir
  if ngram is None or isinstance(ngram, NgramIndex):
    return ngram
  return _load_index(str(default_index_dir() if ngram == "default" else ngram))


@functools.lru_cache(maxsize=2)
def _load_index(folder: str):
  from pasta_jax.decode.ngram import NgramIndex
  try:
    return NgramIndex.load(folder)
  except (FileNotFoundError, ValueError) as err:
    raise PastaError(str(err)) from None


def generate_ids(model, ids: Sequence[Sequence[int]], *, method: str = "pasta", **kw) -> list[Result]:
  """`generate` on prompt token ids (BOS and chat turns already in). Also takes `params` (training-layout
  params overriding model.params) and `scripts` (per request, per thread token ids to force)."""
  prep = prepare_method(model, ids, method=method, **kw)
  runs, seconds = run_prepared(prep)
  lang = LangTokenizer(model.tokenizer)
  return [to_result(r, seconds, lang, prep) for r in runs]


def generate(model, prompts: Sequence[str], *, method: str = "pasta", max_new_tokens: int = 256, lanes: int = 8,
             max_threads: int = 64, sampling: SamplingConfig = GREEDY, chat: bool = True,
             position_mode: PositionMode = "pred", dtype=jnp.float32, forced_answers: Sequence[str] | None = None,
             max_depth: int = 3, return_logits: bool = False, params=None, drafts: int | None = None,
             ngram="default", mesh=None, attention: str = "xla", heads=None, tree_size: int | None = None,
             acceptance: str = "greedy", latency=None, prune=None, head_dtype: str | None = None,
             certify_head: bool = False) -> list[Result]:
  """Decodes each prompt (a batch; requests never interact) with `method` through the one interpreter.

  method: "pasta", "apar", "sequential" ("sot" needs point prompts: `generate_ids(..., scripts=...)`, or
  `pasta_jax.baselines.sot.SkeletonOfThought` for the whole two-stage method).
  method "pasta-v0": the earlier paper's scoped form (`<scope>`, `<promise/>`; lang/scoped.py).
  forced_answers: one per prompt, replayed instead of sampled (promise form; APAR's text form for "apar"; the
  scoped form for "pasta-v0");
  a malformed one raises TagError naming the place. Their length overrides max_new_tokens.
  return_logits: keep the logits behind every recorded token (`Result.logits`, [N, V]).
  max_depth: APAR's fork depth limit (main = 0); for "pasta-v0", the limit of scope and of fork nesting.
  drafts, ngram: method "superposed" (Superposed Decoding): k drafts (default 3; `Result.drafts`, best
  first) and the n-gram index that smooths them ("default": the training pools' index, which
  `pasta ngram build` writes; a folder; an `NgramIndex`; None: no smoothing). max_new_tokens is the drafts' length.
  attention: "xla" (default) or "pallas" (the attention kernel over the thread metadata).
  heads, tree_size, acceptance, latency: methods "medusa" (token-tree speculation; greedy acceptance is lossless)
  and "propd" (its dynamic tree size): the Medusa heads (a folder, a `speculation.Drafter`, or None for the
  model's shipped ones), the tree's nodes (16 / 64), "greedy" or "typical", and ProPD's step-time model
  ((alpha, beta) seconds, or a {size: seconds} table; `decode.latency.calibrate_latency` measures both).
  prune: early pruning of the tree (`decode.rules.pruning.EarlyPrune`; None: for "propd", top 50 at the layer
  of the heads' trained early head when they have one, else none; none for "medusa"; False: off).
  `Result.speculation` has the accepted length per step, per-head hit rates and the tree sizes chosen.
  head_dtype: the output head in a narrower float dtype such as "bfloat16" (float32 accumulation; `check_head_dtype`):
  faster on a CPU for several rows a step, and greedy tokens may change where the top two logits nearly tie.
  certify_head: the narrow head's speed and the float32 head's greedy tokens (decode/certified_head.py; head_dtype
  "bfloat16" or "int8", default `narrow_head_dtype`'s): greedy decoding only, without return_logits.
  method "pasta+medusa" (PASTA x trees): PASTA on `lanes` thread lanes, every live thread with its own `tree_size`-node
  tree (default 4) from `heads`, greedy; the answer is PASTA's (`Result.speculation`: tokens per thread per tree step).
  """
  if model.tokenizer is None:
    raise PastaError(f"this model has no tokenizer; {method} decoding needs one for its tags and end ids")
  ids = prompt_ids(model.tokenizer, prompts, chat)
  return generate_ids(model, ids, method=method, forced_answers=forced_answers, max_new_tokens=max_new_tokens,
                      lanes=lanes, max_threads=max_threads, sampling=sampling, position_mode=position_mode,
                      dtype=dtype, max_depth=max_depth, return_logits=return_logits, params=params,
                      drafts=drafts, ngram=ngram, mesh=mesh, attention=attention, head_dtype=head_dtype,
                      certify_head=certify_head, **tree_options(method, heads, tree_size, acceptance, latency, prune))


def tree_options(method: str, heads, tree_size, acceptance: str, latency, prune=None) -> dict:
  """The Medusa / ProPD options of `generate`, refused for the other methods."""
  options = {"heads": heads, "tree_size": tree_size, "latency": latency, "prune": prune}
  if method in TREE_METHODS:
    return {**options, "acceptance": acceptance}
  if any(v is not None for v in options.values()) or acceptance != "greedy":
    raise PastaError(f"heads, tree_size, acceptance, latency and prune are for methods medusa and propd, "
                     f"not {method!r}")
  return {}


def stream(model, prompts: Sequence[str], *, method: str = "pasta", chunk_steps: int = 16, chat: bool = True,
           **kw) -> Iterator[list[Result]]:
  """`generate`, yielding every request's result so far after prefill and after each chunk of
  `chunk_steps` steps (the loop state stays on device between chunks). The last yield is final."""
  if model.tokenizer is None:
    raise PastaError(f"this model has no tokenizer; {method} decoding needs one for its tags and end ids")
  return stream_ids(model, prompt_ids(model.tokenizer, prompts, chat), method=method, chunk_steps=chunk_steps, **kw)


def stream_ids(model, ids: Sequence[Sequence[int]], *, method: str = "pasta", chunk_steps: int = 16,
               **kw) -> Iterator[list[Result]]:
  """`stream` on prompt token ids."""
  if chunk_steps < 1:
    raise PastaError(f"chunk_steps must be at least 1, got {chunk_steps}")
  prep = prepare_method(model, ids, method=method, **kw)
  cfg = loop.static_config(prep.cfg)
  lang = LangTokenizer(model.tokenizer)
  run = dict(cfg=cfg, forced=prep.forced, vocab_size=prep.vocab_size)
  begin = time.perf_counter()
  state = loop.start(prep.model_fn, *dynamic_args(prep), pool_spec=prep.pool_spec, **run)
  while True:
    done = int(state.step) >= cfg.max_steps or not bool(jnp.any(state.live))
    shown = loop.finish(state) if done else state
    seconds = time.perf_counter() - begin
    yield [to_result(r, seconds, lang, prep) for r in loop.unpack(shown, prep.cfg)]
    if done:
      return
    state = loop.run_steps(prep.model_fn, prep.params, state, steps=chunk_steps, **run)
