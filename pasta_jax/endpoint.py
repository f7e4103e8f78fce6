"""A small OpenAI-compatible chat-completions client (stdlib only), shared by the HTTP judge and the
LLM annotator.

Retries with exponential backoff and jitter on timeouts, connection errors, HTTP 429 and 5xx,
honouring `Retry-After`; malformed replies are retried a few times too; other 4xx fail at once.
The API key is sent in a header and never appears in reprs, logs or error messages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from pasta_jax.errors import PastaError

log = logging.getLogger(__name__)
RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class EndpointError(PastaError):
  """The endpoint is misconfigured, refused the request, or kept failing after retries."""


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
  base_url: str
  model: str
  api_key: str = dataclasses.field(default="", repr=False)
  timeout_s: float = 60.0
  max_retries: int = 6
  backoff_s: float = 1.0
  max_backoff_s: float = 60.0
  requests_per_minute: float | None = None

  @classmethod
  def from_env(cls, prefix: str = "PASTA_JUDGE", **overrides) -> EndpointConfig:
    """<prefix>_BASE_URL and <prefix>_MODEL are required; <prefix>_API_KEY is optional."""
    missing = [f"{prefix}_{name}" for name in ("BASE_URL", "MODEL") if not os.environ.get(f"{prefix}_{name}")]
    if missing:
      raise EndpointError(f"set {' and '.join(missing)} for the OpenAI-compatible endpoint")
    return cls(base_url=os.environ[f"{prefix}_BASE_URL"].rstrip("/"), model=os.environ[f"{prefix}_MODEL"],
               api_key=os.environ.get(f"{prefix}_API_KEY", ""), **overrides)

  def __repr__(self) -> str:
    key = "<set>" if self.api_key else "<none>"
    return f"EndpointConfig(base_url={self.base_url!r}, model={self.model!r}, api_key={key})"


@dataclasses.dataclass(frozen=True)
class Completion:
  text: str
  top_logprobs: dict[str, float] | None  # the first generated token's alternatives, if the endpoint gave them


class _Retry(Exception):
  def __init__(self, reason: str, wait: float | None = None):
    super().__init__(reason)
    self.reason, self.wait = reason, wait


class ChatClient:
  """POSTs to <base_url>/chat/completions. `urlopen` and `sleep` are injectable for tests."""

  def __init__(self, config: EndpointConfig, *, urlopen: Callable = urllib.request.urlopen,
               sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None):
    self.config, self._urlopen, self._sleep = config, urlopen, sleep
    self._rng = rng or random.Random(0)
    self._lock, self._last = threading.Lock(), 0.0

  def complete(self, messages: Sequence[dict], *, max_tokens: int = 16, temperature: float = 0.0,
               logprobs: int | None = None) -> Completion:
    body = {"model": self.config.model, "messages": list(messages), "max_tokens": max_tokens,
            "temperature": temperature}
    if logprobs:
      body.update(logprobs=True, top_logprobs=logprobs)
    last = ""
    for attempt in range(self.config.max_retries + 1):
      self._rate_limit()
      try:
        return self._once(body)
      except _Retry as retry:
        last = retry.reason
        if attempt == self.config.max_retries:
          break
        wait = retry.wait if retry.wait is not None else self._backoff(attempt)
        log.warning("endpoint %s: %s; retry %d/%d in %.1fs", self.config.base_url, retry.reason, attempt + 1,
                    self.config.max_retries, wait)
        self._sleep(wait)
    raise EndpointError(f"{self.config.base_url}: gave up after {self.config.max_retries + 1} attempts: {last}")

  def _backoff(self, attempt: int) -> float:
    base = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** attempt)
    return base * (0.5 + 0.5 * self._rng.random())  # jitter: concurrent clients do not retry in lockstep

  def _rate_limit(self) -> None:
    rpm = self.config.requests_per_minute
    if not rpm:
      return
    with self._lock:
      wait = self._last + 60.0 / rpm - time.monotonic()
      if wait > 0:
        self._sleep(wait)
      self._last = time.monotonic()

  def _once(self, body: dict) -> Completion:
    request = urllib.request.Request(f"{self.config.base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **self._auth()}, method="POST")
    try:
      with self._urlopen(request, timeout=self.config.timeout_s) as response:
        raw = response.read()
    except urllib.error.HTTPError as err:
      detail = self._redact(_excerpt(err.read() if err.fp else b""))
      if err.code in RETRY_STATUS:
        raise _Retry(f"HTTP {err.code} {detail}", _retry_after(err.headers)) from None
      raise EndpointError(f"{self.config.base_url}: HTTP {err.code}: {detail}") from None
    except TimeoutError:
      raise _Retry(f"timed out after {self.config.timeout_s}s") from None
    except (urllib.error.URLError, ConnectionError) as err:
      raise _Retry(f"connection failed: {getattr(err, 'reason', err)}") from None
    try:
      return _parse(raw)
    except _Retry as retry:
      raise _Retry(self._redact(retry.reason)) from None

  def _redact(self, text: str) -> str:
    """A server may echo the request (and its key) in an error body: never pass the key on."""
    return text.replace(self.config.api_key, "***") if self.config.api_key else text

  def _auth(self) -> dict:
    return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}


def _parse(raw: bytes) -> Completion:
  try:
    choice = json.loads(raw)["choices"][0]
    text = choice["message"]["content"] or ""
  except (ValueError, KeyError, IndexError, TypeError):
    raise _Retry(f"malformed reply: {_excerpt(raw)}") from None
  top = None
  try:
    first = choice["logprobs"]["content"][0]["top_logprobs"]
    top = {item["token"]: float(item["logprob"]) for item in first}
  except (KeyError, IndexError, TypeError, ValueError):
    pass  # the endpoint gave no logprobs: callers fall back to the text
  return Completion(text, top)


def _retry_after(headers) -> float | None:
  value = headers.get("Retry-After") if headers else None
  try:
    return max(0.0, float(value)) if value is not None else None
  except ValueError:
    return None  # an HTTP date: use our own backoff


def _excerpt(raw: bytes, limit: int = 200) -> str:
  text = raw.decode("utf-8", "replace").strip().replace("\n", " ")
  return text[:limit] + ("..." if len(text) > limit else "")
