"""Load test of `pasta serve` on the shipped default model under a mixed load, loopback only, bounded.

Starts `pasta serve` as a subprocess on 127.0.0.1 (`--batch` rows, chunk `--chunk`) and, in one run:

1. Warm-up (not measured): every wave below once, with the same prompts and methods, so every prompt and
   admission shape is compiled; the mixed wave's sampled clients send one shared sampling setting of the same
   kind (temperature, top_p, top_k, seed, repetition penalty) as theirs.
2. Greedy levels (`--levels`, default 1,16): N streaming clients, one request each, the N first prompts, all
   with `--ratio-method`, the model's generation.json sampling (the server's default for unset fields).
   Throughput (content tokens / s over the wave), time to first streamed text (p50, p99), event gaps.
3. The mixed wave: `--clients` (64) streaming clients, each with its own sampling: a third greedy (some sending
   their own repetition penalty), the others temperature 0.3..1.0 with top_p 0.8..1.0, distinct values, some
   with top_k, each with its own seed; the methods (`--methods`) taking turns. Interleaved with them, on the
   same clients: malformed requests (bad JSON, wrong types such as "max_tokens": "7", an oversize body, unknown
   fields, ...) and streams closed after their first few events.
4. After the load: the server alive (`/health` 200, no rows left running, one more plain request answered);
   decode programs the server compiled under the load (its `pasta_decode_programs`, the batch chunk and
   admission programs it holds, after the mixed wave less after warm-up: new sampling settings should compile
   none); its memory (peak VmHWM, and resident memory
   after the load against after warm-up).
5. The server stopped: every greedy answer compared with `pasta_jax.generate` of its prompt alone, with the same
   method and the sampling the server applies to that request (its `request_sampling`: unset fields take the
   model's generation.json, e.g. repetition penalty 1.1 on the shipped default): one that differs is "mixed up".
   Then the device's own ceiling: plain batched `generate` of the greedy level's prompts in one batch (content
   tokens / s, warm), same method and sampling.

`--check-sampled`: the sampled answers that name their seed are compared the same way, with that seed (the
server folds in each row's seed and its own steps since admission, as `generate` does for a request alone).

Lost: a well-formed request (not closed on purpose) without a final event with a finish_reason (or with
finish_reason "error", or an HTTP error), and a malformed one not answered with a 4xx and a JSON error body.

  python -m bench.serve [--clients 64] [--levels 1,16] [--methods pasta,sequential] [--max-tokens 64]
                        [--out docs/results/serve_mixed_cpu.txt]
Last line: RESULT ceiling_ratio_16=... ttft_p99_s=... lost=... mixed_up=... programs=... alive=... peak_mib=...
           rss_growth_mib=... ttft_p99_mixed_s=...
The report (date, machine, command, the figures) goes to WORKDIR/report.txt and `--out`; the server's log and
last metrics, the lost requests and the differing texts to `--workdir` (server.log, metrics.txt, report.json).
ceiling_ratio_16: server tokens/s at the 16-client greedy level (the largest level when 16 is not one) over
  batched `generate` of the same prompts; ttft_p99_s: that level's time to first text, p99.
`--ceiling-only`: no server; the ceiling with the float32 head and with the certified head, side by side:
  RESULT ceiling_16_over_1=... ceiling_certified_16_over_1=... certified_over_float32_batched=... same_answers=...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

PROGRAMS_METRIC = "pasta_decode_programs"
PLAIN_PROMPT = "Name three primary colors."


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Served:
  """The running server: its address, its process, and the highest peak resident memory read so far (a server
  that dies takes its /proc entry with it)."""

  url: str
  proc: subprocess.Popen
  peak_mib: float = float("nan")

  def alive(self) -> bool:
    return self.proc.poll() is None

  def memory(self, key: str = "VmRSS") -> float:
    """A /proc/PID/status memory line in MiB ("VmRSS": resident now); reads the peak (VmHWM) as well."""
    peak = memory_mib(self.proc.pid, "VmHWM")
    self.peak_mib = max(self.peak_mib, peak) if self.peak_mib == self.peak_mib else peak
    return memory_mib(self.proc.pid, key)


@contextlib.contextmanager
def server(args, methods: list[str], log: Path):
  """`pasta serve` as a subprocess on a free loopback port, its `methods` compiled before it listens; yields a
  `Served`; SIGTERM at the end."""
  port = free_port()
  cmd = [sys.executable, "-m", "pasta_jax.cli", "serve", "--port", str(port), "--batch", str(args.batch),
         "--chunk", str(args.chunk), "--max-tokens", str(args.max_tokens), "--max-queue", "256",
         "--pool", str(args.pool), "--warmup", ",".join(methods), "--lanes", str(args.lanes)]
  cmd += ["--certify-head"] if args.certify_head else []
  cmd += ["--chunk-seconds", str(args.chunk_seconds)] if args.chunk_seconds is not None else []
  proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.time() + args.start_timeout
    while True:
      if proc.poll() is not None:
        raise SystemExit(f"pasta serve exited ({proc.returncode}); see {log}")
      if time.time() > deadline:
        raise SystemExit(f"pasta serve did not start in {args.start_timeout} s; see {log}")
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      time.sleep(1)
    yield Served(url, proc)
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()


def memory_mib(pid: int, key: str) -> float:
  """A /proc/PID/status memory line in MiB: "VmHWM" (peak resident) or "VmRSS" (resident now)."""
  with contextlib.suppress(OSError):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith(key + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


def compiled_programs(url: str) -> float | None:
  """The server's count of decode programs it holds compiled (its /metrics), or None when it has none (or does not
  answer)."""
  try:
    text = httpx.get(f"{url}/metrics", timeout=30).text
  except httpx.HTTPError:
    return None
  found = re.findall(rf"^{PROGRAMS_METRIC}(?:{{[^}}]*}})?\s+(\S+)$", text, flags=re.M)
  return sum(float(v) for v in found) if found else None


def health(url: str) -> tuple[int, dict]:
  try:
    reply = httpx.get(f"{url}/health", timeout=30)
  except httpx.HTTPError as err:
    return 0, {"error": repr(err)}
  with contextlib.suppress(ValueError):
    return reply.status_code, reply.json()
  return reply.status_code, {}


# --- what the clients send -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
  """One request: "ok" (streamed to its end), "drop" (closed after a few events) or "bad" (malformed: `raw` is
  the body sent as it is)."""

  kind: str
  client: int
  method: str = ""
  prompt: str = ""
  payload: dict | None = None
  raw: bytes = b""
  label: str = ""  # a malformed body's kind


def chat_payload(prompt: str, method: str, max_tokens: int, sampling: dict | None = None, stream: bool = True) -> dict:
  body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream,
          "method": method}
  if stream:
    body["stream_options"] = {"include_usage": True}
  return {**body, **(sampling or {})}


def client_sampling(i: int, clients: int, extras: bool, warm: bool) -> dict:
  """Client i's sampling fields: a third greedy (every other one of them with its own repetition penalty), the
  others temperature 0.3..1.0, every client its own top_p in 0.8..1.0; with `extras`, sampled clients send a seed
  and one in four a top_k. `warm`: the same fields with one shared value each (the warm-up's)."""
  fields = {"top_p": 0.95 if warm else round(0.8 + 0.2 * i / max(1, clients - 1), 4)}
  sampled = [j for j in range(clients) if j % 3]
  if i % 3 == 0:  # greedy
    fields["temperature"] = 0.0
    if extras and (i // 3) % 2:
      fields["repetition_penalty"] = 1.1 if warm else round(1.0 + 0.05 * ((i // 6) % 5), 4)
    return fields
  k = sampled.index(i)
  fields["temperature"] = 0.7 if warm else round(0.3 + 0.7 * k / max(1, len(sampled) - 1), 4)
  if extras:
    fields["seed"] = 7 if warm else 1000 + i
    if k % 4 == 0:
      fields["top_k"] = 40 if warm else 20 + k
  return fields


def malformed_bodies(prompt: str, max_tokens: int, oversize_mib: float) -> list[tuple[str, bytes]]:
  """Request bodies a server must refuse with a 4xx and a JSON error body, each with its kind."""
  good = chat_payload(prompt, "sequential", max_tokens, stream=False)
  def dump(body) -> bytes:
    return json.dumps(body).encode()
  big = "word " * int(oversize_mib * 2**20 / 5)
  return [("bad_json", b'{"messages": [{"role": "user", "content": "hi"}'),
          ("max_tokens_string", dump({**good, "max_tokens": "7"})),
          ("unknown_field", dump({**good, "frobnicate": True})),
          ("oversize", dump({**good, "messages": [{"role": "user", "content": big}]})),
          ("temperature_string", dump({**good, "temperature": "0.5"})),
          ("not_an_object", b"[1, 2, 3]"),
          ("messages_string", dump({**good, "messages": prompt})),
          ("stream_string", dump({**good, "stream": "yes"}))]


def mixed_plan(args, prompts: list[str], methods: list[str], sampling_ok: set[str], warm: bool) -> list[list[Job]]:
  """Each client's jobs in the mixed wave: its own streaming request; some clients also send a malformed body
  or open a stream they close early, before or after their own request (interleaved with the running load).
  `warm`: the warm-up's version: the same requests with the warm-up's sampling, the closed-early ones streamed to
  their end (their prompts' shapes compiled too), no malformed ones."""
  n = args.clients
  plan: list[list[Job]] = [[] for _ in range(n)]
  for i in range(n):
    method = methods[i % len(methods)]
    sampling = client_sampling(i, n, not args.openai_only, warm)
    if method not in sampling_ok:  # a method that does not sample (a search of its own) takes the greedy fields
      sampling = {k: v for k, v in sampling.items() if k in ("top_p", "repetition_penalty")} | {"temperature": 0.0}
    plan[i].append(Job("ok", i, method, prompts[i], chat_payload(prompts[i], method, args.max_tokens, sampling)))
  if not warm:
    bad = malformed_bodies(prompts[0], args.max_tokens, args.oversize_mib)
    for j in range(args.malformed):
      i = (j * n) // max(1, args.malformed)
      label, raw = bad[j % len(bad)]
      plan[i].insert(len(plan[i]) if j % 2 else 0, Job("bad", i, raw=raw, label=label))  # before or after its own
  for j in range(args.disconnects):
    i = min(n - 1, (j * n) // max(1, args.disconnects) + 1)
    prompt, method = prompts[(n + j) % len(prompts)], methods[j % len(methods)]
    job = Job("ok" if warm else "drop", i, method, prompt, chat_payload(prompt, method, args.max_tokens))
    plan[i].insert(0 if j % 2 else len(plan[i]), job)
  return plan


# --- the clients --------------------------------------------------------------------------------------------------

async def stream_request(http: httpx.AsyncClient, url: str, job: Job, close_after: int = 0) -> dict:
  """Streams one chat completion; returns its text, timings and outcome. `close_after` > 0: closes the stream
  after that many events (a client that goes away)."""
  out = {"kind": job.kind, "client": job.client, "method": job.method, "prompt": job.prompt, "payload": job.payload,
         "greedy": job.payload.get("temperature", 0.0) == 0.0}
  start = time.perf_counter()
  events, text, finish, usage, seen = [], [], None, None, 0
  try:
    async with http.stream("POST", f"{url}/v1/chat/completions", json=job.payload) as reply:
      if reply.status_code != 200:
        await reply.aread()
        return {**out, "lost": True, "why": f"HTTP {reply.status_code}: {reply.text[:200]}"}
      async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        seen += 1
        data = json.loads(line[6:])
        if data.get("usage"):
          usage = data["usage"]
        for choice in data.get("choices", []):
          piece = (choice.get("delta") or {}).get("content") or ""
          if piece:
            events.append(time.perf_counter() - start)
            text.append(piece)
          finish = choice.get("finish_reason") or finish
        if close_after and seen >= close_after:
          return {**out, "lost": False, "why": "", "closed_after": seen, "text": "".join(text), "events": events}
  except (httpx.HTTPError, json.JSONDecodeError) as err:
    return {**out, "lost": True, "why": repr(err)}
  bad_end = finish is None or finish == "error"
  return {**out, "lost": bad_end, "why": f"finish_reason {finish}" if bad_end else "", "text": "".join(text),
          "events": events, "seconds": time.perf_counter() - start,
          "tokens": usage["completion_tokens"] if usage else 0, "finish": finish}


async def bad_request(http: httpx.AsyncClient, url: str, job: Job) -> dict:
  """Sends a malformed body; it is answered right when the status is a 4xx with a JSON error body."""
  out = {"kind": "bad", "client": job.client, "label": job.label, "bytes": len(job.raw)}
  try:
    reply = await http.post(f"{url}/v1/chat/completions", content=job.raw,
                            headers={"content-type": "application/json"})
  except httpx.HTTPError as err:  # e.g. the server closed the connection while the body was still being sent
    return {**out, "lost": True, "status": None, "why": f"no reply, the connection failed: {err!r}"}
  try:
    error = reply.json().get("error")
  except (ValueError, AttributeError):
    error = None
  right = 400 <= reply.status_code < 500 and isinstance(error, dict) and bool(error.get("message"))
  why = "" if right else f"HTTP {reply.status_code}: {reply.text[:200]}"
  return {**out, "lost": not right, "status": reply.status_code, "why": why}


def unanswered(job: Job, why: str) -> dict:
  """The record of a job that never got its answer (the server died, or the wave was stopped)."""
  if job.kind == "bad":
    return {"kind": "bad", "client": job.client, "label": job.label, "bytes": len(job.raw), "lost": True,
            "status": None, "why": why}
  return {"kind": job.kind, "client": job.client, "method": job.method, "prompt": job.prompt, "payload": job.payload,
          "greedy": job.payload.get("temperature", 0.0) == 0.0, "lost": job.kind == "ok", "why": why}


async def run_clients(srv: Served, plan: list[list[Job]], bar, close_after: int,
                      timeout_s: float) -> tuple[list[dict], float]:
  """Every client at once, each running its jobs in order; returns every answer and the wall time. Should the
  server process end, the wave stops: the jobs left are lost."""
  out: list[dict] = []
  done: set[int] = set()
  limits = httpx.Limits(max_connections=len(plan) + 8, max_keepalive_connections=len(plan) + 8)
  async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
    async def client(jobs: list[Job]):
      for job in jobs:
        if job.kind == "bad":
          out.append(await bad_request(http, srv.url, job))
        else:
          out.append(await stream_request(http, srv.url, job, close_after if job.kind == "drop" else 0))
        done.add(id(job))
        bar.update(1)

    async def watch():
      while srv.alive():
        await asyncio.sleep(1)

    start = time.perf_counter()
    clients = asyncio.gather(*(client(jobs) for jobs in plan))
    watcher = asyncio.ensure_future(watch())
    await asyncio.wait([clients, watcher], return_when=asyncio.FIRST_COMPLETED)
    seconds = time.perf_counter() - start
    for task in (clients, watcher):
      task.cancel()
    await asyncio.gather(clients, watcher, return_exceptions=True)
  why = f"the server exited ({srv.proc.returncode})"
  out += [unanswered(job, why) for jobs in plan for job in jobs if id(job) not in done]
  return out, seconds


def wave(srv: Served, plan: list[list[Job]], desc: str, args) -> tuple[list[dict], float]:
  with tqdm(total=sum(len(j) for j in plan), desc=desc, unit="req") as bar:
    got = asyncio.run(run_clients(srv, plan, bar, args.close_after, args.timeout))
  srv.memory()  # keeps the peak while the process is there to read
  return got


def pct(values, q: float) -> float:
  """The q-th percentile, linear between the nearest ranks (numpy's default); nan for none."""
  values = sorted(values)
  if not values:
    return float("nan")
  at = (len(values) - 1) * q / 100
  low = int(at)
  high = min(low + 1, len(values) - 1)
  return values[low] + (values[high] - values[low]) * (at - low)


def level_report(clients: int, answers: list[dict], seconds: float) -> dict:
  """A wave's figures over its streamed-to-the-end requests."""
  mine = [a for a in answers if a["kind"] == "ok"]
  ok = [a for a in mine if not a["lost"]]
  ttft = [a["events"][0] for a in ok if a["events"]]
  gaps = [b - a for x in ok for a, b in zip(x["events"], x["events"][1:])]
  tokens = sum(a["tokens"] for a in ok)
  return {"clients": clients, "requests": len(mine), "lost": len(mine) - len(ok), "tokens": tokens,
          "seconds": seconds, "throughput": tokens / seconds, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
          "gap_p50": pct(gaps, 50), "gap_p99": pct(gaps, 99)}


def drain(srv: Served, wait_s: float) -> tuple[int, int]:
  """Waits up to `wait_s` for the server to have no row running or queued; returns /health's status and the rows
  left running or queued."""
  deadline, status, state = time.time() + wait_s, 0, {}
  while time.time() < deadline and srv.alive():
    status, state = health(srv.url)
    if status == 200 and not state.get("running") and not state.get("queued"):
      break
    time.sleep(1)
  return status, int(state.get("running") or 0) + int(state.get("queued") or 0)


def plain_request(url: str) -> tuple[bool, str]:
  """One more plain (whole, greedy, short) request: answered with a finish_reason, or why not."""
  try:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                       json=chat_payload(PLAIN_PROMPT, "sequential", 8, stream=False))
    if reply.status_code == 200 and reply.json()["choices"][0].get("finish_reason"):
      return True, ""
    return False, f"HTTP {reply.status_code}: {reply.text[:200]}"
  except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
    return False, repr(err)


# --- the references, with the server stopped ---------------------------------------------------------------------

def served_method(name: str, lanes: int):
  """The method value `pasta serve --lanes LANES` serves as `name`: its defaults, with `lanes` where it has lanes
  (the server's option flags set that option of every method that has it)."""
  from pasta_jax.methods import resolve
  method = resolve(name)
  has_lanes = any(f.name == "lanes" for f in method.options())
  return dataclasses.replace(method, lanes=lanes) if has_lanes else method


class Sampling:
  """The sampling the server applies to a request body: its own parser and `request_sampling`, over the model's
  generation.json defaults (a field the request leaves unset takes the model's value)."""

  def __init__(self, model):
    from pasta_jax.model.load import generation_defaults
    from pasta_jax.serve import app, protocol
    self.app, self.protocol = app, protocol
    self.defaults = generation_defaults(model)

  def __call__(self, payload: dict):
    body = self.protocol.parse_body(self.protocol.ChatBody, payload, self.defaults.get("method", "pasta"))
    return self.app.request_sampling(body, self.defaults)


def reference_text(model, prompt: str, method, max_tokens: int, sampling) -> str:
  """What the server must answer, greedy: `generate` alone of the served `method` (a method value) with the
  server's `sampling`; ProPD's is plain greedy decoding's (lossless); SoT's is `SkeletonOfThought.run` with the
  server's budgets and lanes."""
  from pasta_jax.baselines.sot import SkeletonOfThought, SotConfig
  from pasta_jax.methods import Propd, Sequential, Sot, generate
  if isinstance(method, Sot):
    config = SotConfig(point_tokens=max_tokens, answer_tokens=max_tokens, lanes=method.lanes)
    return SkeletonOfThought(model, config).run(prompt).text
  method = Sequential() if isinstance(method, Propd) else method
  return generate(model, [prompt], method, max_new_tokens=max_tokens, sampling=sampling)[0].text


def check_answers(model, answers: list[dict], lanes: int, sampling_of: Sampling,
                  sampled: bool = False) -> tuple[list[dict], collections.Counter]:
  """Every greedy answer streamed to its end (with `sampled`, every sampled one that names its seed too) against
  its reference alone (`reference_text`, with the sampling and seed the server applied); returns those that differ
  (mixed up), each with its method, sampling, prompt, text and reference, and how many were checked, greedy and
  sampled."""
  refs, mixed = {}, []
  checked = [a for a in answers if a["kind"] == "ok" and not a["lost"]
             and (a["greedy"] or (sampled and a["payload"].get("seed") is not None))]
  for a in tqdm(checked, desc="references alone", unit="answer"):
    sampling = sampling_of(a["payload"])
    key = (a["prompt"], a["method"], sampling, a["payload"]["max_tokens"])
    if key not in refs:
      refs[key] = reference_text(model, a["prompt"], served_method(a["method"], lanes), a["payload"]["max_tokens"],
                                 sampling)
    if a["text"] != refs[key]:
      mixed.append({"greedy": a["greedy"], "method": a["method"], "sampling": repr(sampling), "prompt": a["prompt"],
                    "text": a["text"], "reference": refs[key]})
  return mixed, collections.Counter("greedy" if a["greedy"] else "sampled" for a in checked)


def batched_run(model, prompts: list[str], method, max_tokens: int, sampling, certify_head: bool = False,
                texts: list | None = None) -> tuple[int, float]:
  """Content tokens and seconds of plain `generate` of `prompts` in one batch, its second (warm) call. The answers'
  texts are appended to `texts` when given."""
  from pasta_jax.decode.runtime import Runtime
  from pasta_jax.methods import generate
  runtime = Runtime(certify_head=certify_head and method.capabilities.certify_head)
  kw = dict(max_new_tokens=max_tokens, sampling=sampling, runtime=runtime)
  generate(model, prompts, method, **kw)  # compiles its shapes
  start = time.perf_counter()
  results = generate(model, prompts, method, **kw)
  seconds = time.perf_counter() - start
  if texts is not None:
    texts.extend(r.text for r in results)
  return sum(r.content_tokens for r in results), seconds


def ceiling_only(args, prompts: list[str]) -> None:
  """The device's batching ceiling (plain greedy sequential `generate`, `--ceiling` prompts in one batch against
  the same prompts one at a time, each warm) with the float32 head and with the certified head, side by side."""
  from pasta_jax.decode.sampling import SamplingConfig
  from pasta_jax.methods import Sequential
  from pasta_jax.model.load import load_model
  model, rows, texts, greedy = load_model(None), {}, {}, SamplingConfig()
  batch = prompts[:args.ceiling]
  for certify in (False, True):
    texts[certify] = []
    tokens, seconds = batched_run(model, batch, Sequential(), args.max_tokens, greedy, certify, texts[certify])
    together = tokens / seconds
    alone = [batched_run(model, [prompt], Sequential(), args.max_tokens, greedy, certify) for prompt in batch]
    one = sum(t for t, _ in alone) / sum(s for _, s in alone)
    rows[certify] = together, one
    print(f"{'certified' if certify else 'float32'} head: {len(batch)} prompts in one batch {together:.1f} tok/s, "
          f"one at a time {one:.1f} tok/s ({together / one:.2f}x)", flush=True)
  same = sum(a == b for a, b in zip(texts[False], texts[True], strict=True))
  print(f"batched answers identical between the heads: {same} of {len(texts[False])}")
  (float32_batched, float32_alone), (certified_batched, _) = rows[False], rows[True]
  print(f"RESULT ceiling_16_over_1={float32_batched / float32_alone:.2f} "
        f"ceiling_certified_16_over_1={certified_batched / float32_alone:.2f} "
        f"certified_over_float32_batched={certified_batched / float32_batched:.2f} same_answers={same}")


# --- the run --------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", default="alpaca_eval_805", help="instructions to send (a shared data name or JSONL)")
  parser.add_argument("--clients", type=int, default=64, help="streaming clients of the mixed wave")
  parser.add_argument("--levels", default="1,16",
                      help="greedy streaming clients per level (one request each); the RESULT's ratio and TTFT are "
                           "16's (else the largest level's)")
  parser.add_argument("--methods", default="pasta,sequential",
                      help="methods the mixed wave's requests take in turn (pasta, sequential, apar, pasta-v0, "
                           "medusa, propd, sot)")
  parser.add_argument("--ratio-method", default=None,
                      help="the greedy levels' method, and the ceiling's (default: the first of --methods)")
  parser.add_argument("--max-tokens", type=int, default=64, help="each request's max_tokens")
  parser.add_argument("--malformed", type=int, default=16, help="malformed requests in the mixed wave")
  parser.add_argument("--disconnects", type=int, default=8, help="streams closed early in the mixed wave")
  parser.add_argument("--close-after", type=int, default=3, help="events a closed-early stream reads")
  parser.add_argument("--oversize-mib", type=float, default=2.0,
                      help="size of the oversize malformed body (the server's default limit: 1 MiB)")
  parser.add_argument("--openai-only", action="store_true",
                      help="the mixed wave's clients send only OpenAI's temperature and top_p (no seed, top_k or "
                           "repetition_penalty)")
  parser.add_argument("--check-sampled", action="store_true",
                      help="also compare every sampled answer that names its seed with generate alone with the same "
                           "sampling and seed (the server folds in the seed and the row's own steps, as generate "
                           "does for a request alone)")
  parser.add_argument("--max-growth-mib", type=float, default=256.0,
                      help="resident memory growth over the load taken as bounded")
  parser.add_argument("--batch", type=int, default=16, help="the server's rows per method batch")
  parser.add_argument("--chunk", type=int, default=8)
  parser.add_argument("--chunk-seconds", type=float, default=None, help="the server's --chunk-seconds (default: its)")
  parser.add_argument("--pool", type=int, default=512)
  parser.add_argument("--lanes", type=int, default=8, help="PASTA / APAR lanes, SoT's fan-out")
  parser.add_argument("--certify-head", action="store_true",
                      help="the server and the ceiling choose greedy tokens through the certified head (the same "
                           "answers: the mixed-up check compares with float32 generate)")
  parser.add_argument("--start-timeout", type=float, default=900)
  parser.add_argument("--timeout", type=float, default=600, help="seconds a request may take (read timeout)")
  parser.add_argument("--drain-timeout", type=float, default=60,
                      help="seconds the server gets after the load to finish every row before it is read")
  parser.add_argument("--ceiling", type=int, default=16, help="--ceiling-only: prompts in the batch")
  parser.add_argument("--ceiling-only", action="store_true",
                      help="no server: the batching ceiling with the float32 and the certified head, side by side")
  parser.add_argument("--workdir", default="runs/bench_serve", help="server log, metrics and report.json")
  parser.add_argument("--out", default=None, help="also write the human-readable report here")
  return parser.parse_args(argv)


def under_load(args, srv: Served, level_plan: dict, mixed_prompts: list[str], methods: list[str],
               sampling_ok: set[str]) -> dict:
  """Everything measured on the running server: warm-up, the greedy levels, the mixed wave, then its state."""
  m = {"rss_start": srv.memory(), "programs_start": compiled_programs(srv.url)}
  for c in level_plan:
    wave(srv, level_plan[c], f"warm-up {c} greedy clients", args)
  warm = mixed_plan(args, mixed_prompts, methods, sampling_ok, warm=True)
  wave(srv, warm, f"warm-up {args.clients} mixed clients", args)
  m.update(rss_warm=srv.memory(), programs_warm=compiled_programs(srv.url))
  m["levels"], m["by_level"] = {}, {}
  for c in level_plan:
    m["by_level"][c], seconds = wave(srv, level_plan[c], f"{c} greedy clients", args)
    m["levels"][c] = level_report(c, m["by_level"][c], seconds)
  plan = mixed_plan(args, mixed_prompts, methods, sampling_ok, warm=False)
  m["mixed_answers"], seconds = wave(srv, plan, f"{args.clients} mixed clients", args)
  m["mixed"] = level_report(args.clients, m["mixed_answers"], seconds)
  m["health"], m["rows_left"] = drain(srv, args.drain_timeout)  # rows finish before memory and programs are read
  m.update(programs_after=compiled_programs(srv.url), rss_after=srv.memory())
  m["plain_ok"], m["plain_why"] = plain_request(srv.url) if srv.alive() else (False, "the server exited")
  m["alive"] = m["health"] == 200 and m["plain_ok"] and health(srv.url)[0] == 200 and srv.alive()
  srv.memory()
  m["peak"], m["exit"] = srv.peak_mib, srv.proc.poll()
  with contextlib.suppress(httpx.HTTPError):
    m["metrics_text"] = httpx.get(f"{srv.url}/metrics", timeout=30).text
  return m


def main(argv=None) -> None:
  args = parse_args(argv)
  from pasta_jax.data import sources
  from pasta_jax.methods import registry
  command = "python -m bench.serve " + shlex.join(sys.argv[1:] if argv is None else argv)
  workdir = Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  levels = sorted({int(x) for x in args.levels.split(",") if x})
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  ratio_method = args.ratio_method or methods[0]
  for name in {*methods, ratio_method}:  # an unknown name fails here, not mid-run
    served_method(name, args.lanes)
  sampling_ok = {m for m in methods if registry.METHODS[m].capabilities.sample}
  need = max(levels) + args.clients + args.disconnects
  prompts = [r["instruction"] for r in sources.read_records(args.prompts, max_records=max(need, args.ceiling))]
  if args.ceiling_only:
    return ceiling_only(args, prompts)
  ratio_level = 16 if 16 in levels else levels[-1]
  level_plan = {c: [[Job("ok", i, ratio_method, p, chat_payload(p, ratio_method, args.max_tokens))]
                    for i, p in enumerate(prompts[:c])] for c in levels}

  started = datetime.datetime.now().astimezone()
  with server(args, sorted({*methods, ratio_method}), workdir / "server.log") as srv:
    m = under_load(args, srv, level_plan, prompts[max(levels):], methods, sampling_ok)
  (workdir / "metrics.txt").write_text(m.pop("metrics_text", "(the server did not answer)\n"))

  # the server stopped: the references and the ceiling have the device to themselves
  import jax

  from pasta_jax.model.load import load_model
  model = load_model(None)
  sampling_of = Sampling(model)
  answers = [a for c in levels for a in m["by_level"][c]] + m["mixed_answers"]
  differing, checked = check_answers(model, answers, args.lanes, sampling_of, args.check_sampled)
  greedy_differing = [d for d in differing if d["greedy"]]
  ratio_jobs = [jobs[0] for jobs in level_plan[ratio_level]]
  ratio_sampling = sampling_of(ratio_jobs[0].payload)
  ceiling_texts: list[str] = []
  tokens, seconds = batched_run(model, [j.prompt for j in ratio_jobs], served_method(ratio_method, args.lanes),
                                args.max_tokens, ratio_sampling, args.certify_head, ceiling_texts)
  ceiling_tps = tokens / seconds
  served_texts = {a["prompt"]: a.get("text") for a in m["by_level"][ratio_level]}
  ceiling_same = sum(served_texts.get(j.prompt) == t for j, t in zip(ratio_jobs, ceiling_texts, strict=True))

  well_formed, bad, drops = ([a for a in answers if a["kind"] == k] for k in ("ok", "bad", "drop"))
  lost_ok = [a for a in well_formed if a["lost"]]
  lost = len(lost_ok) + sum(a["lost"] for a in bad)
  have_programs = None not in (m["programs_after"], m["programs_warm"])
  programs = m["programs_after"] - m["programs_warm"] if have_programs else float("nan")
  growth = m["rss_after"] - m["rss_warm"]
  top, mixed = m["levels"][ratio_level], m["mixed"]
  ratio = top["throughput"] / ceiling_tps
  by_label = collections.defaultdict(list)
  for a in bad:
    by_label[a["label"]].append("no reply" if a["status"] is None else str(a["status"]))

  lines = [f"bench.serve, {started:%Y-%m-%d %H:%M %Z}: {command}",
           f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
           f"device {jax.devices()[0].device_kind}",
           f"server: pasta serve --batch {args.batch} --chunk {args.chunk} --pool {args.pool} --lanes {args.lanes}"
           + (f" --chunk-seconds {args.chunk_seconds}" if args.chunk_seconds is not None else "")
           + (" --certify-head" if args.certify_head else "") + f"; max_tokens {args.max_tokens} per request",
           f"greedy levels: {ratio_method}, the sampling the server applies ({ratio_sampling})",
           f"{'clients':>8} {'reqs':>5} {'lost':>4} {'tokens':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
           f"{'gap p50':>8} {'gap p99':>8}"]
  for name, r in [*((str(c), r) for c, r in m["levels"].items()), (f"{args.clients}m", mixed)]:
    lines.append(f"{name:>8} {r['requests']:>5} {r['lost']:>4} {r['tokens']:>7} {r['throughput']:>7.1f} "
                 f"{r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s {r['gap_p50']:>7.2f}s {r['gap_p99']:>7.2f}s")
  lines += [f"  ({args.clients}m: the mixed wave, {', '.join(methods)} in turn, each client its own sampling; its wall "
            "time includes the malformed and closed requests)",
            f"ceiling: plain generate of the {ratio_level} prompts in one batch {ceiling_tps:.1f} tok/s; the server at "
            f"{ratio_level} greedy clients {top['throughput']:.1f} tok/s = {ratio:.2f}x (goal >= 0.9), time to first "
            f"text p99 {top['ttft_p99']:.2f} s (goal <= 2); the batch's answers equal to the server's: "
            f"{ceiling_same} of {len(ratio_jobs)}",
            f"lost: {lost} ({len(lost_ok)} of {len(well_formed)} well-formed requests; {sum(a['lost'] for a in bad)} "
            f"of {len(bad)} malformed ones not refused with a 4xx and a JSON error body)"]
  lines += [f"  well-formed lost x{n}: {why}"
            for why, n in collections.Counter(a["why"][:120] for a in lost_ok).most_common(5)]
  lines.append("malformed, status by kind: " + ", ".join(f"{k} {'/'.join(sorted(set(v)))}"
                                                         for k, v in by_label.items()))
  lines.append(f"closed early: {len(drops)} streams after {args.close_after} events "
               f"({sum(a['lost'] for a in drops)} refused before streaming)")
  per_method = collections.Counter(d["method"] for d in greedy_differing)
  lines.append(f"mixed up: {len(greedy_differing)} of {checked['greedy']} greedy answers differ from generate alone "
               "with the sampling the server applied" + (f" ({', '.join(f'{k}: {n}' for k, n in per_method.items())}"
                                                        f"; texts in {workdir / 'report.json'})" if differing else ""))
  if args.check_sampled:
    lines.append(f"sampled answers with a seed: {len(differing) - len(greedy_differing)} of {checked['sampled']} "
                 "differ from generate alone with the same sampling and seed")
  lines.append(f"programs compiled: {m['programs_start'] or 0:g} at start-up, {m['programs_warm']:g} after warm-up, "
               f"{m['programs_after']:g} after the load: {programs:g} under the load (goal 0)" if have_programs
               else f"programs compiled: the server reports no {PROGRAMS_METRIC} (or stopped answering)")
  lines.append(f"after the load: /health {m['health']}, rows left running or queued {m['rows_left']}, one more "
               f"plain request {'answered' if m['plain_ok'] else 'FAILED: ' + m['plain_why']}"
               + (f"; the server process EXITED with code {m['exit']} (see {workdir / 'server.log'})"
                  if m["exit"] is not None else ""))
  lines.append(f"server memory: resident {m['rss_start']:.0f} MiB at start-up, {m['rss_warm']:.0f} after warm-up, "
               f"{m['rss_after']:.0f} after the load (growth {growth:+.0f} MiB, "
               f"{'within' if growth < args.max_growth_mib else 'OVER' if growth == growth else 'unknown:'} the "
               f"{args.max_growth_mib:g} MiB bound); "
               f"peak (VmHWM) {m['peak']:.0f} MiB")
  result = (f"RESULT ceiling_ratio_16={ratio:.2f} ttft_p99_s={top['ttft_p99']:.2f} lost={lost} "
            f"mixed_up={len(greedy_differing)} programs={programs:g} alive={int(m['alive'])} peak_mib={m['peak']:.0f} "
            f"rss_growth_mib={growth:.0f} ttft_p99_mixed_s={mixed['ttft_p99']:.2f} "
            f"server_tps={top['throughput']:.1f} ceiling_tps={ceiling_tps:.1f}"
            + (f" sampled_mixed_up={len(differing) - len(greedy_differing)}" if args.check_sampled else ""))
  lines.append(result + (f" ratio_clients={ratio_level}" if ratio_level != 16 else ""))

  (workdir / "report.json").write_text(json.dumps(
      {"levels": m["levels"], "mixed": mixed, "differing": differing, "checked": checked,
       "lost": [{k: a.get(k) for k in ("kind", "client", "method", "label", "status", "why")}
                for a in answers if a["lost"]],
       "malformed": by_label, "programs": [m["programs_start"], m["programs_warm"], m["programs_after"]],
       "after_load": {k: m[k] for k in ("health", "rows_left", "plain_ok", "plain_why", "alive", "exit")},
       "memory_mib": {k: m[k] for k in ("rss_start", "rss_warm", "rss_after", "peak")},
       "ceiling_tps": ceiling_tps, "ceiling_same": ceiling_same, "args": vars(args)}, indent=1))
  text = "\n".join(lines) + "\n"
  print("\n" + text, end="", flush=True)
  for path in [workdir / "report.txt", *([Path(args.out)] if args.out else [])]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
  os.environ.setdefault("TQDM_MININTERVAL", "5")
  main()
