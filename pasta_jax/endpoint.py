"""A small OpenAI-compatible chat-completions client (stdlib only), shared by the HTTP judge and the
LLM annotator.

Judging and annotating runs send thousands of requests to endpoints that throttle, hiccup and
sometimes answer garbage, so the client retries what a retry can fix: timeouts, connection errors,
HTTP 408/409/429 and 5xx (exponential backoff with jitter, honouring `Retry-After`), and malformed
replies (a few times), among them logprobs that are no numbers (NaN, +inf, missing). Other 4xx are our
mistake and fail at once. The API key is sent in a header and never appears in reprs, logs or error
messages (a server echoing it back is redacted too). It stays home, too: redirects are never followed,
and plain http:// carries it only to a loopback host unless `allow_insecure_key` says otherwise.
"""

from __future__ import annotations

import dataclasses
import email.utils
import http.client
import ipaddress
import json
import logging
import math
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

from pasta_jax.errors import PastaError

log = logging.getLogger(__name__)
MALFORMED_RETRIES = 3  # a server that keeps answering garbage will not stop: give up sooner than on 5xx


class EndpointError(PastaError):
  """The endpoint is misconfigured, refused the request, or kept failing after retries."""

  def __init__(self, message: str, status: int | None = None):
    super().__init__(message)
    self.status = status  # the HTTP status of a refused request, None otherwise


def retryable_status(code: int) -> bool:
  """Statuses a later identical request may get past (as the OpenAI SDKs retry; 501/505 never will)."""
  return code in (408, 409, 429) or (code >= 500 and code not in (501, 505))


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
  """Where and how to call an OpenAI-compatible endpoint; `base_url` ends before /chat/completions."""

  base_url: str
  model: str
  api_key: str = dataclasses.field(default="", repr=False)  # optional: local servers need none
  timeout_s: float = 60.0
  max_retries: int = 6
  backoff_s: float = 1.0
  max_backoff_s: float = 60.0
  requests_per_minute: float | None = None
  allow_insecure_key: bool = False  # send the key over plain http:// to a host that is not loopback

  def __post_init__(self):
    if not self.base_url.startswith(("http://", "https://")):
      raise EndpointError(f"base_url must start with http:// or https://, got {self.base_url!r}")
    if self.api_key and self.base_url.startswith("http://") and not self.allow_insecure_key:
      host = urllib.parse.urlsplit(self.base_url).hostname or ""
      if not is_loopback(host):
        raise EndpointError(f"refusing to send the API key in clear text to {self.base_url}: use https://, a "
                            "loopback host, or allow it explicitly (--allow-http-key; EndpointConfig."
                            "allow_insecure_key=True)")
    if not self.model:
      raise EndpointError("model must be named (the endpoint's model id)")
    checks = {"timeout_s": self.timeout_s > 0, "max_retries": self.max_retries >= 0,
              "backoff_s": self.backoff_s >= 0, "max_backoff_s": self.max_backoff_s >= 0,
              "requests_per_minute": self.requests_per_minute is None or self.requests_per_minute > 0}
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
      raise EndpointError(f"EndpointConfig.{bad[0]} out of range: {getattr(self, bad[0])!r}")
    object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

  @classmethod
  def from_env(cls, prefix: str = "PASTA_JUDGE", **overrides) -> EndpointConfig:
    """<prefix>_BASE_URL and <prefix>_MODEL are required; <prefix>_API_KEY is optional."""
    value = lambda name: os.environ.get(f"{prefix}_{name}", "").strip()
    missing = [f"{prefix}_{name}" for name in ("BASE_URL", "MODEL") if not value(name)]
    if missing:
      raise EndpointError(f"set {' and '.join(missing)} for the OpenAI-compatible endpoint")
    return cls(base_url=value("BASE_URL"), model=value("MODEL"), api_key=value("API_KEY"), **overrides)

  def __repr__(self) -> str:
    key = "<set>" if self.api_key else "<none>"
    return (f"EndpointConfig(base_url={self.base_url!r}, model={self.model!r}, api_key={key}, "
            f"timeout_s={self.timeout_s}, max_retries={self.max_retries})")

  __str__ = __repr__


@dataclasses.dataclass(frozen=True)
class Completion:
  """One reply. `token_logprobs` holds (token, its top alternatives) per generated token, when given."""

  text: str
  top_logprobs: dict[str, float] | None  # the first generated token's alternatives, if the endpoint gave them
  token_logprobs: tuple[tuple[str, dict[str, float]], ...] | None = None


def is_loopback(host: str) -> bool:
  """localhost, 127.0.0.0/8 or ::1: a host whose traffic never leaves the machine."""
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False  # a name other than localhost may resolve anywhere


def origin(url: str) -> str:
  """scheme://host[:port] of a URL, for messages that must name a host but never a path or credentials."""
  parts = urllib.parse.urlsplit(url)
  host = parts.hostname or "?"
  if ":" in host:
    host = f"[{host}]"
  try:
    port = parts.port
  except ValueError:
    port = None
  return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
  """Redirects end the request with an error naming both hosts, whatever the target.

  Following only same-origin redirects would also keep the key home, but refusing all of them is
  the safer rule and loses nothing: urllib turns a redirected POST into a body-less GET (and does
  not follow 307/308 for POST at all), so no redirect of a chat-completions request ever worked.
  A redirect means base_url is not the endpoint's own address; the user should name that one.
  """

  def redirect_request(self, req, fp, code, msg, headers, newurl):
    try:
      fp.close()
    except OSError:
      pass
    target = urllib.parse.urljoin(req.full_url, newurl)
    raise EndpointError(f"{origin(req.full_url)} redirected (HTTP {code}) to {origin(target)}: redirects are not "
                        f"followed, so the API key stays with the configured host; set base_url to the endpoint's "
                        f"own address", status=code)


_OPENER = urllib.request.build_opener(_RefuseRedirects)  # urllib's default handlers, but no redirects


class _Retry(Exception):
  def __init__(self, reason: str, wait: float | None = None, malformed: bool = False):
    super().__init__(reason)
    self.reason, self.wait, self.malformed = reason, wait, malformed


class ChatClient:
  """POSTs to <base_url>/chat/completions. `urlopen`, `sleep` and `rng` are injectable for tests.

  Thread-safe: the annotator shares one client between its workers, so the rate limit is global.
  """

  def __init__(self, config: EndpointConfig, *, urlopen: Callable = _OPENER.open,
               sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.config, self._urlopen, self._sleep, self._clock = config, urlopen, sleep, clock
    self._rng = rng or random.Random()
    self._lock, self._next_slot = threading.Lock(), 0.0

  def __repr__(self) -> str:
    return f"ChatClient({self.config!r})"

  def complete(self, messages: Sequence[dict], *, max_tokens: int = 16, temperature: float = 0.0,
               logprobs: int | None = None) -> Completion:
    """One chat completion; `logprobs` = how many top alternatives per token to ask for (None: none)."""
    body = {"model": self.config.model, "messages": list(messages), "max_tokens": max_tokens,
            "temperature": temperature}
    if logprobs is not None:
      body.update(logprobs=True, top_logprobs=logprobs)
    payload = json.dumps(body).encode()
    attempts, malformed, last = 0, 0, ""
    while True:
      attempts += 1
      self._rate_limit()
      try:
        return self._once(payload)
      except _Retry as retry:
        last = retry.reason
        malformed += retry.malformed
        if attempts > self.config.max_retries or malformed > MALFORMED_RETRIES:
          break
        wait = self._wait(retry, attempts - 1)
        log.warning("endpoint %s: %s; retry %d/%d in %.1fs", self.config.base_url, retry.reason, attempts,
                    self.config.max_retries, wait)
        self._sleep(wait)
    raise EndpointError(f"{self.config.base_url}: gave up after {attempts} attempts: {last}")

  def _wait(self, retry: _Retry, attempt: int) -> float:
    """The server's Retry-After (capped, so one header cannot stall a run for hours), else our backoff."""
    if retry.wait is not None:
      return min(retry.wait, self.config.max_backoff_s)
    base = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** attempt)
    return base * (0.5 + 0.5 * self._rng.random())  # jitter: concurrent clients do not retry in lockstep

  def _rate_limit(self) -> None:
    """Spaces request starts 60/rpm apart across threads: each reserves a slot, then sleeps to it."""
    rpm = self.config.requests_per_minute
    if not rpm:
      return
    with self._lock:
      now = self._clock()
      slot = max(now, self._next_slot)
      self._next_slot = slot + 60.0 / rpm
    if slot > now:
      self._sleep(slot - now)

  def _once(self, payload: bytes) -> Completion:
    request = urllib.request.Request(f"{self.config.base_url}/chat/completions", data=payload,
                                     headers={"Content-Type": "application/json"}, method="POST")
    for name, value in self._auth().items():  # unredirected: urllib copies no such header onto a redirect
      request.add_unredirected_header(name, value)
    try:
      with self._urlopen(request, timeout=self.config.timeout_s) as response:
        raw = response.read()
    except urllib.error.HTTPError as err:
      detail = self._redact(_excerpt(_read_body(err)))
      if retryable_status(err.code):
        raise _Retry(f"HTTP {err.code} {detail}", _retry_after(err.headers)) from None
      raise EndpointError(f"{self.config.base_url}: HTTP {err.code}: {detail}", status=err.code) from None
    except TimeoutError:
      raise _Retry(f"timed out after {self.config.timeout_s}s") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
      reason = getattr(err, "reason", None) or type(err).__name__
      raise _Retry(self._redact(f"connection failed: {reason}")) from None
    try:
      return _parse(raw)
    except _Retry as retry:
      raise _Retry(self._redact(retry.reason), malformed=True) from None

  def _redact(self, text: str) -> str:
    """A server may echo the request (and its key) in an error body: never pass the key on."""
    return text.replace(self.config.api_key, "***") if self.config.api_key else text

  def _auth(self) -> dict:
    return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}


def _parse(raw: bytes) -> Completion:
  try:
    choice = json.loads(raw)["choices"][0]
    content = choice["message"]["content"]
  except (ValueError, KeyError, IndexError, TypeError):
    raise _Retry(f"malformed reply: {_excerpt(raw)}") from None
  if isinstance(content, list):  # content parts, as some servers send
    content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
  if content is not None and not isinstance(content, str):
    raise _Retry(f"malformed reply (content is {type(content).__name__}): {_excerpt(raw)}")
  tokens = _token_logprobs(choice)
  return Completion(content or "", tokens[0][1] if tokens else None, tokens)


def _token_logprobs(choice: dict) -> tuple[tuple[str, dict[str, float]], ...] | None:
  """Per generated token (token, {alternative: logprob}); None when the endpoint gave none.

  An alternative whose logprob is NaN, +inf, null or missing makes the reply malformed (retried):
  a judge would turn it into a NaN verdict. -inf is a probability of zero, and kept.
  """
  try:
    content = choice["logprobs"]["content"]
    out = tuple((str(item.get("token", "")),
                 {alt["token"]: _logprob(alt) for alt in item.get("top_logprobs") or []})
                for item in content)
  except (KeyError, IndexError, TypeError, ValueError, AttributeError):
    return None  # the endpoint gave no (or unreadable) logprobs: callers fall back to the text
  return out if out and out[0][1] else None


def _logprob(alt: dict) -> float:
  value = alt.get("logprob")
  try:
    number = None if isinstance(value, bool) or not isinstance(value, int | float) else float(value)
  except OverflowError:  # an integer past float range: no logprob either
    number = None
  if number is None or math.isnan(number) or number == math.inf:
    raise _Retry(f"malformed reply (logprob {repr(value)[:20]} for token {str(alt.get('token'))[:20]!r})")
  return number


def _read_body(err: urllib.error.HTTPError) -> bytes:
  try:
    return err.read() if err.fp else b""
  except (OSError, http.client.HTTPException):
    return b""


def _retry_after(headers) -> float | None:
  """Seconds from `retry-after-ms`, `Retry-After: <seconds>` or `Retry-After: <HTTP date>`; else None."""
  if not headers:
    return None
  millis = headers.get("retry-after-ms")
  try:
    if millis is not None:
      return max(0.0, float(millis) / 1000.0)
  except ValueError:
    pass
  value = headers.get("Retry-After")
  if value is None:
    return None
  try:
    return max(0.0, float(value))
  except ValueError:
    pass
  try:
    when = email.utils.parsedate_to_datetime(value)
  except (TypeError, ValueError):
    return None  # unreadable: use our own backoff
  return max(0.0, when.timestamp() - time.time())


def _excerpt(raw: bytes, limit: int = 200) -> str:
  text = raw.decode("utf-8", "replace").strip().replace("\n", " ")
  return text[:limit] + ("..." if len(text) > limit else "")
