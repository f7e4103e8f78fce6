"""The public PASTA decode API: `generate(model, prompts)` -> one `PastaResult` per prompt.

It tokenizes (Gemma chat turns by default), sizes a bucketed pool, runs the jitted interleaved
interpreter (`interpreter.prefill_and_run`) and turns its records into clean text, the annotated
text, a per-thread trace and speed metrics. Forced mode replays given annotated answers (promise
form) as per-thread scripts instead of sampling.

Compiles are rare by construction: one Gemma module per (config, dtype) keeps `model_fn` stable (a
jit static argument), prompts and the pool are bucketed to powers of two, and forced scripts are
padded to the pool size, so only the prompt bucket and the pool bucket select a compiled loop. The
compiled executable is built ahead of time and cached, so `seconds` is the device run alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import interpreter
from pasta_jax.decode.interpreter import RunOutput
from pasta_jax.decode.plain import bucket
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.state import LANE, STEP, THREAD, TOKEN, InterpreterConfig, PositionMode
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import metrics
from pasta_jax.lang import text as T
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.tags import TagVocab

GREEDY = SamplingConfig()  # frozen: safe as a default argument
POOL_MARGIN = 1.25  # pool room per requested new token: forks' <async>/</async> and tags take slots too


@dataclasses.dataclass(frozen=True)
class ThreadTrace:
  """One thread of a run. Steps are interpreter steps (step 0 samples main's first token)."""

  thread: int  # 0 = main, forks numbered in spawn order
  lane: int
  spawn_step: int  # main: 0; a fork: the step its `<async>` is recorded (and fed)
  finish_step: int | None  # main: its end token's record; a fork: its `</async>` record; None if cut off
  tokens: int  # content tokens (no `<async>` / `</async>` / end id)
  fed_steps: tuple[int, ...]  # steps at which this thread fed a token (for charts)


@dataclasses.dataclass(frozen=True)
class PastaResult:
  text: str  # the clean answer: tags and topics removed, blocks spliced in
  annotated: str  # promise form (rendered leniently if the run was cut off)
  records: np.ndarray  # [N, 5] (step, lane, thread, token, position)
  threads: tuple[ThreadTrace, ...]
  sync_steps: tuple[int, ...]  # steps at which main's `<sync/>` fed
  steps: int
  stalls: int
  finished: bool
  truncated: bool
  theoretical_speedup: float  # lang.metrics on the annotated answer (nan if it is malformed)
  theoretical_parallelism: float
  seconds: float  # wall time of the interpreter run (compile excluded)
  tokens: int  # every token of the annotated answer (tags and topics included, end id excluded)
  content_tokens: int  # main text + block contents, the sequential answer's token count
  pool_full: bool = False  # cut because the KV pool had no room left (see stop_reason)

  @property
  def stop_reason(self) -> str:
    """Why the run ended: "end" (the model finished), "pool" (the KV pool ran out of slots: every lane's
    writes count against it, so a very parallel answer can fill it before the step budget ends), or
    "steps" (the step budget, max_new_tokens, ran out)."""
    return "end" if self.finished else "pool" if self.pool_full else "steps"

  @property
  def stop_note(self) -> str:
    """One line for the user when the answer was cut ("" when it ended)."""
    return {"end": "", "steps": f"cut by the step budget after {self.steps} steps: raise max_new_tokens",
            "pool": f"cut when the KV pool filled ({self.tokens} tokens written by all lanes): raise "
                    "max_new_tokens, which sizes the pool"}[self.stop_reason]


# --- model plumbing ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def model_fn(config, dtype) -> callable:
  """The decode-step model: Gemma in the decode layout, taking `decode_params`. One module per (config,
  dtype): its `apply` is a jit static argument, so it must be stable."""
  from pasta_jax.model.gemma import Gemma
  return Gemma(config, dtype=jnp.dtype(dtype), decode_layout=True).apply


def pool_spec(config, dtype) -> tuple:
  return (config.num_layers, config.num_kv_heads, config.head_dim, jnp.dtype(dtype))


_PARAMS_CACHE: dict = {}


def decode_params(params, dtype):
  """Training-layout params -> device arrays of `dtype` in the decode layout (`model_fn`'s), cached for the
  last model (a 270M conversion costs ~1 s)."""
  from pasta_jax.model.gemma import to_decode_layout
  key = (id(params), jnp.dtype(dtype).name)
  hit = _PARAMS_CACHE.get(key)
  if hit is not None and hit[0] is params:
    return hit[1]
  converted = jax.jit(to_decode_layout)(jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
  _PARAMS_CACHE.clear()
  _PARAMS_CACHE[key] = (params, converted)
  return converted


class LangTokenizer:
  """The model tokenizer as a `lang.tokens.Tokenizer` (no BOS; tag spellings in text stay text)."""

  def __init__(self, tokenizer):
    self.inner = tokenizer
    self.hf = tok.HFTokenizer(tokenizer.hf) if getattr(tokenizer, "hf", None) is not None else None

  def encode(self, text: str) -> list[int]:
    return self.hf.encode(text) if self.hf else list(self.inner.encode(text, add_bos=False))

  def decode(self, ids: Sequence[int]) -> str:
    return self.hf.decode(ids) if self.hf else self.inner.decode(list(ids))


def chat_text(tokenizer, text: str) -> str:
  if hasattr(tokenizer, "format_chat"):
    return tokenizer.format_chat(text)
  from pasta_jax.model.tokenizer import chat_prompt  # tokenizer-like test doubles
  return chat_prompt(text)


def prompt_ids(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
  if isinstance(prompts, str):
    raise PastaError("prompts must be a list of strings, not one string")
  if not prompts:
    raise PastaError("no prompts given")
  out = []
  for i, text in enumerate(prompts):
    if not text or not text.strip():
      raise PastaError(f"empty prompt (prompt {i}): give some text to continue")
    out.append(tokenizer.encode(chat_text(tokenizer, text) if chat else text, add_bos=True))
  return out


# --- forced scripts ----------------------------------------------------------------------------------
def forced_scripts(answer: str, tokenizer: LangTokenizer, vocab: TagVocab, where: str = "") -> list[list[int]]:
  """Promise-form answer -> per-thread scripts: main (blocks removed) + end id; each fork: content + </async>."""
  try:
    ids = tok.encode_answer(answer, tokenizer, vocab)
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


def pool_size(prompt_len: int, new_tokens: int, lanes: int) -> int:
  return bucket(prompt_len + math.ceil(new_tokens * POOL_MARGIN) + lanes)


def pad_scripts(scripts, batch: int, max_threads: int, length: int):
  """interpreter.pad_scripts, then padded to `length` (the pool size) so its shape never varies."""
  script, script_len = interpreter.pad_scripts(scripts, batch, max_threads)
  if script.shape[-1] > length:
    raise PastaError(f"a forced thread of {script.shape[-1]} tokens does not fit a pool of {length} slots")
  return np.pad(script, ((0, 0), (0, 0), (0, length - script.shape[-1]))), script_len


def prepare(model, ids: Sequence[Sequence[int]], *, params=None, max_new_tokens: int = 256, lanes: int = 8,
            max_threads: int = 64, sampling: SamplingConfig = GREEDY, position_mode: PositionMode = "pred",
            dtype=jnp.float32, scripts=None, **modes) -> Prepared:
  """Pads prompts (and scripts) and sizes the pool and step budget for `ids` (prompt token ids).

  params: training-layout params (default `model.params`); they are converted (and cached) by `decode_params`.
  modes: further InterpreterConfig fields (mode="apar", max_depth, initial_threads, sample_after_script).
  """
  if max_new_tokens < 1:
    raise PastaError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
  if lanes < 1:
    raise PastaError(f"lanes must be at least 1, got {lanes}")
  vocab = model.tokenizer.tag_vocab()
  new = max_new_tokens
  if scripts is not None:  # a forced answer is replayed whole, however long
    new = max(new, max(sum(len(t) for t in s) + 2 * len(s) for s in scripts))
  if not ids or any(len(p) == 0 for p in ids):
    raise PastaError("empty prompt: give at least one token of prompt")
  prompt_len = bucket(max(len(p) for p in ids))
  slots = pool_size(prompt_len, new, lanes)
  try:
    cfg = InterpreterConfig(vocab=vocab, lanes=lanes, max_threads=max_threads, pool_slots=slots, max_steps=new,
                            sampling=sampling, position_mode=position_mode, **modes)
  except ValueError as err:
    raise PastaError(f"bad interpreter settings: {err}") from None
  interpreter.check_runnable(cfg, forced=scripts is not None)
  tokens, lengths = interpreter.pad_prompts(ids, slots)
  script, script_len = pad_scripts(scripts, len(ids), max_threads, slots)
  return Prepared(cfg, model_fn(model.config, jnp.dtype(dtype)),
                  decode_params(model.params if params is None else params, dtype), model.config.vocab_size,
                  pool_spec(model.config, dtype), tokens, lengths, script, script_len, scripts is not None, vocab)


_COMPILED: dict = {}


def _shape_key(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


def compiled(prep: Prepared, runner=interpreter.prefill_and_run):
  """The AOT-compiled loop for this shape and static config (cached: compile once, time runs alone)."""
  cfg = interpreter.static_config(prep.cfg)
  static = dict(cfg=cfg, forced=prep.forced, vocab_size=prep.vocab_size, pool_spec=prep.pool_spec)
  args = dynamic_args(prep)
  key = (runner, prep.model_fn, cfg, prep.forced, prep.vocab_size, prep.pool_spec, _shape_key(args))
  if key not in _COMPILED:
    _COMPILED[key] = runner.lower(prep.model_fn, *args, **static).compile()
  return _COMPILED[key]


def dynamic_args(prep: Prepared) -> tuple:
  return (prep.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), jnp.asarray(prep.script),
          jnp.asarray(prep.script_len), jnp.uint32(prep.cfg.sampling.seed))


def run_prepared(prep: Prepared, runner=interpreter.prefill_and_run) -> tuple[list[RunOutput], float]:
  """Runs the compiled loop; returns the per-request outputs and the wall time of the run."""
  executable = compiled(prep, runner)
  args = dynamic_args(prep)
  jax.block_until_ready(args)
  start = time.perf_counter()
  final = jax.block_until_ready(executable(*args))
  seconds = time.perf_counter() - start
  return interpreter.unpack(final, prep.cfg), seconds


# --- records -> result -------------------------------------------------------------------------------
def thread_traces(records: np.ndarray, vocab: TagVocab) -> tuple[ThreadTrace, ...]:
  """Per-thread spawn/finish steps, lanes, token counts and fed steps (docs/interpreter.md, records)."""
  out = []
  for u in sorted(set(records[:, THREAD].tolist())):
    rows = records[records[:, THREAD] == u]
    toks = rows[:, TOKEN].tolist()
    if u == 0:  # main's k-th token feeds when its (k+1)-th is recorded; its end token never feeds
      fed = tuple(int(s) for s in rows[1:, STEP])
      ended = bool(toks) and toks[-1] in vocab.eos_ids
      finish = int(rows[-1, STEP]) if ended else None
      content = len(content_ids(toks, vocab))
    else:  # a fork's `<async>` feeds at its record step, every later token one step after its record
      fed = tuple(int(s) if t == vocab.async_open else int(s) + 1 for s, t in zip(rows[:, STEP], toks))
      closed = toks[-1] == vocab.async_close
      finish = int(rows[-1, STEP]) if closed else None
      content = len([t for t in toks if t not in (vocab.async_open, vocab.async_close)])
    out.append(ThreadTrace(thread=int(u), lane=int(rows[0, LANE]), spawn_step=int(rows[0, STEP]),
                           finish_step=finish, tokens=content, fed_steps=fed))
  return tuple(out)


def content_ids(ids: Sequence[int], vocab: TagVocab) -> list[int]:
  """Ids without tags, promise topics and end ids (lenient: works on cut-off answers too)."""
  content, in_topic = [], False
  for t in ids:
    in_topic = (in_topic or t == vocab.promise) and not vocab.is_length(t)
    if not in_topic and t not in vocab.tag_ids and t not in vocab.eos_ids:
      content.append(t)
  return content


def sync_steps(records: np.ndarray, vocab: TagVocab) -> tuple[int, ...]:
  main = records[records[:, THREAD] == 0]
  return tuple(int(main[k + 1, STEP]) for k in range(len(main) - 1) if main[k, TOKEN] == vocab.sync)


def clean_text(ids: Sequence[int], annotated: str, tokenizer: LangTokenizer, vocab: TagVocab) -> str:
  """strip_tags of the annotated text; for a cut-off (malformed) answer, its content tokens decoded."""
  try:
    return T.strip_tags(annotated)
  except TagError:
    return tokenizer.decode(content_ids(ids, vocab))


def to_result(run: RunOutput, seconds: float, tokenizer: LangTokenizer, vocab: TagVocab) -> PastaResult:
  ids = metrics.annotated_from_records(run.records, vocab)
  body, _ = tok.split_end(ids, vocab)
  try:
    annotated = tok.decode_answer(ids, tokenizer, vocab)
    answer = metrics.answer_metrics(ids, vocab)
    speedup, parallelism, content = answer.theoretical_speedup(), answer.theoretical_parallelism, answer.content_tokens
  except TagError:  # a run cut off mid-block: render what there is
    annotated = tok.decode_answer(ids, tokenizer, vocab, strict=False)
    speedup = parallelism = math.nan
    content = len(content_ids(ids, vocab))
  return PastaResult(
      text=clean_text(ids, annotated, tokenizer, vocab), annotated=annotated, records=run.records,
      threads=thread_traces(run.records, vocab), sync_steps=sync_steps(run.records, vocab), steps=run.steps,
      stalls=run.stalls, finished=run.finished, truncated=run.truncated, theoretical_speedup=speedup,
      theoretical_parallelism=parallelism, seconds=seconds, tokens=len(body), content_tokens=content,
      pool_full=run.pool_full)


# --- the API -----------------------------------------------------------------------------------------
def generate_ids(model, ids: Sequence[Sequence[int]], *, params=None, forced_answers: Sequence[str] | None = None,
                 **kw) -> list[PastaResult]:
  """`generate` on prompt token ids (BOS and chat turns already in). `params` overrides model.params."""
  if model.tokenizer is None:
    raise PastaError("this model has no tokenizer; PASTA decoding needs one for its tags")
  vocab = model.tokenizer.tag_vocab()
  lang_tok = LangTokenizer(model.tokenizer)
  scripts = None
  if forced_answers is not None:
    if len(forced_answers) != len(ids):
      raise PastaError(f"got {len(forced_answers)} forced answers for {len(ids)} prompts")
    scripts = [forced_scripts(a, lang_tok, vocab, f"forced answer {i}: ") for i, a in enumerate(forced_answers)]
  prep = prepare(model, ids, params=params, scripts=scripts, **kw)
  runs, seconds = run_prepared(prep)
  return [to_result(r, seconds, lang_tok, vocab) for r in runs]


def generate(model, prompts: list[str], *, max_new_tokens: int = 256, lanes: int = 8, max_threads: int = 64,
             sampling: SamplingConfig = GREEDY, chat: bool = True, position_mode: PositionMode = "pred",
             dtype=jnp.float32, forced_answers: list[str] | None = None) -> list[PastaResult]:
  """PASTA-decodes each prompt (a batch; requests never interact) with the interleaved interpreter.

  forced_answers: annotated answers in promise form, one per prompt, replayed instead of sampled
  (a malformed one raises TagError naming the place). Their length overrides max_new_tokens.
  """
  if model.tokenizer is None:
    raise PastaError("this model has no tokenizer; PASTA decoding needs one for its tags")
  ids = prompt_ids(model.tokenizer, prompts, chat)
  return generate_ids(model, ids, forced_answers=forced_answers, max_new_tokens=max_new_tokens, lanes=lanes,
                      max_threads=max_threads, sampling=sampling, position_mode=position_mode, dtype=dtype)
