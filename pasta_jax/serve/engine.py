"""The serving engine: a queue, one `RowBatch` per (method, sampling), and a thread that runs them in chunks.

Each turn of the engine thread runs one chunk of `chunk_steps` steps on every batch with live rows. Before
each chunk, waiting requests are admitted into free rows (prefill of the newcomers only), and a batch that
just took newcomers runs a short chunk (`first_chunk_steps`), so their first text streams soon. A request that
arrives mid-chunk is admitted when the chunk ends, so a chunk lasts at most about `chunk_seconds`: its steps
come from the batch's measured step time (at 16 rows on 2 CPU cores a step takes ~0.2 s, and 8 of them would
keep a newcomer out for up to 1.5 s, and as long again behind the other method's batch). After each
chunk the host copies the batch's records and hands each request its new settled text
(`streaming.settled_text`). A finished, cut or cancelled request leaves its row at the end of the chunk; the
row is reused by the next newcomer. Requests reach the engine from any thread (`submit`); updates go back
through each request's `sink` callback.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

from pasta_jax.baselines.sot import SotConfig, skeleton_prompt_ids
from pasta_jax.decode import api, batching
from pasta_jax.decode.result import Result
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.errors import PastaError
from pasta_jax.methods import Method, Setup, Sot, prepare_run, prepared, registry
from pasta_jax.serve import programs, sot, streaming
from pasta_jax.serve.metrics import ServeMetrics
from pasta_jax.serve.propd import OnlineLatency


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Fixed shapes and limits chosen at start-up."""

  batch: int = 8  # rows per method batch
  pool_slots: int = 1024  # KV slots per row (prompt + answer, tags included)
  chunk_steps: int = 8  # steps per device call between host visits
  # after an admission, the batch's next chunk: newcomers' first text streams after this many steps, not K
  # (the last token is held back one chunk, `streaming`), at the cost of one more host visit
  first_chunk_steps: int = 2
  # a chunk's steps are at most chunk_seconds / the batch's measured step time (at least 1); 0: chunk_steps always
  chunk_seconds: float = 0.5
  max_queue: int = 64  # waiting requests before 429
  max_tokens: int = 512  # the largest max_tokens a request may ask
  default_max_tokens: int | None = None  # for a request without max_tokens (None: min(256, max_tokens))
  max_batches: int = 4  # compiled (method, sampling) batches held at once
  dtype: str = "float32"
  # the served methods' options (a method not here is served with its defaults): e.g. `Pasta(lanes=4)`,
  # `Medusa(heads=folder)`, `Superposed(drafts=3)` (a request's `n` takes its best n drafts)
  methods: tuple[Method, ...] = ()
  propd_samples: int = 2  # ProPD: timed chunks per tree size and rows bucket before T(s) is fitted (`serve/propd.py`)
  sot: SotConfig = SotConfig()  # SoT's stages (its point and answer budgets are each request's max_tokens)
  sot_script_tokens: int = 128  # the longest point prompt a SoT row takes (longer: answered plainly)
  # Greedy batches choose from a bfloat16 copy of the head, certified against the float32 one (the same tokens;
  # `decode/certified_head.py`); sampled requests and Superposed Decoding read logit values and keep float32.
  certify_head: bool = False

  def __post_init__(self):
    if self.default_max_tokens is None:
      object.__setattr__(self, "default_max_tokens", min(256, self.max_tokens))
    if self.chunk_seconds < 0:
      raise ValueError(f"chunk_seconds must be at least 0, got {self.chunk_seconds}")
    for name in ("batch", "pool_slots", "chunk_steps", "first_chunk_steps", "max_queue", "max_tokens",
                 "default_max_tokens", "max_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
    if self.default_max_tokens > self.max_tokens:
      raise ValueError(f"default_max_tokens {self.default_max_tokens} > max_tokens {self.max_tokens}")
    named = [m.name for m in self.methods]
    if len(set(named)) < len(named) or not all(isinstance(m, Method) and m.capabilities.serve for m in self.methods):
      raise ValueError(f"methods: one served method value per name, got {self.methods!r}")
    if self.certify_head and self.dtype != "float32":
      raise ValueError(f"certify_head certifies a float32 model's head, not a {self.dtype} one")


@dataclasses.dataclass(frozen=True)
class Update:
  """What a request learns after a chunk: new settled text, and at the end the result."""

  delta: str
  done: bool = False
  finish_reason: str | None = None  # "stop" | "length" | "cancelled"
  result: Result | None = None
  note: str = ""


class QueueFull(PastaError):
  pass


class ShuttingDown(PastaError):
  pass


_IDS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
  """One completion: prompt ids, method and budgets, and where its updates go."""

  ids: list[int]
  method: Method  # (a name, when submitted: the engine's served method of that name)
  max_tokens: int
  sink: Callable[[Update], None]
  sampling: SamplingConfig = SamplingConfig()
  created: float = dataclasses.field(default_factory=time.perf_counter)
  id: str = dataclasses.field(default_factory=lambda: f"cmpl-{next(_IDS)}")
  cancelled: bool = False  # set by the client side; the engine drops the request at its next visit
  sent: str = ""  # settled text already handed out
  counted: int = 0  # content tokens already counted in the metrics
  first_token_at: float | None = None
  question: str | None = None  # sot: the question its stages are built from
  chat: bool = True  # sot: whether its stage prompts are chat turns
  stage_of: Request | None = None  # an internal stage (`serve/sot.py`): the client request it serves
  hidden: bool = False  # a stage whose text the client never sees (SoT's skeleton); its normal end is not counted
  scripts: list | None = None  # a stage's per-thread point prompts
  render: Callable | None = None  # a stage's text from (records, final), instead of the method's

  @property
  def key(self) -> tuple:
    return (self.method, self.sampling)

  @property
  def dropped(self) -> bool:
    return self.cancelled or (self.stage_of is not None and self.stage_of.cancelled)

  @property
  def label(self) -> str:
    """The method the metrics count it under: the client's."""
    return (self.stage_of or self).method.name


@dataclasses.dataclass
class MethodBatch:
  """One compiled (method, sampling): its rows, the requests holding them, and its prepared config."""

  rows: batching.RowBatch
  prep: api.Prepared  # its cfg is the batch's (vocab, rules, tokenizer-facing parts for `to_result`)
  holders: dict[int, Request] = dataclasses.field(default_factory=dict)
  latency: OnlineLatency | None = None  # ProPD: its step-time model, measured from these chunks
  fresh: bool = False  # newcomers since the last chunk: the next one is short, so their first text streams soon
  step_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # rows bucket -> last chunk's s/step


class Engine:
  """Continuous batching over the interpreter for one model. `start()` runs the engine thread."""

  def __init__(self, model, cfg: ServeConfig = ServeConfig(), metrics: ServeMetrics | None = None):
    self.model, self.cfg = model, cfg
    self.metrics = metrics or ServeMetrics()
    self.lang = LangTokenizer(model.tokenizer)
    self.batches: collections.OrderedDict[tuple, MethodBatch] = collections.OrderedDict()
    self.waiting: collections.deque[Request] = collections.deque()
    self.lock = threading.Condition()
    self.thread: threading.Thread | None = None
    self.stopping = False
    self.drain_deadline: float | None = None
    self.error: BaseException | None = None
    self.served = {m.name: m for m in cfg.methods}
    self.compile_ahead: set[Method] = set()  # methods whose batches compile every shape when created (`warm_up`)
    self.prompt_buckets: tuple[int, ...] = ()  # the prompt buckets their admissions compile for
    self.programs = programs.ProgramGuard(on_drop=self._dropped_programs)  # CPU: compiled code fills memory maps

  # --- the client side ---------------------------------------------------------------------------------
  def method_named(self, name: str) -> Method:
    """The served method of that name: with the server's options for it, else its defaults."""
    return self.served.get(name) or registry.resolve(name)

  def check(self, ids: list[int], max_tokens: int) -> None:
    """Raises PastaError for a request this server cannot run (before it is queued)."""
    if not 1 <= max_tokens <= self.cfg.max_tokens:
      raise PastaError(f"max_tokens must be in [1, {self.cfg.max_tokens}], got {max_tokens}")
    padded = batching.bucket(len(ids))
    if padded >= self.cfg.pool_slots:
      raise PastaError(f"the prompt has {len(ids)} tokens (padded to {padded}); the pool of "
                       f"{self.cfg.pool_slots} slots per request leaves no room to answer")

  def submit(self, request: Request) -> None:
    """Queues a checked request (a method given by name gets the served options of that name); raises QueueFull or
    ShuttingDown."""
    if isinstance(request.method, str):
      request.method = self.method_named(request.method)
    self.check(request.ids, request.max_tokens)
    if request.method.capabilities.needs_scripts:  # SoT: its skeleton prompt must fit too
      if not request.question:
        raise PastaError(f"method {request.method.name!r} builds its stages from the question: give Request.question")
      self.check(skeleton_prompt_ids(self.model.tokenizer, request.question, self._sot_config(request)), 1)
    with self.lock:
      if self.error is not None:
        raise ShuttingDown(f"the engine failed: {self.error}")
      if self.stopping:
        raise ShuttingDown("the server is shutting down")
      if len(self.waiting) >= self.cfg.max_queue:
        self.metrics.rejected.labels("queue_full").inc()
        raise QueueFull(f"the queue is full ({self.cfg.max_queue} waiting)")
      self.waiting.append(request)
      self.metrics.queue.set(len(self.waiting))
      self.lock.notify()

  def cancel(self, request: Request) -> None:
    request.cancelled = True
    with self.lock:
      self.lock.notify()

  # --- lifecycle ----------------------------------------------------------------------------------------
  def start(self) -> Engine:
    self.thread = threading.Thread(target=self._run_safely, name="pasta-engine", daemon=True)
    self.thread.start()
    return self

  def stop(self, grace_s: float = 10.0) -> None:
    """Refuses new requests, lets running ones finish for up to `grace_s`, then cuts the rest cleanly."""
    with self.lock:
      self.stopping = True
      self.drain_deadline = time.perf_counter() + grace_s
      self.lock.notify()
    if self.thread is not None and self.thread.is_alive():
      self.thread.join(timeout=grace_s + 60)
    else:  # never started (or already ended): nobody else will tell the waiting requests
      self._cut_everyone()

  def warm_up(self, methods=("pasta",), prompt_tokens: int = 64) -> None:
    """Compiles each method's batch ahead of the first request (blocking): its chunk program for every rows
    prefix, and its admission for every group size and prompt bucket up to `prompt_tokens`'s."""
    methods = [self.method_named(m) if isinstance(m, str) else m for m in methods]
    for method in methods:
      staged = method.capabilities.needs_scripts
      self.compile_ahead.update((sot.PLAN, self.expand_method) if staged else (method,))
    self.prompt_buckets = tuple(1 << i for i in range(4, batching.bucket(prompt_tokens).bit_length()))
    for method in methods:
      done = threading.Event()
      ids = [self.model.tokenizer.encode(" ", add_bos=True)[0]] * max(prompt_tokens, 1)
      self.submit(Request(ids=ids, method=method, max_tokens=2, sink=lambda u, d=done: u.done and d.set(),
                          question="Name three colors."))
      if not done.wait(timeout=1800):
        raise PastaError(f"warm-up of {method.name!r} did not finish")

  @property
  def running(self) -> int:
    return sum(len(b.holders) for b in self.batches.values())

  # --- the engine thread --------------------------------------------------------------------------------
  def _run_safely(self) -> None:
    try:
      self._run()
    except BaseException as err:  # a device or program error: fail every request loudly, keep the reason
      self.error = err
      for request in self._everyone():
        request.sink(Update("", True, "error", note=f"server error: {err}"))
      raise

  def _everyone(self) -> list[Request]:
    with self.lock:
      waiting, self.waiting = list(self.waiting), collections.deque()
    return waiting + [r for b in self.batches.values() for r in b.holders.values()]

  def _run(self) -> None:
    while True:
      with self.lock:
        if not self.waiting and not self.running and not self.stopping:
          self.lock.wait(timeout=0.5)
        idle = not self.running and not self.waiting
        if self.stopping and (idle or time.perf_counter() > self.drain_deadline):
          break
      self.programs.check()
      self._admit_waiting()
      for i, key in enumerate(list(self.batches)):
        if i:  # between batches too: a newcomer waits for one batch's chunk, not for a whole turn of them
          self._admit_waiting()
        if key in self.batches:  # (an admission may evict an idle batch)
          self._run_chunk(key)
    self._cut_everyone()

  def _dropped_programs(self, used: int, limit: int) -> None:
    self.metrics.program_drops.inc()
    programs.log_drop(used, limit)

  def _cut_everyone(self) -> None:
    for request in self._everyone():
      request.sink(Update("", True, "length", note="cut: the server shut down"))
      self.metrics.finished.labels(request.label, "shutdown").inc()
    self.batches.clear()

  def _admit_waiting(self) -> None:
    with self.lock:
      waiting = [r for r in self.waiting if not r.dropped]
      for request in self.waiting:
        if request.dropped:
          self.metrics.finished.labels(request.label, "cancelled").inc()
      waiting = [self._skeleton_stage(r) if r.method.capabilities.needs_scripts and r.stage_of is None else r
                 for r in waiting]
      self.waiting = collections.deque(waiting)
    groups: dict[tuple, list[Request]] = collections.defaultdict(list)
    for request in waiting:
      try:
        entry = self._batch_for(request.key)
      except PastaError as err:  # this method cannot run here (no Medusa heads, no n-gram index): say so
        self._refuse(request, err)
        continue
      if entry is not None and len(groups[request.key]) < len(entry.rows.free_rows()):
        groups[request.key].append(request)
    for key, requests in groups.items():
      entry = self.batches[key]
      requests, budgets = self._budgets(entry, requests)
      if not requests:
        continue
      scripts = [r.scripts for r in requests] if entry.rows.script_len else None
      rows = entry.rows.admit([r.ids for r in requests], budgets, scripts)
      for row, request in zip(rows, requests, strict=True):
        entry.holders[row] = request
      with self.lock:
        for request in requests:
          self.waiting.remove(request)
      entry.fresh = True
    self.metrics.queue.set(len(self.waiting))
    self.metrics.running.set(self.running)

  def _budgets(self, entry: MethodBatch, requests: list[Request]) -> tuple[list[Request], list]:
    """The requests that fit the batch, with their row budgets; one that does not is ended with its reason
    (a guard: `submit` checks what it can before queueing)."""
    kept, budgets = [], []
    for request in requests:
      try:
        budgets.append(batching.row_budgets(entry.rows.cfg, len(request.ids), request.max_tokens, request.scripts))
        kept.append(request)
      except PastaError as err:
        self._refuse(request, err)
    return kept, budgets

  def _refuse(self, request: Request, err: PastaError) -> None:
    """Ends a queued request that cannot run, with the reason."""
    with self.lock:
      self.waiting.remove(request)
    request.sink(Update("", True, "error", note=f"not served: {err}"))
    self.metrics.finished.labels(request.label, "error").inc()

  def _batch_for(self, key: tuple) -> MethodBatch | None:
    """The batch of a (method, sampling), created (and an idle one evicted) when needed; None: wait."""
    if key in self.batches:
      self.batches.move_to_end(key)
      return self.batches[key]
    if len(self.batches) >= self.cfg.max_batches:
      idle = next((k for k, b in self.batches.items() if not b.holders), None)
      if idle is None:
        return None
      del self.batches[idle]
    method, sampling = key
    bos = self.model.tokenizer.encode(" ", add_bos=True)[:1]
    staged = method.capabilities.needs_scripts  # SoT's expansions: a fan-out of threads, each with its point prompt
    scripts = [[bos] * self.sot_fan_out] if staged else None
    script_len = self.cfg.sot_script_tokens if staged else 0
    max_tokens = self.cfg.max_tokens + script_len
    runtime = Runtime(dtype=self.cfg.dtype, certify_head=self.certifies(method, sampling))
    ready = prepared(method, self.model, Setup(max_new_tokens=max_tokens, runtime=runtime), serving=True)
    prep = prepare_run(self.model, [bos], ready, max_new_tokens=max_tokens, sampling=sampling, scripts=scripts,
                       runtime=runtime)
    pool = self.cfg.pool_slots * (sot.EXPAND_POOL_FACTOR if staged else 1)
    cfg = batching.batch_config(dataclasses.replace(prep.cfg, pool_slots=pool), max_tokens)
    rows = batching.RowBatch(prep.model_fn, prep.params, cfg, batch=self.cfg.batch, vocab_size=prep.vocab_size,
                             pool_spec=prep.pool_spec, rule_inputs=prep.rule_inputs, script_len=script_len)
    if method in self.compile_ahead:
      rows.compile_shapes(self.prompt_buckets)
    sizes = getattr(cfg.rules, "sizes", ())  # the tree sizes a dynamic tree picks from (none: it runs plainly)
    learns = method.capabilities.learns_latency and len(sizes) > 1
    latency = OnlineLatency(sizes, self.cfg.propd_samples) if learns else None
    self.batches[key] = MethodBatch(rows, dataclasses.replace(prep, cfg=cfg), latency=latency)
    return self.batches[key]

  def certifies(self, method: Method, sampling) -> bool:
    """Whether the batch of (method, sampling) chooses through the certified head (`ServeConfig.certify_head`)."""
    return self.cfg.certify_head and sampling.greedy and method.capabilities.certify_head

  def _run_chunk(self, key: tuple) -> None:
    entry = self.batches[key]
    batch = entry.rows
    if not entry.holders:
      return
    rows, step = batch.rows_to_run(), int(batch.state.step)
    if entry.latency is not None:
      batch.state = entry.prep.cfg.rules.with_latency(batch.state, entry.latency.table(rows))
    steps = self.chunk_length(entry, rows)
    begin = time.perf_counter()
    batch.run(steps)
    entry.fresh = False
    view = self._visit(entry, list(entry.holders))
    seconds = time.perf_counter() - begin
    self.metrics.chunk_seconds.observe(seconds)
    if view.step > step:  # the step time that sizes this rows bucket's next chunks (host visit included)
      entry.step_seconds[rows] = seconds / (view.step - step)
    whole = steps == self.cfg.chunk_steps  # ProPD times whole chunks: a short one's host visit weighs on few steps
    if entry.latency is not None and whole:
      entry.latency.observe(rows, seconds, view.step - step)
      for fitted_rows, (alpha, beta) in entry.latency.fits().items():
        self.metrics.propd_latency.labels(str(fitted_rows), "alpha").set(alpha)
        self.metrics.propd_latency.labels(str(fitted_rows), "beta").set(beta)

  def chunk_length(self, entry: MethodBatch, rows: int) -> int:
    """Steps of the batch's next chunk: `chunk_steps`, at most `first_chunk_steps` right after an admission (the
    newcomers' first text), and at most `chunk_seconds` of this rows bucket's last measured step time (a newcomer
    waits for the chunk that runs when it arrives), except while ProPD times this bucket's whole chunks."""
    steps = self.cfg.chunk_steps
    if entry.fresh:
      steps = min(steps, self.cfg.first_chunk_steps)
    step_s = entry.step_seconds.get(rows)
    calibrating = entry.latency is not None and entry.latency.calibrating(rows)
    if self.cfg.chunk_seconds and step_s and not calibrating:
      steps = min(steps, max(1, int(self.cfg.chunk_seconds / step_s)))
    self.metrics.chunks.labels("short" if steps < self.cfg.chunk_steps else "full").inc()
    return steps

  def _visit(self, entry: MethodBatch, rows: list[int]) -> batching.HostView:
    """Copies the batch's records to the host, hands the requests in `rows` their new text, and frees the
    rows of those that ended (finished, cut, cancelled or failed)."""
    batch, holders = entry.rows, entry.holders
    view = batch.peek()
    now = time.perf_counter()
    ended = []
    for row in rows:
      request = holders[row]
      run = batch.output(view, row)
      if request.dropped:
        ended.append(row)
        self.metrics.finished.labels(request.label, "cancelled").inc()
        continue
      live = view.live(row)
      try:
        result = None if live else api.to_result(run, now - request.created, self.lang, entry.prep)
        self._hand_out(request, run, entry.prep.vocab, result, now)
      except Exception as err:  # one request's host-side failure (its text, its client) ends it, not the engine
        with contextlib.suppress(Exception):
          request.sink(Update("", True, "error", note=f"server error in this request: {err!r}"))
        self.metrics.finished.labels(request.label, "error").inc()
        live = False
      if not live:
        ended.append(row)
    for row in ended:
      del holders[row]
    batch.release(ended)
    self.metrics.running.set(self.running)
    return view

  def _hand_out(self, request: Request, run, vocab, result: Result | None, now: float) -> None:
    """Counts the request's new tokens and hands it its new settled text (and, at the end, its result)."""
    self.metrics.tokens.labels(request.label).inc(max(run.content - request.counted, 0))
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
      text = streaming.settled_text(run.records, self.lang, vocab, streams) if result is None else result.text
    delta = streaming.delta(request.sent, text)
    if delta is None:  # the final text does not extend what was streamed (a detokenizer seam)
      self.metrics.stream_seams.inc()
      delta = ""
    if delta:
      request.sent += delta
      if request.first_token_at is None:
        request.first_token_at = now
        self.metrics.ttft.observe(now - request.created)
    if result is None:
      if delta:
        request.sink(Update(delta))
      return
    reason = "stop" if result.stop_reason == "end" else "length"
    self.metrics.finished.labels(request.label, reason).inc()
    self.metrics.latency.observe(now - request.created)
    request.sink(Update(delta, True, reason, result, note=result.stop_note))

  # --- Skeleton-of-Thought's stages (`serve/sot.py`) ---------------------------------------------------------
  @property
  def sot_fan_out(self) -> int:
    return min(self.method_named(Sot.name).lanes, self.cfg.sot.max_points)

  @property
  def expand_method(self) -> Sot:
    """The method of SoT's expansion batch: the served `Sot`, its threads the fan-out."""
    return dataclasses.replace(self.method_named(Sot.name), max_threads=self.sot_fan_out)

  def _sot_config(self, request: Request) -> SotConfig:
    return dataclasses.replace(self.cfg.sot, chat=request.chat, point_tokens=request.max_tokens,
                               answer_tokens=request.max_tokens)

  def _stage(self, parent: Request, method: Method, ids: list[int], max_tokens: int, sink, **kw) -> Request:
    return Request(ids=ids, method=method, max_tokens=max_tokens, sink=sink, sampling=parent.sampling,
                   created=parent.created, id=parent.id, stage_of=parent, **kw)

  def _skeleton_stage(self, parent: Request) -> Request:
    """Stage 1 in place of the client's request; when it ends, stage 2 is queued (`_after_skeleton`)."""
    config = self._sot_config(parent)
    ids = skeleton_prompt_ids(self.model.tokenizer, parent.question, config)
    return self._stage(parent, sot.PLAN, ids, config.skeleton_tokens, hidden=True,
                       sink=lambda update: self._after_skeleton(parent, config, update))

  def _expansion_too_big(self, ids: list[int], scripts, config: SotConfig) -> str:
    """Why an expansion cannot be served as SoT alone runs it (its rows hold less than the pool SoT gives it:
    the expansions would end sooner), or ""."""
    need = sot.expansion_slots(ids, scripts, config, self.expand_method.lanes)
    room = self.cfg.pool_slots * sot.EXPAND_POOL_FACTOR
    return f"the expansion needs {need} pool slots, the server's SoT rows hold {room}" if need > room else ""

  def _after_skeleton(self, parent: Request, config: SotConfig, update: Update) -> None:
    if not update.done:
      return
    if update.result is None:  # cut or failed: the client hears it as it is
      parent.sink(update)
      return
    end_id = self.model.tokenizer.tag_vocab().eos_ids[0]
    ids, scripts, expansion = sot.stage_two(self.model.tokenizer, parent.question, update.result.text, config,
                                            self.sot_fan_out, self.cfg.sot_script_tokens, end_id)
    if ids is not None:
      try:
        self.check(ids, 1)
      except PastaError as err:
        ids, expansion = None, f"the points' prompt does not fit: {err}"
    too_big = self._expansion_too_big(ids, scripts, config) if ids is not None else ""
    if too_big:
      ids, expansion = None, too_big
    if ids is None:  # no usable skeleton: answer plainly, and say why
      plain = api.prompt_ids(self.model.tokenizer, [parent.question], config.chat)[0]
      stage = self._stage(parent, sot.PLAN, plain, config.answer_tokens, _noting(parent.sink, expansion))
    else:
      render = lambda records, final: expansion.text(records, self.lang, self.model.tokenizer.tag_vocab(), final)
      stage = self._stage(parent, self.expand_method, ids, sot.expansion_budget(config, scripts), parent.sink,
                          scripts=scripts, render=render)
    with self.lock:  # a running request's next stage: ahead of the queue, and not counted against it
      self.waiting.appendleft(stage)


def _noting(sink, note: str):
  """`sink` with `note` added to the last update."""
  def noted(update: Update) -> None:
    sink(dataclasses.replace(update, note="; ".join(filter(None, [update.note, note]))) if update.done else update)
  return noted
