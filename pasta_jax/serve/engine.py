"""The serving engine: a queue, one batch per served method (`serve/batches.py`), and a supervised thread that
runs them in chunks.

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

Supervision: an exception while a batch admits or runs a chunk fails that batch's requests (an error update,
status 500), drops the batch, and the engine serves on; a failure of the loop itself fails every request in
flight and restarts the loop (at most `max_restarts` in a row). A watchdog marks the engine "stalled" when it
has work and for `stall_s` no turn ends and no program of its compiles (`_track_compiles`). `/health` reads
all of it (`health`), `/metrics` counts it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time

import jax

from pasta_jax.baselines.sot import skeleton_prompt_ids
from pasta_jax.decode import batching
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.errors import PastaError
from pasta_jax.methods import Method, registry
from pasta_jax.serve import batches, programs, sot
from pasta_jax.serve.batches import BatchKey, MethodBatch
from pasta_jax.serve.config import ServeConfig
from pasta_jax.serve.metrics import ServeMetrics
from pasta_jax.serve.requests import QueueFull, Request, ShuttingDown, Update
from pasta_jax.serve.stages import SotStages

COMPILE_S = 1800.0  # the watchdog's patience while a new batch compiles (every shape ahead, on a loaded CPU)

__all__ = ["Engine", "QueueFull", "Request", "ServeConfig", "ShuttingDown", "Update"]


class Engine(SotStages):
  """Continuous batching over the interpreter for one model. `start()` runs the engine thread."""

  def __init__(self, model, cfg: ServeConfig | None = None, metrics: ServeMetrics | None = None):
    self.model, self.cfg = model, cfg or ServeConfig()
    self.metrics = metrics or ServeMetrics()
    self.lang = LangTokenizer(model.tokenizer)
    self.batches: collections.OrderedDict[BatchKey, MethodBatch] = collections.OrderedDict()
    self.waiting: collections.deque[Request] = collections.deque()
    self.lock = threading.Condition()
    self.thread: threading.Thread | None = None
    self.stopping = False
    self.drain_deadline: float | None = None
    self.error: BaseException | None = None  # the engine gave up (`max_restarts` failures of its loop in a row)
    self.last_failure = ""  # the last batch or loop failure, for /health
    self.turn_at = time.perf_counter()  # when the engine last finished a turn (the watchdog reads it)
    self.stalled = False
    self.compiling = False  # creating (and compiling) a batch
    # An admission or chunk of a shape not compiled ahead compiles when first run, for minutes on a busy CPU: the
    # engine's thread tracing, lowering or compiling a program is progress too (`_track_compiles`)
    self.xla_compiling = False  # between a lowering and its compile
    self.compiled_at = 0.0  # when the engine's thread last finished tracing, lowering or compiling a program
    self.turns = 0  # turns of the engine loop begun (the supervisor counts failures in a row by them)
    self.served = {m.name: m for m in cfg.methods}
    self.compile_ahead: set[Method] = set()  # methods whose batches compile every shape when created (`warm_up`)
    self.prompt_buckets: tuple[int, ...] = ()  # the prompt buckets their admissions compile for
    self.programs = programs.ProgramGuard(on_drop=self._dropped_programs)  # CPU: compiled code fills memory maps
    _count_compiles(self.metrics)
    self.metrics.decode_programs.set_function(batching.decode_programs)

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
    """Queues a checked request (a method given by name gets the served options of that name); raises QueueFull,
    ShuttingDown, or PastaError for a request this server cannot run."""
    if isinstance(request.method, str):
      request.method = self.method_named(request.method)
    self.check(request.ids, request.max_tokens)
    request.method.check_request(sampling=request.sampling, runtime=Runtime(dtype=self.cfg.dtype), forced=False)
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
      request.queued_at = time.perf_counter()
      self.waiting.append(request)
      self.metrics.queue.set(len(self.waiting))
      self.lock.notify()

  def cancel(self, request: Request) -> None:
    request.cancelled = True
    with self.lock:
      self.lock.notify()

  # --- lifecycle ----------------------------------------------------------------------------------------
  def start(self) -> Engine:
    self.thread = threading.Thread(target=self._supervise, name=f"pasta-engine-{id(self)}", daemon=True)
    _track_compiles(self.thread.name, self)
    self.thread.start()
    threading.Thread(target=self._watch, name="pasta-watchdog", daemon=True).start()
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
      self._end_everyone(Update("", True, "length", note="cut: the server shut down"), "shutdown")
    if self.thread is not None and not self.thread.is_alive():
      _ENGINES.pop(self.thread.name, None)

  def warm_up(self, methods=("pasta",), prompt_tokens: int = 64) -> None:
    """Compiles each method's batch ahead of the first request (blocking): its chunk program for every rows
    prefix, and its admission for every group size and prompt bucket up to `prompt_tokens`'s. A warm-up request
    that fails stops start-up with its error."""
    methods = [self.method_named(m) if isinstance(m, str) else m for m in methods]
    for method in methods:
      staged = method.capabilities.needs_scripts
      self.compile_ahead.update((sot.PLAN, self.expand_method) if staged else (method,))
    self.prompt_buckets = tuple(1 << i for i in range(4, batching.bucket(prompt_tokens).bit_length()))
    for method in methods:
      done, ends = threading.Event(), []
      def sink(update: Update, done=done, ends=ends) -> None:
        if update.done:
          ends.append(update)
          done.set()
      ids = [self.model.tokenizer.encode(" ", add_bos=True)[0]] * max(prompt_tokens, 1)
      self.submit(Request(ids=ids, method=method, max_tokens=2, sink=sink, question="Name three colors."))
      if not done.wait(timeout=1800):
        raise PastaError(f"warm-up of {method.name!r} did not finish in 30 minutes")
      if ends[0].finish_reason == "error":
        raise PastaError(f"warm-up of {method.name!r} failed: {ends[0].note}")

  @property
  def running(self) -> int:
    with self.lock:
      return sum(len(b.holders) for b in list(self.batches.values()))

  def health(self) -> dict:
    """What `/health` reports, read under the lock: "ok", "draining", "failed" (the engine thread ended) or
    "stalled" (work to do and, for `stall_s`, no turn of the engine finished and no program of it compiled)."""
    if self.lock.acquire(timeout=0.5):  # (it is never held long; /health must answer even if it were)
      try:
        running = sum(len(b.holders) for b in list(self.batches.values()))
        queued = len(self.waiting)
      finally:
        self.lock.release()
    else:
      running = queued = -1
    status, reason = ("draining" if self.stopping else "ok"), ""
    if self.error is not None or (self.thread is not None and not self.thread.is_alive() and not self.stopping):
      status, reason = "failed", f"engine failed: {self.error}"
    elif self._stalled_for() is not None:
      status, reason = "stalled", f"no engine turn finished for {self._stalled_for():.0f} s with work to do"
    return {"status": status, "reason": reason, "running": running, "queued": queued,
            "last_failure": self.last_failure}

  def _stalled_for(self) -> float | None:
    """Seconds since the engine's last turn, when it has work and that is past `stall_s`; else None."""
    idle = time.perf_counter() - max(self.turn_at, self.compiled_at)
    busy = bool(self.waiting) or any(b.holders for b in list(self.batches.values()))
    limit = max(self.cfg.stall_s, COMPILE_S) if self.compiling or self.xla_compiling else self.cfg.stall_s
    return idle if busy and idle > limit else None

  def _watch(self) -> None:
    """The watchdog: counts (and logs) each time the engine starts to stall."""
    while self.thread is not None and self.thread.is_alive():
      stalled = self._stalled_for() is not None
      if stalled and not self.stalled:
        self.metrics.stalls.inc()
        print(f"pasta serve: the engine made no progress for {self.cfg.stall_s:g} s with work to do",
              file=sys.stderr, flush=True)
      self.stalled = stalled
      time.sleep(min(1.0, self.cfg.stall_s / 4))

  # --- the engine thread --------------------------------------------------------------------------------
  def _supervise(self) -> None:
    """Runs the loop; a failure outside any one batch fails every request in flight, and the loop starts afresh
    (after `max_restarts` failures in a row the engine gives up: `error`, /health "failed")."""
    failures, turns = 0, self.turns
    while True:
      try:
        self._run()
        return
      except Exception as err:  # a device or program error outside a batch's own work
        failures = 1 if self.turns > turns + 1 else failures + 1  # in a row: no whole turn ran since the last
        turns = self.turns
        self.last_failure = f"engine loop: {err!r}"
        self.metrics.restarts.inc()
        self._end_everyone(Update("", True, "error", note=f"server error: {err}", status=500), "error")
        if failures > self.cfg.max_restarts:
          self.error = err
          return

  def _end_everyone(self, update: Update, outcome: str) -> None:
    with self.lock:
      waiting, self.waiting = list(self.waiting), collections.deque()
      held = [r for b in self.batches.values() for r in b.holders.values()]
      self.batches.clear()
    for request in waiting + held:
      with contextlib.suppress(Exception):
        request.sink(update)
      self.metrics.finished.labels(request.label, outcome).inc()

  def _run(self) -> None:
    while True:
      self.turn_at = time.perf_counter()
      self.xla_compiling = False  # (a lowering that was never compiled does not hold it up past its turn)
      self.turns += 1
      with self.lock:
        if not self.waiting and not self.running and not self.stopping:
          self.lock.wait(timeout=0.5)
        idle = not self.running and not self.waiting
        if self.stopping and (idle or time.perf_counter() > self.drain_deadline):
          break
      self.programs.check()
      self._let_burst_arrive()
      self._admit_waiting()
      for i, key in enumerate(list(self.batches)):
        if i:  # between batches too: a newcomer waits for one batch's chunk, not for a whole turn of them
          self._admit_waiting()
        entry = self.batches.get(key)
        if entry is not None and entry.holders:
          self._guarded(entry, batches.run_chunk, entry, self.cfg, self.lang, self.metrics, bool(self.waiting))
    self._end_everyone(Update("", True, "length", note="cut: the server shut down"), "shutdown")

  def _guarded(self, entry: MethodBatch, work, *args) -> bool:
    """Runs a batch's `work`; if it raises, that batch's requests fail and the batch is dropped. True: it ran."""
    try:
      work(*args)
      return True
    except Exception as err:
      self._fail_batch(entry, err)
      return False

  def _fail_batch(self, entry: MethodBatch, err: Exception) -> None:
    """Ends every request of a batch that failed with a 500, drops the batch (its state may be half written), and
    counts it; the other batches serve on."""
    with self.lock:
      if self.batches.get(entry.key) is entry:
        del self.batches[entry.key]
      held = list(entry.holders.values())
      entry.holders.clear()
    self.last_failure = f"{entry.key.method.name} batch: {err!r}"
    self.metrics.engine_failures.labels(entry.key.method.name).inc()
    print(f"pasta serve: the {entry.key.method.name} batch failed ({err!r}); its {len(held)} requests end with "
          "an error, the engine serves on", file=sys.stderr, flush=True)
    for request in held:
      with contextlib.suppress(Exception):
        request.sink(Update("", True, "error", note=f"server error in this request's batch: {err!r}", status=500))
      self.metrics.finished.labels(request.label, "error").inc()
    self.metrics.running.set(self.running)

  def _dropped_programs(self, used: int, limit: int) -> None:
    self.metrics.program_drops.inc()
    programs.log_drop(used, limit)

  def batch_key(self, request: Request) -> BatchKey:
    return batches.batch_key(request.method, request.sampling, self.cfg.certify_head)

  def _let_burst_arrive(self) -> None:
    """Waits while requests are still arriving (one came less than `admit_quiet_s` ago), at most until the oldest
    waiting one has waited `admit_wait_s`, so that a burst is admitted in one prefill, not in parts."""
    with self.lock:
      while self.waiting and not self.stopping:
        now = time.perf_counter()
        arrived = [r.queued_at for r in self.waiting if r.queued_at is not None]
        if not arrived:
          return
        quiet_in = max(arrived) + self.cfg.admit_quiet_s - now
        limit_in = min(arrived) + self.cfg.admit_wait_s - now
        if quiet_in <= 0 or limit_in <= 0:
          return
        self.lock.wait(timeout=min(quiet_in, limit_in))

  def _admit_waiting(self) -> None:
    with self.lock:
      waiting = [r for r in self.waiting if not r.dropped]
      for request in self.waiting:
        if request.dropped:
          self.metrics.finished.labels(request.label, "cancelled").inc()
      waiting = [self._skeleton_stage(r) if r.method.capabilities.needs_scripts and r.stage_of is None else r
                 for r in waiting]
      self.waiting = collections.deque(waiting)
    groups: dict[BatchKey, list[Request]] = collections.defaultdict(list)
    entries: dict[BatchKey, MethodBatch] = {}
    for request in waiting:
      key = self.batch_key(request)
      try:
        entry = entries.get(key) or self._batch_for(key, keep=entries.keys())
      except Exception as err:  # this method cannot run here (no Medusa heads, no n-gram index, a failed compile)
        self._refuse(request, err)
        continue
      if entry is not None and len(groups[key]) < len(entry.rows.free_rows()):
        entries[key] = entry
        groups[key].append(request)
    for key, entry in entries.items():
      self._admit(entry, groups[key])
    self.metrics.queue.set(len(self.waiting))
    self.metrics.running.set(self.running)

  def _admit(self, entry: MethodBatch, requests: list[Request]) -> None:
    """Prefills `requests` into the batch's free rows (each with its own sampling); a failure fails the batch."""
    requests, budgets = self._budgets(entry, requests)
    if not requests:
      return
    with self.lock:
      for request in requests:
        self.waiting.remove(request)
    scripts = [r.scripts for r in requests] if entry.rows.script_len else None
    entry.holders.update({-1 - i: r for i, r in enumerate(requests)})  # held (for a failure) until rows are known
    def admit():
      rows = entry.rows.admit([r.ids for r in requests], budgets, scripts, [r.sampling for r in requests])
      for i in range(len(requests)):
        del entry.holders[-1 - i]
      entry.holders.update(zip(rows, requests, strict=True))
    if self._guarded(entry, admit):
      entry.fresh = True

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

  def _refuse(self, request: Request, err: Exception) -> None:
    """Ends a queued request that cannot run, with the reason (a 400 for what the request asked, else a 500)."""
    with self.lock:
      self.waiting.remove(request)
    status = 400 if isinstance(err, PastaError) else 500
    request.sink(Update("", True, "error", note=f"not served: {err}", status=status))
    self.metrics.finished.labels(request.label, "error").inc()

  def _batch_for(self, key: BatchKey, keep=()) -> MethodBatch | None:
    """The batch of `key`, created when needed (an idle one not in `keep` evicted to make room); None: wait."""
    with self.lock:
      if key in self.batches:
        self.batches.move_to_end(key)
        return self.batches[key]
      if len(self.batches) >= self.cfg.max_batches:
        idle = next((k for k, b in self.batches.items() if not b.holders and k not in keep), None)
        if idle is None:
          return None
        del self.batches[idle]
    staged = key.method.capabilities.needs_scripts
    ahead = key.method in self.compile_ahead
    self.compiling = True  # a new batch compiles for minutes on a busy CPU: the watchdog allows it COMPILE_S
    try:
      entry = batches.open_batch(self.model, self.cfg, key, fan_out=self.sot_fan_out if staged else 0,
                                 compile_buckets=self.prompt_buckets if ahead else None)
    finally:
      self.compiling = False
      self.turn_at = time.perf_counter()  # compiling was progress: the rest of this turn is not a stall
    with self.lock:
      self.batches[key] = entry
    return entry

  def certifies(self, method: Method | str, sampling) -> bool:
    """Whether a request of (method, sampling) chooses through the certified head (`ServeConfig.certify_head`)."""
    method = self.method_named(method) if isinstance(method, str) else method
    return batches.batch_key(method, sampling, self.cfg.certify_head).certified


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_LOWERED_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # a lowering done: XLA's compile comes next
_TRACED_EVENT = "/jax/core/compile/jaxpr_trace_duration"
# What the one compile listener serves (JAX's listeners cannot be removed, so it is registered once per process):
_COUNTED: list[ServeMetrics] = []  # the metrics that count this process's XLA compiles (the newest engine's)
_ENGINES: dict[str, Engine] = {}  # engine thread name -> its engine, whose thread's compiles are progress
_LISTENING: list = []  # the listener, once registered


def _count_compiles(metrics: ServeMetrics) -> None:
  """Counts every XLA program this process compiles into `metrics.compiled` (the newest engine's metrics)."""
  _listen_once()
  _COUNTED[:] = [metrics]


def _track_compiles(thread_name: str, engine: Engine) -> None:
  """Marks `engine.xla_compiling` while its thread (`thread_name`) compiles a program (after the lowering, until
  the compile ends) and stamps `engine.compiled_at` at each step of a compile, so that the watchdog reads a long
  compile as progress wherever it happens (JAX's listeners run in the thread that compiles)."""
  _listen_once()
  _ENGINES[thread_name] = engine


def _listen_once() -> None:
  if not _LISTENING:
    jax.monitoring.register_event_duration_secs_listener(_on_compile_event)
    _LISTENING.append(_on_compile_event)


def _on_compile_event(event: str, _seconds: float, **_) -> None:
  if event == _COMPILE_EVENT and _COUNTED:
    _COUNTED[-1].compiled.inc()
  if event in (_TRACED_EVENT, _LOWERED_EVENT, _COMPILE_EVENT) and (
      engine := _ENGINES.get(threading.current_thread().name)):
    engine.compiled_at = time.perf_counter()
    engine.xla_compiling = event == _LOWERED_EVENT
