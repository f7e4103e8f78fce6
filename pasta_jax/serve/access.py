"""Who may call `pasta serve`, and how much they may send: an ASGI layer in front of the app.

With an API key, every route but /health (and the threads page's files: `app.AccessButPage`) needs `Authorization:
Bearer <key>` (checked in constant time). A request whose Origin is not allowed is refused (a browser page of
another site must not drive the server: browsers send a JSON POST only after a CORS preflight, but a `text/plain`
one without, so a POST must also be JSON), and so is a Host the server is not known by (DNS rebinding: a hostile
name that resolves to this machine; `HostRule`). A body over `HttpConfig.max_body` is a 413, decided from its
Content-Length before it is read or as soon as a chunked body passes the limit, and answered once the rest of a body
within a few times the limit is read and dropped (`DRAIN_FACTOR`: a client still sending reads the answer, not a
reset).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress

from fastapi import responses

from pasta_jax.serve.protocol import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# The rest of a body over the limit is read and dropped before its 413 while the whole body stays within
# DRAIN_FACTOR times the limit, more arrives within DRAIN_IDLE_S and all of it within DRAIN_S: a server that closes
# a connection whose body is still arriving makes its kernel reset it, and a client still sending then reads the
# reset, not the answer. Past any of them the 413 goes out at once and the connection closes.
DRAIN_FACTOR = 4
DRAIN_IDLE_S = 1.0
DRAIN_S = 5.0
WILDCARDS = frozenset({"0.0.0.0", "::", ""})  # bind addresses that listen on every interface


@dataclasses.dataclass(frozen=True)
class HttpConfig:
  """The HTTP layer's limits and access rules (`pasta serve`'s flags)."""

  api_key: str | None = dataclasses.field(default=None, repr=False)  # None: no key asked
  allow_origins: tuple[str, ...] = ()  # browser origins allowed to call (with CORS headers); "*": any
  allow_hosts: tuple[str, ...] = ()  # Host names answered besides the bound one and loopback's; "*": any
  max_body: int = 1 << 20  # bytes of a request body
  max_connections: int = 256  # open connections; past them uvicorn answers 503
  request_timeout: float | None = None  # seconds a non-streaming request may take (None: no limit)

  def __post_init__(self):
    if self.api_key is not None and not self.api_key:
      raise ValueError("api_key: an empty key would let anyone in; give a key or none")
    for name in ("max_body", "max_connections"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
    if self.request_timeout is not None and not self.request_timeout > 0:
      raise ValueError(f"request_timeout must be above 0 seconds, got {self.request_timeout}")
    object.__setattr__(self, "allow_origins", tuple(o.strip().rstrip("/").lower() for o in self.allow_origins))
    object.__setattr__(self, "allow_hosts", tuple(h.strip().rstrip(".").lower() for h in self.allow_hosts))


@dataclasses.dataclass(frozen=True)
class HostRule:
  """The Host headers a server bound to `bound`:`port` answers, against DNS rebinding (a browser page of a hostile
  name that then resolves to this machine sends that name as its Host): loopback's names and the bound address,
  with the served port or none; the `extra` names (`--allow-host`: a proxy's or the machine's name) with any port;
  and, bound to every interface (0.0.0.0, ::), any IP address, as clients elsewhere reach it by its addresses
  (a rebinding page names a host, never an address). A request without a Host (HTTP/1.0) is answered: browsers
  always send one."""

  names: frozenset[str]
  port: int | None  # None or 0: any port
  any_ip: bool = False
  extra: frozenset[str] = frozenset()

  @classmethod
  def serving(cls, bound: str, port: int | None, allow: tuple[str, ...] = ()) -> HostRule | None:
    """The rule for a server bound to `bound`:`port`; None (any Host) when `allow` holds "*"."""
    if "*" in allow:
      return None
    bound = bound.strip("[]").rstrip(".").lower()
    names = LOOPBACK_NAMES | ({bound} if bound not in WILDCARDS else set())
    return cls(frozenset(names), port or None, bound in WILDCARDS, frozenset(allow))

  def allows(self, value: str | None) -> bool:
    if value is None:
      return True
    parsed = _split_host(value)
    if parsed is None:
      return False
    name, port = parsed
    if name in self.extra:
      return True
    if port is not None and self.port is not None and port != self.port:
      return False
    if name in self.names:
      return True
    try:
      address = ipaddress.ip_address(name)
    except ValueError:
      return False
    return address.is_loopback or self.any_ip


def _split_host(value: str) -> tuple[str, int | None] | None:
  """A Host header's (name, port): IPv6 without its brackets, lowercased, no trailing dot; None if malformed."""
  value = value.strip().lower()
  if value.startswith("["):
    name, bracket, rest = value[1:].partition("]")
    if not bracket or (rest and not rest.startswith(":")):
      return None
    port = rest[1:] if rest else None
  else:
    name, colon, port = value.partition(":")
    port = port if colon else None
  if port is not None and not (port.isascii() and port.isdigit()):
    return None
  return name.rstrip("."), None if port is None else int(port)


def is_loopback(host: str) -> bool:
  """Whether binding `host` keeps the server on this machine (a name other than localhost counts as beyond)."""
  host = host.strip("[]").rstrip(".").lower()
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


class Gate:
  """The outermost checks, before anything else answers: a Host the server is not known by (`HostRule`) and an
  Origin not allowed are 403. A request without an Origin is not a browser's cross-site one. The server's own
  origin (scheme://Host, with the Host known: its own page's calls) is allowed; without a Host rule
  (`--allow-host '*'`) it is not, as a rebinding page's Host and Origin would match too."""

  def __init__(self, app, hosts: HostRule | None, origins: tuple[str, ...]):
    self.app, self.hosts, self.origins = app, hosts, frozenset(origins)

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      headers = scope["headers"]
      hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
      if self.hosts is not None and not all(self.hosts.allows(h) for h in hosts):
        return await refuse(scope, receive, send, ApiError(403, f"Host {hosts[0]!r}: this server does not answer "
                                                            "to that name (see --allow-host)", kind="permission_error"))
      own = set() if self.hosts is None else {f"{s}://{h.strip().lower()}" for h in hosts for s in ("http", "https")}
      for k, v in headers:
        origin = v.decode("latin-1").strip().rstrip("/").lower()
        if k == b"origin" and "*" not in self.origins and origin not in self.origins and origin not in own:
          return await refuse(scope, receive, send, ApiError(403, f"Origin {origin!r}: not allowed (see "
                                                              "--allow-origin)", kind="permission_error"))
    await self.app(scope, receive, send)


class Access:
  """The checks inside CORS (so a browser can read their answers): the API key (401; every route but /health), a
  POST's Content-Type (JSON, else 415) and the body's size (413: from Content-Length before reading, and while
  reading a chunked body, as soon as it passes the limit; either way after dropping the rest of a body that ends
  within the `DRAIN_FACTOR` bounds). The body is read here and handed on whole."""

  def __init__(self, app, http: HttpConfig):
    self.app, self.max_body = app, http.max_body
    self.key = None if http.api_key is None else http.api_key.encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    if self.key is not None and scope["path"] != "/health" and not self._authorized(headers.get(b"authorization")):
      return await refuse(scope, receive, send, ApiError(401, "a valid API key is needed: Authorization: Bearer "
                                                          "<key>", kind="authentication_error"),
                           {"WWW-Authenticate": "Bearer"})
    if scope["method"] == "POST":
      kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
      if kind != b"application/json":
        return await refuse(scope, receive, send, ApiError(415, "Content-Type: send the body as application/json"))
    length = headers.get(b"content-length")
    if length is not None and length.strip().isdigit() and int(length) > self.max_body:
      # a client waiting for "100 Continue" has not sent the body, and reading would ask for it
      if int(length) <= DRAIN_FACTOR * self.max_body and headers.get(b"expect", b"").lower() != b"100-continue":
        await self._drain(receive, 0)
      return await refuse(scope, receive, send, self._too_big(), {"Connection": "close"})
    if scope["method"] != "POST":
      return await self.app(scope, receive, send)
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.max_body:
        if message.get("more_body", False):
          await self._drain(receive, size)
        return await refuse(scope, receive, send, self._too_big(), {"Connection": "close"})
      chunks.append(chunk)
      if not message.get("more_body", False):
        break
    replayed = False

    async def replay():
      nonlocal replayed
      if not replayed:
        replayed = True
        return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
      return await receive()  # after the body: the client's disconnect

    await self.app(scope, replay, send)

  async def _drain(self, receive, size: int) -> None:
    """Reads and drops the rest of a refused body (`size` bytes of it read so far) until it ends, or until it passes
    DRAIN_FACTOR times the limit, pauses DRAIN_IDLE_S or takes DRAIN_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_S
    while size <= DRAIN_FACTOR * self.max_body:
      try:
        message = await asyncio.wait_for(receive(), min(DRAIN_IDLE_S, deadline - loop.time()))
      except TimeoutError:
        return
      if message["type"] == "http.disconnect" or not message.get("more_body", False):
        return
      size += len(message.get("body", b""))

  def _authorized(self, header: bytes | None) -> bool:
    scheme, _, token = (header or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

  def _too_big(self) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {self.max_body} bytes")


async def refuse(scope, receive, send, err: ApiError, headers: dict | None = None) -> None:
  await responses.JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **(headers or {})})(
      scope, receive, send)
