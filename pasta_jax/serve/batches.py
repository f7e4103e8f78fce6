"""A batch per served method: its rows on device, the requests holding them, how long its next chunk runs, and
how each request gets its new text after a chunk.

A batch is keyed by its method value and the sampling paths its program has (`BatchKey`): every sampling
path, or greedy only where a certified head chooses. Each request's temperature, top-p, top-k, repetition
penalty, fork bias, topic cap and seed are its row's own values (`decode.sampling.RowSampling`), so requests with
any settings share one batch and one compiled program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import NamedTuple

from pasta_jax.decode import api, batching, streaming, thread_text
from pasta_jax.decode.result import Result
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import ANY_SAMPLING, SamplingConfig
from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.methods import Method, Setup, prepare_run, prepared
from pasta_jax.serve import sot
from pasta_jax.serve.config import ServeConfig
from pasta_jax.serve.metrics import ServeMetrics
from pasta_jax.serve.propd import OnlineLatency
from pasta_jax.serve.requests import Request, Update

# a certified head's batch: argmax, a penalty, a fork bias (a per-token offset: the certificate still holds) and a
# topic cap (a constraint, as the tags' are)
GREEDY_ONLY = SamplingConfig(repetition_penalty=2.0, fork_bias=1.0, max_topic_tokens=1).envelope()


class BatchKey(NamedTuple):
  """What makes a batch: the method value, and the sampling paths its program compiled (`SamplingConfig.envelope`)."""

  method: Method
  envelope: SamplingConfig
  certified: bool = False  # its greedy choices go through the certified head (`ServeConfig.certify_head`)


def batch_key(method: Method, sampling: SamplingConfig, certify_head: bool) -> BatchKey:
  """The batch of a request: its method's, with every sampling path; a greedy request of a method that certifies
  its head, on a server that does (`ServeConfig.certify_head`), goes to the method's greedy batch instead."""
  certified = certify_head and sampling.greedy and method.capabilities.certify_head
  paths = GREEDY_ONLY if certified or not method.capabilities.sample else ANY_SAMPLING
  fork_bias = paths.fork_bias if method.capabilities.promises else 0.0  # no promise, no bias path
  max_topic = paths.max_topic_tokens if method.capabilities.topic_cap else 0  # no topic, no cap path
  return BatchKey(method, dataclasses.replace(paths, distinct_topics=sampling.distinct_topics, fork_bias=fork_bias,
                                              max_topic_tokens=max_topic), certified)


@dataclasses.dataclass
class MethodBatch:
  """One compiled batch: its rows, the requests holding them, and its prepared config."""

  key: BatchKey
  rows: batching.RowBatch
  prep: api.Prepared  # its cfg is the batch's (vocab, rules, tokenizer-facing parts for `to_result`)
  holders: dict[int, Request] = dataclasses.field(default_factory=dict)
  latency: OnlineLatency | None = None  # ProPD: its step-time model, measured from these chunks
  fresh: bool = False  # newcomers since the last chunk: the next one is short, so their first text streams soon
  step_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # rows bucket -> last chunk's s/step


def open_batch(model, cfg: ServeConfig, key: BatchKey, *, fan_out: int, compile_buckets: tuple[int, ...] | None
               ) -> MethodBatch:
  """A new, empty batch of `key`; `fan_out`: a staged method's threads (SoT's expansions: one point prompt each);
  `compile_buckets`: compile every chunk and admission shape now (`RowBatch.compile_shapes`), or None."""
  method = key.method
  bos = model.tokenizer.encode(" ", add_bos=True)[:1]
  staged = method.capabilities.needs_scripts
  scripts = [[bos] * fan_out] if staged else None
  script_len = cfg.sot_script_tokens if staged else 0
  max_tokens = cfg.max_tokens + script_len
  runtime = Runtime(dtype=cfg.dtype, certify_head=key.certified)
  ready = prepared(method, model, Setup(max_new_tokens=max_tokens, runtime=runtime), serving=True)
  prep = prepare_run(model, [bos], ready, max_new_tokens=max_tokens, sampling=key.envelope, scripts=scripts,
                     runtime=runtime)
  pool = cfg.pool_slots * (sot.EXPAND_POOL_FACTOR if staged else 1)
  batch_cfg = batching.batch_config(dataclasses.replace(prep.cfg, pool_slots=pool), max_tokens)
  rows = batching.RowBatch(prep.model_fn, prep.params, batch_cfg, batch=cfg.batch, vocab_size=prep.vocab_size,
                           pool_spec=prep.pool_spec, rule_inputs=prep.rule_inputs, script_len=script_len)
  if compile_buckets is not None:
    rows.compile_shapes(compile_buckets)
  sizes = getattr(batch_cfg.rules, "sizes", ())  # the tree sizes a dynamic tree picks from (none: it runs plainly)
  learns = method.capabilities.learns_latency and len(sizes) > 1
  latency = OnlineLatency(sizes, cfg.propd_samples) if learns else None
  return MethodBatch(key, rows, dataclasses.replace(prep, cfg=batch_cfg), latency=latency)


def chunk_length(entry: MethodBatch, cfg: ServeConfig, rows: int, metrics: ServeMetrics, waiting: bool = True) -> int:
  """Steps of the batch's next chunk: `chunk_steps`, at most `first_chunk_steps` right after an admission (the
  newcomers' first text), and at most `chunk_seconds` of this rows bucket's last measured step time while a
  newcomer could be admitted after it (the batch has a free row, or requests are `waiting` for one: a newcomer
  waits for the chunk that runs when it arrives), except while ProPD times this bucket's whole chunks. A full batch
  with nobody waiting runs whole chunks: each chunk is a device call and a host visit (a chunk of one step cost
  17-22% more per step than one of eight in three of four measurements, 16 rows of the shipped default on 2 CPU
  cores)."""
  steps = cfg.chunk_steps
  if entry.fresh:
    steps = min(steps, cfg.first_chunk_steps)
  step_s = entry.step_seconds.get(rows)
  calibrating = entry.latency is not None and entry.latency.calibrating(rows)
  admitting = waiting or bool(entry.rows.free_rows())
  if cfg.chunk_seconds and step_s and not calibrating and admitting:
    steps = min(steps, max(1, int(cfg.chunk_seconds / step_s)))
  metrics.chunks.labels("short" if steps < cfg.chunk_steps else "full").inc()
  return steps


def run_chunk(entry: MethodBatch, cfg: ServeConfig, lang: LangTokenizer, metrics: ServeMetrics,
              waiting: bool = True) -> None:
  """One chunk of the batch's busy rows, then a visit: every holder gets its new text; ProPD's step times learn.
  `waiting`: requests wait to be admitted (`chunk_length`)."""
  batch = entry.rows
  rows, step = batch.rows_to_run(), int(batch.state.step)
  if entry.latency is not None:
    batch.state = entry.prep.cfg.rules.with_latency(batch.state, entry.latency.table(rows))
  steps = chunk_length(entry, cfg, rows, metrics, waiting)
  begin = time.perf_counter()
  batch.run(steps)
  entry.fresh = False
  view = visit(entry, lang, metrics)
  seconds = time.perf_counter() - begin
  metrics.chunk_seconds.observe(seconds)
  if view.step > step:  # the step time that sizes this rows bucket's next chunks (host visit included)
    entry.step_seconds[rows] = seconds / (view.step - step)
  whole = steps == cfg.chunk_steps  # ProPD times whole chunks: a short one's host visit weighs on few steps
  if entry.latency is not None and whole:
    entry.latency.observe(rows, seconds, view.step - step)
    for fitted_rows, (alpha, beta) in entry.latency.fits().items():
      metrics.propd_latency.labels(str(fitted_rows), "alpha").set(alpha)
      metrics.propd_latency.labels(str(fitted_rows), "beta").set(beta)


def visit(entry: MethodBatch, lang: LangTokenizer, metrics: ServeMetrics) -> batching.HostView:
  """Copies the batch's records to the host, hands every holder its new text, and frees the rows of those that
  ended (finished, cut, cancelled or failed)."""
  batch, holders = entry.rows, entry.holders
  view = batch.peek()
  now = time.perf_counter()
  ended = []
  for row, request in list(holders.items()):
    run = batch.output(view, row)
    if request.dropped:
      ended.append(row)
      metrics.finished.labels(request.label, "cancelled").inc()
      continue
    live = view.live(row)
    try:
      result = None if live else api.to_result(run, now - request.created, lang, entry.prep)
      hand_out(request, run, lang, entry.prep.vocab, result, now, metrics)
    except Exception as err:  # one request's host-side failure (its text, its client) ends it, not the engine
      with contextlib.suppress(Exception):
        request.sink(Update("", True, "error", note=f"server error in this request: {err!r}"))
      metrics.finished.labels(request.label, "error").inc()
      live = False
    if not live:
      ended.append(row)
  for row in ended:
    del holders[row]
  batch.release(ended)
  return view


def hand_out(request: Request, run, lang: LangTokenizer, vocab, result: Result | None, now: float,
             metrics: ServeMetrics) -> None:
  """Counts the request's new tokens and hands it its new settled text (and, at the end, its result)."""
  metrics.tokens.labels(request.label).inc(max(run.content - request.counted, 0))
  request.counted = max(run.content, request.counted)
  if request.hidden:
    if result is not None:
      request.sink(Update("", True, "stop" if result.stop_reason == "end" else "length", result))
    return
  if request.render is not None:
    text = request.render(run.records, result is not None)
    result = None if result is None else dataclasses.replace(result, text=text)
  else:
    streams = request.method.capabilities.stream
    text = streaming.settled_text(run.records, lang, vocab, streams) if result is None else result.text
  delta = streaming.delta(request.sent, text)
  if delta is None:  # the final text does not extend what was streamed (a detokenizer seam)
    metrics.stream_seams.inc()
    delta = ""
  if delta:
    request.sent += delta
    if request.first_token_at is None:
      request.first_token_at = now
      metrics.ttft.observe(now - request.created)
  threads = None
  if request.thread_progress:  # (a stage's forced point prompts are not what its threads wrote)
    forced = [len(script) for script in request.scripts] if request.scripts else ()
    threads = thread_text.thread_texts(run.records, lang, vocab, run.parents, final=result is not None, forced=forced)
  if result is None:
    if delta or threads:
      request.sink(Update(delta, threads=threads))
    return
  reason = "stop" if result.stop_reason == "end" else "length"
  metrics.finished.labels(request.label, reason).inc()
  metrics.latency.observe(now - request.created)
  request.sink(Update(delta, True, reason, result, note=result.stop_note, threads=threads))
