"""The server's Prometheus metrics (`/metrics`), on a registry of its own."""

from __future__ import annotations

import collections
import threading
import time

import prometheus_client as prom

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServeMetrics:
  """Queue length, running requests, tokens, time to first token, chunk times, outcomes per method."""

  def __init__(self, window_s: float = 10.0):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.queue = prom.Gauge("pasta_queue_length", "requests waiting for a batch row", registry=r)
    self.running = prom.Gauge("pasta_running_requests", "requests holding a batch row", registry=r)
    self.tokens = prom.Counter("pasta_tokens", "content tokens written", ["method"], registry=r)
    self.finished = prom.Counter("pasta_requests", "requests that ended, by method and outcome "
                                 "(stop, length, cancelled, shutdown, error)", ["method", "outcome"], registry=r)
    self.rejected = prom.Counter("pasta_rejected", "requests refused before queueing, by reason", ["reason"],
                                 registry=r)
    self.ttft = prom.Histogram("pasta_time_to_first_token_seconds", "arrival to first streamed text",
                               buckets=LATENCY_BUCKETS, registry=r)
    self.latency = prom.Histogram("pasta_request_seconds", "arrival to the end of the answer",
                                  buckets=LATENCY_BUCKETS, registry=r)
    self.chunk_seconds = prom.Histogram("pasta_chunk_seconds", "one device chunk and its host visit",
                                        buckets=LATENCY_BUCKETS, registry=r)
    self.chunks = prom.Counter("pasta_chunks", "device chunks run, by length: short (after an admission, or cut to "
                               "--chunk-seconds) or full (--chunk steps)", ["length"], registry=r)
    self.propd_latency = prom.Gauge("pasta_propd_step_seconds", "ProPD's fitted step time T(s) = alpha s + beta "
                                    "per rows bucket, measured online", ["rows", "coefficient"], registry=r)
    self.stream_seams = prom.Counter("pasta_stream_seams", "answers whose final text did not extend the "
                                     "streamed text (the rest was not streamed)", registry=r)
    self.program_drops = prom.Counter("pasta_compiled_program_drops", "times the server dropped every compiled "
                                      "program to stay under the memory-map limit (serve/programs.py)", registry=r)
    self.compiled = prom.Counter("pasta_compiled_programs", "XLA programs this process compiled since start-up "
                                 "(decode chunks, admissions: a new sampling setting must not add any)", registry=r)
    self.decode_programs = prom.Gauge("pasta_decode_programs", "batch decode programs held compiled (chunks per "
                                      "rows prefix, admissions per group size and prompt bucket): sampling "
                                      "settings add none", registry=r)
    self.engine_failures = prom.Counter("pasta_engine_failures", "chunks that raised: their batch's requests "
                                        "failed with an error and the batch was dropped; the engine served on",
                                        ["method"], registry=r)
    self.restarts = prom.Counter("pasta_engine_restarts", "failures of the engine's loop outside a batch: every "
                                 "request in flight failed and the loop started afresh", registry=r)
    self.stalls = prom.Counter("pasta_engine_stalls", "times the watchdog saw rows to run and no chunk finish for "
                               "the stall limit", registry=r)
    prom.Gauge("pasta_tokens_per_second", f"content tokens per second over the last {window_s:g} s",
               registry=r).set_function(self._rate)
    self.window_s, self._marks, self._lock = window_s, collections.deque(), threading.Lock()

  def _rate(self) -> float:
    total = sum(s.value for m in self.tokens.collect() for s in m.samples if s.name == "pasta_tokens_total")
    now = time.perf_counter()
    with self._lock:
      self._marks.append((now, total))
      while len(self._marks) > 1 and now - self._marks[0][0] > self.window_s:
        self._marks.popleft()
      (t0, n0) = self._marks[0]
    return (total - n0) / (now - t0) if now > t0 else 0.0

  def text(self) -> bytes:
    return prom.generate_latest(self.registry)
