"""Load test of `pasta serve` on the embedded model, loopback only, bounded in count and time.

Starts `pasta serve` as a subprocess on 127.0.0.1 (batch rows B, chunk K), then for each concurrency level
(1, 4, 16, 64 streaming clients) runs a warm-up wave (not measured: it compiles the admission shapes) and a
measured wave: every client streams chat completions of alpaca_eval_805 instructions (mixed lengths), the
methods taking turns (`--methods`, default pasta / sequential), greedy, `--max-tokens` each.
Measured per level: throughput (content
tokens / s over the wave), time to first streamed text (p50, p99), the gap between streamed events and tokens
per event (p50, p99), requests lost (no final event, or an HTTP error). Then, with the load stopped, every
answer is compared with `pasta_jax.generate` of its prompt alone (greedy): a streamed answer that differs is
"mixed up". Batch-1 overhead: each request's wall time alone through the server against `generate` alone
(both warm), as tokens/s, on a second server with one row (`--batch 1`: the cost of chunks and HTTP alone).
The server's peak memory is its VmHWM. Throughput at 16 clients is divided by the better of one client on
the same server and `generate` alone. The device's own ceiling: plain `generate` of 16 prompts in one batch
against the same prompts one at a time (content tokens / s), no server at all.

  python -m bench.serve [--levels 1,4,16,64] [--max-tokens 64] [--batch 16] [--chunk 8]
Last line: RESULT throughput_16_over_1=... ttft_p99_s=... (16 clients) lost=... mixed_up=... batch1_over_generate=...
          ceiling_16_over_1=...
`--certify-head`: the server, `generate` alone and the ceiling choose through the certified bfloat16 head.
`--chunk-seconds 0.5,0`: the levels on one server per `pasta serve --chunk-seconds` value, side by side; the first
  one's figures make the RESULT's main ones, and it adds ttft_p99_s_chunkSs=... throughput_chunkSs=...
`--ceiling-only`: no server; the ceiling with the float32 head and with the certified head, side by side:
  RESULT ceiling_16_over_1=... ceiling_certified_16_over_1=... certified_over_float32_batched=... same_answers=...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from pasta_jax.data import sources


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def server(args, batch: int, log: Path, chunk: int | None = None, chunk_seconds: float | None = None):
  """`pasta serve` as a subprocess on a free loopback port; yields (url, process); SIGTERM at the end."""
  port = free_port()
  cmd = [sys.executable, "-m", "pasta_jax.cli", "serve", "--port", str(port), "--batch", str(batch),
         "--chunk", str(chunk or args.chunk), "--max-tokens", str(args.max_tokens), "--max-queue", "256",
         "--pool", str(args.pool), "--warmup", "pasta,sequential", "--lanes", str(args.lanes)]
  cmd += ["--certify-head"] if args.certify_head else []
  cmd += ["--chunk-seconds", str(chunk_seconds)] if chunk_seconds is not None else []
  proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.time() + args.start_timeout
    while True:
      if proc.poll() is not None:
        raise SystemExit(f"pasta serve exited ({proc.returncode}); see {log}")
      if time.time() > deadline:
        raise SystemExit(f"pasta serve did not start in {args.start_timeout} s; see {log}")
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      time.sleep(1)
    yield url, proc
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      proc.kill()


def peak_rss_mib(pid: int) -> float:
  for line in Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) / 1024
  return float("nan")


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, method: str, max_tokens: int) -> dict:
  """Streams one chat completion; returns its text, timings and outcome."""
  body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
          "method": method, "stream_options": {"include_usage": True}}
  start = time.perf_counter()
  events, text, finish, usage = [], [], None, None
  try:
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
      if reply.status_code != 200:
        return {"lost": True, "why": f"HTTP {reply.status_code}", "prompt": prompt, "method": method}
      async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        data = json.loads(line[6:])
        if data.get("usage"):
          usage = data["usage"]
        for choice in data.get("choices", []):
          piece = choice["delta"].get("content") or ""
          if piece:
            events.append(time.perf_counter() - start)
            text.append(piece)
          finish = choice.get("finish_reason") or finish
  except httpx.HTTPError as err:
    return {"lost": True, "why": repr(err), "prompt": prompt, "method": method}
  total = time.perf_counter() - start
  return {"lost": finish is None, "why": "no final event" if finish is None else "", "prompt": prompt,
          "method": method, "text": "".join(text), "events": events, "pieces": [len(t) for t in text],
          "seconds": total, "tokens": usage["completion_tokens"] if usage else 0, "finish": finish}


async def wave(url: str, clients: int, jobs: list[tuple[str, str]], max_tokens: int, bar) -> tuple[list[dict], float]:
  """`clients` concurrent streams working through `jobs` [(prompt, method)]; returns answers and wall time."""
  queue: asyncio.Queue = asyncio.Queue()
  for job in jobs:
    queue.put_nowait(job)
  out: list[dict] = []
  limits = httpx.Limits(max_connections=clients + 4)
  async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
    async def client():
      while not queue.empty():
        prompt, method = queue.get_nowait()
        out.append(await one_request(http, url, prompt, method, max_tokens))
        bar.update(1)
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
  return out, time.perf_counter() - start


def pct(values, q: float) -> float:
  return float(np.percentile(values, q)) if len(values) else float("nan")


def level_report(clients: int, answers: list[dict], seconds: float) -> dict:
  ok = [a for a in answers if not a["lost"]]
  ttft = [a["events"][0] for a in ok if a["events"]]
  gaps = [b - a for x in ok for a, b in zip(x["events"], x["events"][1:])]
  return {"clients": clients, "requests": len(answers), "lost": len(answers) - len(ok),
          "tokens": sum(a["tokens"] for a in ok), "seconds": seconds,
          "throughput": sum(a["tokens"] for a in ok) / seconds, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
          "gap_p50": pct(gaps, 50), "gap_p99": pct(gaps, 99),
          "events_per_answer": statistics.mean(len(a["events"]) for a in ok) if ok else 0.0,
          "ttft_p99_by_method": {m: pct([a["events"][0] for a in ok if a["method"] == m and a["events"]], 99)
                                 for m in sorted({a["method"] for a in ok})}}


def served_method(name: str, lanes: int):
  """The method value `pasta serve --lanes LANES` serves as `name`: its defaults, with `lanes` where it has lanes
  (the server's option flags set that option of every method that has it)."""
  from pasta_jax.methods import resolve
  method = resolve(name)
  has_lanes = any(f.name == "lanes" for f in method.options())
  return dataclasses.replace(method, lanes=lanes) if has_lanes else method


def reference_text(model, prompt: str, method, max_tokens: int) -> str:
  """What the server must answer, greedy: `generate` alone of the served `method` (a method value); ProPD's is
  plain greedy decoding's (lossless); SoT's is `SkeletonOfThought.run` with the server's budgets and lanes."""
  from pasta_jax.baselines.sot import SkeletonOfThought, SotConfig
  from pasta_jax.methods import Propd, Sequential, Sot, generate
  if isinstance(method, Sot):
    config = SotConfig(point_tokens=max_tokens, answer_tokens=max_tokens, lanes=method.lanes)
    return SkeletonOfThought(model, config).run(prompt).text
  method = Sequential() if isinstance(method, Propd) else method
  return generate(model, [prompt], method, max_new_tokens=max_tokens)[0].text


def check_answers(model, answers: list[dict], max_tokens: int, lanes: int) -> list[dict]:
  """Every answer against its greedy reference alone (`reference_text`, of the method the server serves under the
  answer's method name); returns those that differ (mixed up), each with its method, prompt, text and reference."""
  refs, mixed = {}, []
  for a in tqdm([a for a in answers if not a["lost"]], desc="greedy references", unit="answer"):
    key = (a["prompt"], a["method"])
    if key not in refs:
      refs[key] = reference_text(model, a["prompt"], served_method(a["method"], lanes), max_tokens)
    if a["text"] != refs[key]:
      mixed.append({"method": a["method"], "prompt": a["prompt"], "text": a["text"], "reference": refs[key]})
  return mixed


def batching_ceiling(model, prompts: list[str], max_tokens: int, certify_head: bool = False,
                     texts: list | None = None) -> tuple[float, float]:
  """Content tokens / s of plain greedy `generate`: all `prompts` in one batch, and one at a time (each warm).
  The batched answers' texts are appended to `texts` when given."""
  from pasta_jax.decode.runtime import Runtime
  from pasta_jax.methods import Sequential, generate
  kw = dict(max_new_tokens=max_tokens, runtime=Runtime(certify_head=certify_head))
  def rate(batches, keep=None):
    for batch in batches:  # compile every shape first
      generate(model, batch, Sequential(), **kw)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
      results = generate(model, batch, Sequential(), **kw)
      tokens += sum(r.content_tokens for r in results)
      if keep is not None:
        keep.extend(r.text for r in results)
    return tokens / (time.perf_counter() - start)
  return rate([prompts], texts), rate([[p] for p in prompts])


def ceiling_only(args, prompts: list[str]) -> None:
  """The device's batching ceiling with the float32 head and with the certified head, side by side, no server."""
  from pasta_jax.model.load import load_model
  model, rows, texts = load_model(None), {}, {}
  for certify in (False, True):
    texts[certify] = []
    rows[certify] = batching_ceiling(model, prompts[:args.ceiling], args.max_tokens, certify, texts[certify])
    print(f"{'certified' if certify else 'float32'} head: {args.ceiling} prompts in one batch {rows[certify][0]:.1f} "
          f"tok/s, one at a time {rows[certify][1]:.1f} tok/s ({rows[certify][0] / rows[certify][1]:.2f}x)", flush=True)
  same = sum(a == b for a, b in zip(texts[False], texts[True], strict=True))
  print(f"batched answers identical between the heads: {same} of {len(texts[False])}")
  (float32_batched, float32_alone), (certified_batched, _) = rows[False], rows[True]
  print(f"RESULT ceiling_16_over_1={float32_batched / float32_alone:.2f} "
        f"ceiling_certified_16_over_1={certified_batched / float32_alone:.2f} "
        f"certified_over_float32_batched={certified_batched / float32_batched:.2f} same_answers={same}")


def generate_rate(model, prompt: str, method: str, max_tokens: int, certify_head: bool = False) -> float:
  """Content tokens per second of `generate` alone (the method of that name, its default options), wall time of
  its second (warm) call; the certified head where the method can take one."""
  from pasta_jax.decode.runtime import Runtime
  from pasta_jax.methods import generate, resolve
  method = resolve(method)
  kw = dict(max_new_tokens=max_tokens, runtime=Runtime(certify_head=certify_head and method.capabilities.certify_head))
  generate(model, [prompt], method, **kw)
  start = time.perf_counter()
  result = generate(model, [prompt], method, **kw)[0]
  return result.content_tokens / (time.perf_counter() - start)


def load_levels(url: str, levels: list[int], prompts: list[str], methods: list[str], args) -> list[dict]:
  """Each concurrency level's report (its answers under "answers"): a warm-up wave, then the measured one."""
  reports = []
  for i, clients in enumerate(levels):
    n = min(max(4, int(clients * args.per_client)), args.max_requests)
    start = sum(min(max(4, int(c * args.per_client)), args.max_requests) for c in levels[:i])
    jobs = [(prompts[(start + j) % len(prompts)], methods[j % len(methods)]) for j in range(n)]
    for measured in (False, True):  # the warm-up wave sends the same prompts: it compiles their shapes
      with tqdm(total=n, desc=f"{clients} clients {'measured' if measured else 'warm-up'}", unit="req") as bar:
        answers, seconds = asyncio.run(wave(url, clients, jobs, args.max_tokens, bar))
    reports.append({**level_report(clients, answers, seconds), "answers": answers})
  return reports


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", default="alpaca_eval_805", help="instructions to send (a shared data name or JSONL)")
  parser.add_argument("--levels", default="1,4,16,64")
  parser.add_argument("--per-client", type=float, default=2.0, help="requests per client in a wave (at least 4)")
  parser.add_argument("--max-requests", type=int, default=64, help="at most this many requests in a wave")
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--chunk", type=int, default=8)
  parser.add_argument("--batch1-chunks", default="", help="more chunk sizes K for the batch-1 overhead (e.g. 4,16)")
  parser.add_argument("--pool", type=int, default=512)
  parser.add_argument("--chunk-seconds", default="",
                      help="the server's --chunk-seconds, one server each, side by side (e.g. 0.5,0; "
                           "default: the server's); the first one's figures make the RESULT's")
  parser.add_argument("--lanes", type=int, default=8, help="PASTA / APAR lanes, SoT's fan-out")
  parser.add_argument("--methods", default="pasta,sequential",
                      help="methods the requests take in turn (pasta, sequential, apar, pasta-v0, medusa, propd, sot)")
  parser.add_argument("--ceiling", type=int, default=16, help="prompts in the plain batched-generate ceiling (0: skip)")
  parser.add_argument("--start-timeout", type=float, default=900)
  parser.add_argument("--certify-head", action="store_true",
                      help="the server, generate alone and the ceiling choose greedy tokens through the certified "
                           "bfloat16 head (the same answers: the mixed-up check compares with float32 generate)")
  parser.add_argument("--ceiling-only", action="store_true",
                      help="no server: the batching ceiling with the float32 and the certified head, side by side")
  parser.add_argument("--out", default="runs/bench_serve")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  levels = [int(x) for x in args.levels.split(",")]
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  served = {name: served_method(name, args.lanes) for name in methods}  # an unknown name fails here, not mid-run
  prompts = [r["instruction"] for r in sources.read_records(args.prompts, max_records=200)]
  if args.ceiling_only:
    return ceiling_only(args, prompts)
  answers_all, peaks, by_setting = [], [], {}
  settings = [float(x) for x in args.chunk_seconds.split(",") if x] or [None]
  for seconds in settings:  # one server per chunk time target, side by side
    name = "server.log" if seconds is None else f"server_chunk{seconds:g}s.log"
    with server(args, args.batch, out / name, chunk_seconds=seconds) as (url, proc):
      by_setting[seconds] = load_levels(url, levels, prompts, methods, args)
      answers_all += [a for r in by_setting[seconds] for a in r.pop("answers")]
      (out / name.replace("server", "metrics").replace(".log", ".txt")).write_text(httpx.get(f"{url}/metrics").text)
      peaks.append(peak_rss_mib(proc.pid))
  reports, peak = by_setting[settings[0]], max(peaks)
  # the batch-1 overhead compares with `generate` alone: methods it runs as one call (not SoT's two stages on
  # scripts, nor ProPD, which a server runs on step times it learns and `generate` on ones it calibrates first)
  caps = {name: method.capabilities for name, method in served.items()}
  alone_jobs = [(a["prompt"], a["method"]) for a in answers_all
                if not (caps[a["method"]].needs_scripts or caps[a["method"]].learns_latency)][:4]
  chunks = sorted({args.chunk, *(int(k) for k in args.batch1_chunks.split(",") if k)})
  alone_by_chunk = {}
  for chunk in chunks:  # the chunking overhead alone: one row, chunk K
    with server(args, 1, out / f"server_batch1_k{chunk}.log", chunk) as (url, _):
      for label in ("warm-up", "measured"):
        with tqdm(total=len(alone_jobs), desc=f"batch-1 server K={chunk} {label}", unit="req") as bar:
          alone_by_chunk[chunk] = asyncio.run(wave(url, 1, alone_jobs, args.max_tokens, bar))[0]
  alone = alone_by_chunk[args.chunk]
  from pasta_jax.model.load import load_model
  model = load_model(None)
  differing = check_answers(model, answers_all + [a for k in chunks for a in alone_by_chunk[k]], args.max_tokens,
                        args.lanes)
  nan = (float("nan"), float("nan"))
  ceiling = batching_ceiling(model, prompts[:args.ceiling], args.max_tokens, args.certify_head) if args.ceiling else nan
  batched_tps, one_by_one_tps = ceiling
  rates = [generate_rate(model, a["prompt"], a["method"], args.max_tokens, args.certify_head) for a in alone]
  by_chunk = {k: statistics.median((a["tokens"] / a["seconds"]) / rate
                                   for a, rate in zip(alone_by_chunk[k], rates, strict=True)) for k in chunks}
  ratio = by_chunk[args.chunk]
  mixed = len(differing)
  generate_tps = sum(a["tokens"] for a in alone) / sum(a["tokens"] / r for a, r in zip(alone, rates, strict=True))
  print(f"\nserver: batch {args.batch}, chunk {args.chunk}, pool {args.pool}, max_tokens {args.max_tokens}; "
        f"peak memory {peak:.0f} MiB; throughput_16_over_1 divides by the better of one client and generate alone")
  print(f"{'clients':>7} {'reqs':>5} {'lost':>4} {'tokens':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'gap p50':>8} {'gap p99':>8} {'events':>6}")
  for r in reports:
    print(f"{r['clients']:>7} {r['requests']:>5} {r['lost']:>4} {r['tokens']:>7} {r['throughput']:>7.1f} "
          f"{r['ttft_p50']:>8.2f}s {r['ttft_p99']:>8.2f}s {r['gap_p50']:>7.2f}s {r['gap_p99']:>7.2f}s "
          f"{r['events_per_answer']:>6.1f}")
  for r in reports:
    print(f"time to first text p99 by method at {r['clients']} clients: "
          + ", ".join(f"{m} {t:.2f}s" for m, t in r["ttft_p99_by_method"].items()))
  by = {r["clients"]: r for r in reports}
  top = by.get(16, reports[-1])
  base = max(by.get(1, reports[0])["throughput"], generate_tps)
  lost = sum(r["lost"] for rows in by_setting.values() for r in rows)
  (out / "report.json").write_text(json.dumps({"levels": reports, "mixed_up": mixed, "differing": differing,
                                               "levels_by_chunk_seconds": {str(w): r for w, r in by_setting.items()},
                                               "peak_mib": peak,
                                               "batch1_over_generate": ratio, "generate_tps": generate_tps,
                                               "batch1_over_generate_by_chunk": by_chunk,
                                               "ceiling": {"batched_tps": batched_tps,
                                                           "one_by_one_tps": one_by_one_tps},
                                               "args": vars(args)}, indent=1))
  checked = len(answers_all) + len(chunks) * len(alone) - lost
  per_method = collections.Counter(d["method"] for d in differing)
  print(f"answers checked against generate alone: {checked}, mixed up: {mixed}"
        + (f" ({', '.join(f'{m}: {n}' for m, n in per_method.items())}; texts in report.json)" if mixed else ""))
  print("batch-1 server tokens/s over generate alone by chunk K: "
        + ", ".join(f"K={k}: {r:.2f}" for k, r in by_chunk.items()))
  print(f"one request at a time: generate alone {generate_tps:.1f} tok/s; a --batch 1 server {ratio:.2f}x that "
        f"(median of {len(alone)}); the --batch {args.batch} server at {by.get(1, reports[0])['clients']} "
        f"client(s) {by.get(1, reports[0])['throughput']:.1f} tok/s")
  print(f"the device's ceiling, no server: plain generate of {args.ceiling} prompts in one batch {batched_tps:.1f} "
        f"tok/s, one at a time {one_by_one_tps:.1f} tok/s ({batched_tps / one_by_one_tps:.2f}x)")
  extra = ""
  if len(settings) > 1:  # every setting's busiest level, the first setting's in the RESULT's main figures
    for seconds, rows in by_setting.items():
      r = {x["clients"]: x for x in rows}.get(top["clients"], rows[-1])
      print(f"--chunk-seconds {seconds:g}: {r['clients']} clients {r['throughput']:.1f} tok/s, "
            f"TTFT p50 {r['ttft_p50']:.2f}s p99 {r['ttft_p99']:.2f}s, lost {r['lost']}")
      extra += f" ttft_p99_s_chunk{seconds:g}s={r['ttft_p99']:.2f} throughput_chunk{seconds:g}s={r['throughput']:.1f}"
  print(f"RESULT throughput_16_over_1={top['throughput'] / base:.2f} ttft_p99_s={top['ttft_p99']:.2f} lost={lost} "
        f"mixed_up={mixed} batch1_over_generate={ratio:.2f} ceiling_16_over_1={batched_tps / one_by_one_tps:.2f}"
        + extra)


if __name__ == "__main__":
  os.environ.setdefault("TQDM_MININTERVAL", "5")
  main()
