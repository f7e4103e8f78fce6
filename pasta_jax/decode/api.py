"""The decode core's run plumbing: the model function, params in the decode layout, a prepared run, the compiled
loop and its results. The public decode API (`generate`, `stream`) is `pasta_jax.methods`: a method value says
which rules, lanes and result a run takes, and this module runs it.

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
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import certified_head, layout_store, loop, program_store
from pasta_jax.decode.apar_text import encode_apar_text
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import RunOutput, bucket
from pasta_jax.decode.program_store import ProgramStore
from pasta_jax.decode.result import PastaResult, Result, ThreadTrace, content_ids, pasta_result
from pasta_jax.decode.rules import PastaRules, Rules
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import RowSampling, SamplingConfig
from pasta_jax.decode.sharding import DecodeSharding
from pasta_jax.decode.state import PositionMode
from pasta_jax.decode.tokenizing import LangTokenizer, chat_text, prompt_ids
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import apar_tree as tree
from pasta_jax.lang import scoped
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.layout import answer_for_mode
from pasta_jax.lang.tags import TagVocab, tag_vocab_for
from pasta_jax.model.head_plan import HeadPlan, describe
from pasta_jax.model.head_timing import measured_plan
from pasta_jax.model.kv_rows import defer_by_default

__all__ = ["GREEDY", "LangTokenizer", "PastaResult", "Prepared", "Result", "Runtime", "ThreadTrace", "chat_text",
           "content_ids", "prepare", "prompt_ids", "run_prepared", "stream_prepared", "to_result"]

GREEDY = SamplingConfig()  # frozen: safe as a default argument
DEFAULT_RUNTIME = Runtime()
PASTA = PastaRules()

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
  a 2-core AMD EPYC (AVX2) its 2-3 row product costs ~25% under float32's, where the bfloat16 copy
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


def decode_params(params, dtype, sharding: DecodeSharding | None = None, head_dtype: str | None = None,
                  weights_id: str | None = None):
  """Training-layout params -> device arrays of `dtype` in the decode layout (`model_fn`'s), placed on the
  mesh by the trainer's rules when `sharding` is given; with `head_dtype`, plus the tied head's copy in it
  (`gemma.HEAD_COPY`) and the per-token norms of its rounding (`certified_head.BOUNDS`). Cached for the last
  model (a 270M conversion costs ~1 s), and on one device for weights a later process recognizes (`weights_id`,
  `layout_store`)."""
  key = (id(params), jnp.dtype(dtype).name, sharding, head_dtype)
  hit = _PARAMS_CACHE.get(key)
  if hit is not None and hit[0] is params:
    return hit[1]
  if head_dtype is not None and sharding is not None:
    raise PastaError("head_dtype is a single-device option: the mesh's sharding rules do not place the head copy")
  stored = None if sharding is not None else layout_store.stored_path(weights_id, jnp.dtype(dtype).name, head_dtype)
  converted = None if stored is None else layout_store.load(stored)
  if converted is None:
    converted = _convert(params, dtype, head_dtype)
    if stored is not None:
      layout_store.save(stored, converted)
  if sharding is not None:
    converted = sharding.put_params(converted)
  _PARAMS_CACHE.clear()
  _PARAMS_CACHE[key] = (params, converted)
  return converted


def _convert(params, dtype, head_dtype: str | None) -> dict:
  from pasta_jax.model.gemma import to_decode_layout
  converted = jax.jit(to_decode_layout)(jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
  if head_dtype is not None:
    tree = converted["params"]
    added = jax.jit(certified_head.narrow_params, static_argnums=1)(tree["embedder"], head_dtype)
    converted = {**converted, "params": {**tree, **added}}
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
  the lanes free at each step (`lang.scoped.scripts_by_thread` schedules them as the interpreter does)."""
  try:
    items = scoped.parse(answer, max_depth)
  except TagError as err:
    raise TagError(f"{where}{err}") from None
  script = scoped.answer_script(scoped.encode(items, tokenizer.encode, vocab), vocab)
  return scoped.scripts_by_thread(script, vocab, lanes, max_threads)


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
  # (run, seconds, tokenizer, vocab, method name) -> Result: the method's own form of answer (`result.py`)
  build_result: Callable[..., Result] = pasta_result
  method: str = "pasta"  # the name its results carry
  sampling: RowSampling | None = None  # each request's sampling values (host arrays [B]); None: cfg.sampling's
  limits: loop.RowLimits | None = None  # each request's own budgets (host arrays [B]); None: cfg's for every row


def per_prompt_sampling(sampling: SamplingConfig | Sequence[SamplingConfig], prompts: int) -> list[SamplingConfig]:
  """One sampling config per prompt: `sampling` for each, or the list given (one per prompt)."""
  if isinstance(sampling, SamplingConfig):
    return [sampling] * prompts
  rows = list(sampling)
  if len(rows) != prompts or not all(isinstance(r, SamplingConfig) for r in rows):
    raise PastaError(f"sampling: give one SamplingConfig, or one per prompt ({prompts}), not {len(rows)} values")
  return rows


def pad_scripts(scripts, batch: int, max_threads: int, length: int):
  """loop.pad_scripts, then padded to `length` (the pool size) so its shape never varies."""
  script, script_len = loop.pad_scripts(scripts, batch, max_threads)
  if script.shape[-1] > length:
    raise PastaError(f"a forced thread of {script.shape[-1]} tokens does not fit a pool of {length} slots")
  return np.pad(script, ((0, 0), (0, 0), (0, length - script.shape[-1]))), script_len


def prepare(model, ids: Sequence[Sequence[int]], *, rules: Rules = PASTA, max_new_tokens: int = 256, lanes: int = 8,
            max_threads: int = 64, sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
            position_mode: PositionMode = "pred",
            scripts=None, record_logits: bool = False, runtime: Runtime = DEFAULT_RUNTIME, rule_inputs=None,
            build_result: Callable[..., Result] = pasta_result, lane_buckets: bool = True,
            pool_tokens: int | None = None, defer_kv_writes: bool | None = None) -> Prepared:
  """Pads prompts (and scripts) and sizes the pool and step budget for `ids` (prompt token ids).

  max_new_tokens: in free decoding, the content-token budget of each answer (its text tokens, whatever
  the parallelism; tags and topics are not counted): a request is cut once it has written that many,
  and the pool holds them plus a margin for tags (loop.POOL_MARGIN). Forced scripts replay whole.

  sampling: one config for every prompt, or one per prompt; the compiled loop covers them all
  (`SamplingConfig.covering`) and each row samples by its own values.
  runtime: the model's dtype, mesh, attention and output head (`decode.runtime.Runtime`).
  pool_tokens: size the pool for this many new tokens, not max_new_tokens (when larger): a short run then steps
  in the pool of a longer one, as ProPD's step-time calibration needs (`decode.latency`).
  defer_kv_writes: `InterpreterConfig.defer_kv_writes`: whether the model's new K/V rows are written after the
  lane-count switch (True) or inside it (False); None: the backend's choice (deferred on a CPU only), resolved
  here so that the compiled programs' cache keys say which.
  """
  dtype, certify = jnp.dtype(runtime.dtype), runtime.certify_head
  head_dtype = check_head_dtype(narrow_head_dtype(runtime.head_dtype, certify), dtype, certify)
  if max_new_tokens < 1:
    raise PastaError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
  if lanes < 1:
    raise PastaError(f"lanes must be at least 1, got {lanes}")
  vocab = tag_vocab_for(model.tokenizer, position_mode)
  rows_sampling = per_prompt_sampling(sampling, len(ids))
  sampling = rows_sampling[0] if len(set(rows_sampling)) == 1 else SamplingConfig.covering(rows_sampling)
  new = max_new_tokens
  if scripts is not None:  # a forced answer is replayed whole, however long
    new = max(new, max(sum(len(t) for t in s) + 2 * len(s) for s in scripts))
  if not ids or any(len(p) == 0 for p in ids):
    raise PastaError("empty prompt: give at least one token of prompt")
  prompt_len = bucket(max(len(p) for p in ids))
  free = scripts is None
  # The content budget (free decoding) or the end of the scripts (forced) ends a run; every step writes
  # at least one token, so the pool's room bounds the steps. Bounding them by the pool, not by each
  # script's length, keeps one compiled loop per pool bucket for every forced answer that fits it.
  slots, steps, content_budget = loop.free_budget(prompt_len, new, lanes, rules, pool_tokens or 0)
  limits = None
  if free and len(ids) > 1:  # each answer gets the budgets it gets alone, whatever it is batched with
    own = np.array([loop.free_budget(len(p), new, lanes, rules, pool_tokens or 0) for p in ids], np.int32)
    steps, content_budget = int(own[:, 1].max()), int(own[:, 2].max())
    limits = loop.RowLimits(content=own[:, 2], steps=own[:, 1], slots=own[:, 0])
  content_budget = content_budget if free else 0
  try:
    cfg = InterpreterConfig(vocab=vocab, lanes=lanes, max_threads=max_threads, pool_slots=slots, max_steps=steps,
                            max_content=content_budget,
                            sampling=sampling, position_mode=position_mode, rules=rules, record_logits=record_logits,
                            lane_buckets=lane_buckets,
                            sharding=None if runtime.mesh is None else DecodeSharding(runtime.mesh),
                            certify_head=certify, final_softcap=model.config.final_logit_softcap,
                            head_plan=head_plan(model.config, dtype, head_dtype),
                            defer_kv_writes=defer_by_default() if defer_kv_writes is None else defer_kv_writes)
  except ValueError as err:
    raise PastaError(f"bad {rules.name} settings: {err}") from None
  loop.check_runnable(cfg, forced=scripts is not None)
  tokens, lengths = loop.pad_prompts(ids, slots)
  script, script_len = pad_scripts(scripts, len(ids), max_threads, slots)
  converted = decode_params(model.params, dtype, cfg.sharding, head_dtype, getattr(model, "weights_id", None))
  return Prepared(cfg, model_fn(model.config, dtype, runtime.attention, head_dtype), converted,
                  model.config.vocab_size,
                  pool_spec(model.config, dtype), tokens, lengths, script, script_len, scripts is not None, vocab,
                  rules.bind_inputs(rule_inputs, converted), build_result, rules.name, RowSampling.of(rows_sampling),
                  limits)


class CompileCache:
  """Ahead-of-time compiled loops by (runner, static config, argument shapes): least recently used out; behind
  it the programs on disk (`decode.program_store`) that an earlier process compiled."""

  def __init__(self, maxsize: int = 16, store: ProgramStore | None = None):
    self.maxsize, self.entries = maxsize, collections.OrderedDict()
    self._store = store
    self.compiles = 0  # loops this process traced and compiled (a stored program's load is not one)

  @property
  def store(self) -> ProgramStore:
    """The disk store, resolved at first use (so that `pasta --no-compile-cache` or $PASTA_COMPILE_CACHE set before
    the first run decides it)."""
    if self._store is None:
      self._store = ProgramStore(program_store.default_folder())
    return self._store

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
      self.entries[key] = self._load_or_compile(key, runner, args, static)
      while len(self.entries) > self.maxsize:
        self.entries.popitem(last=False)
    return self.entries[key]

  def _load_or_compile(self, key: tuple, runner, args: tuple, static: dict):
    runner_, model_fn, *rest = key
    stored = program_store.digest((f"{runner_.__module__}.{runner_.__name__}",
                                   program_store.describe_model_fn(model_fn), *map(str, rest)))
    compiled = self.store.load(stored)
    if compiled is None:
      compiled = runner.lower(model_fn, *args, **static).compile()
      self.compiles += 1
      self.store.save(stored, compiled)
    return compiled


COMPILED = CompileCache()


def dynamic_args(prep: Prepared) -> tuple:
  rows = prep.sampling if prep.sampling is not None else RowSampling.of([prep.cfg.sampling] * len(prep.lengths))
  requests = (prep.tokens, prep.lengths, prep.script, prep.script_len, rows)  # [B, ...] each
  shared = (prep.rule_inputs,)
  sharding = prep.cfg.sharding
  if sharding is None:
    return (prep.params, *jax.tree.map(jnp.asarray, requests), *jax.tree.map(jnp.asarray, shared),
            jax.tree.map(jnp.asarray, prep.limits))
  limits = None if prep.limits is None else sharding.put_requests((prep.limits,))[0]
  return (prep.params, *sharding.put_requests(requests), *sharding.put_replicated(shared), limits)


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
  """A run's records as its method's `Result` (`Prepared.build_result`)."""
  return prep.build_result(run, seconds, tokenizer, prep.vocab, prep.method)


def stream_prepared(prep: Prepared, lang: LangTokenizer, chunk_steps: int,
                    settled: Callable[[np.ndarray], str] | None = None) -> Iterator[list[Result]]:
  """Every request's result so far after prefill and after each chunk of `chunk_steps` steps (the loop state
  stays on device between chunks). The last yield is final.

  settled: the settled text of a run's records so far (`decode.streaming.settled_text`), which every result before
  the last carries as its `text`, so that each text extends the one before and the last is the result's own text
  (None: each carries the text its records make alone, which a later token may change)."""
  if chunk_steps < 1:
    raise PastaError(f"chunk_steps must be at least 1, got {chunk_steps}")
  cfg = loop.static_config(prep.cfg)
  run = dict(cfg=cfg, forced=prep.forced, vocab_size=prep.vocab_size)
  begin = time.perf_counter()
  state = loop.start(prep.model_fn, *dynamic_args(prep), pool_spec=prep.pool_spec, **run)
  while True:
    done = int(state.step) >= cfg.max_steps or not bool(jnp.any(state.live))
    shown = loop.finish(state) if done else state
    seconds = time.perf_counter() - begin
    results = [to_result(r, seconds, lang, prep) for r in loop.unpack(shown, prep.cfg)]
    if settled is not None and not done:
      results = [dataclasses.replace(r, text=settled(r.records)) for r in results]
    yield results
    if done:
      return
    state = loop.run_steps(prep.model_fn, prep.params, state, steps=chunk_steps, **run)
