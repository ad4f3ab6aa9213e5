"""HTTP plumbing shared by the built-in server and the engine proxy (``python -m workloads.serve``).

- errors in OpenAI's shape (:class:`APIError`, :func:`install_error_handlers`);
- API keys: :func:`resolve_api_key` reads the key from an environment variable named on the command
  line (never the key itself), :class:`ApiKeyAuth` checks ``Authorization: Bearer <key>`` on every
  path but ``/health``, :func:`check_exposure` refuses a non-loopback bind without a key unless the
  operator opted out;
- honest backpressure: :class:`AdmissionGate` (a bounded number of generations in flight, a bounded
  wait queue, 429 + ``Retry-After`` beyond), :func:`read_body` (a bounded request body);
- NeMo's REST request shape (:class:`NemoRequest`, :func:`nemo_sampling`), see below;
- one port, two servers (blue/green): :func:`listen_socket`, :class:`PortRelay`.

The NeMo REST shape
-------------------
The seed scripts smoke-test their Triton/TensorRT-LLM deployment with::

    POST /v1/chat/completions/
    {"prompt": "...", "model": "<trt-model-name>", "max-tokens": 2048, "top_p": 0, "top_k": 0.9,
     "temperature": 1.0}

and read ``{"output": "..."}``: the continuation only. That is the shape of NeMo's deploy REST
service in front of Triton (NVIDIA/NeMo ``nemo/deploy/service/rest_model_api.py``: request model
``CompletionRequest(model, prompt, max_tokens=512, temperature=1.0, top_p=0.0, top_k=1)``, answer
``{"output": output[0][0]}``). NeMo serves it at ``/v1/completions/``; the seed posts to
``/v1/chat/completions/`` (the path NeMo's in-framework OpenAI server uses for chat). Both
trailing-slash paths answer it here; ``/v1/chat/completions/`` with ``messages`` is OpenAI chat, as
in NeMo's OpenAI server.

How the seed's odd values are handled: as NeMo's Triton path handles them, not rejected.

- ``top_k: 0.9``. ``NemoQueryLLM.query_llm`` (``nemo/deploy/nlp/query_llm.py``) sends top_k to Triton
  as ``np.full(shape, top_k, dtype=np.int_)``: a cast that truncates 0.9 to 0. (The REST service's
  pydantic field ``top_k: int`` rejects 0.9 since 2024-11 (NeMo f67f9ef60d); before that the field
  did not exist and ``n`` (default 1) was sent as top_k. Both lead to greedy decoding below.)
- ``top_p: 0``. TensorRT-LLM regularises the pair before sampling (``regularizeTopKTopP`` in its
  sampling layers): ``top_k == 0 and top_p == 0`` means greedy (top_k = 1); ``top_k > 0 and
  top_p == 0`` means plain top-k (top_p = 1). So the seed's request decodes greedily.
- ``max-tokens`` (hyphen). NeMo's pydantic model drops unknown keys, so NeMo generates its default
  512 tokens. Here it is read as ``max_tokens`` (what the seed meant), and on this route it is an
  upper bound: generation stops at the server's ``--max-tokens-cap`` or the end of the context
  window instead of failing, since the NeMo shape has no finish_reason to tell a client it was cut.
- Errors use the HTTP status and OpenAI's error body: 422 for a body NeMo's FastAPI service would
  refuse too (a missing prompt, a top_k that is not a number, values out of range), 404 for another
  model name. (NeMo answers a failure inside generation with 200 ``{"error": "An exception
  occurred"}``, which a client cannot tell from success by status.)
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ipaddress
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("nemoflow.serve")

OPEN_PATHS = frozenset({"/health"})  # what answers without an API key (supervisors probe it)
DEFAULT_MAX_BODY_BYTES = 1 << 20


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI error field's name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape, whoever raised it (routing, validation, a bug)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, kind).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return bad_request(f"invalid value for '{param}': {first['msg']}", param=param).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


# ---------------------------------------------------------------- API keys


def resolve_api_key(env_name: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The key held by the environment variable ``env_name`` (None when no name is given).

    The key travels by reference (a variable name on the command line, the value in the
    environment: a Kubernetes Secret, a Slurm job's exported environment), so it never shows in
    ``ps``, the job script or the service table.
    """
    if not env_name:
        return None
    environ = os.environ if environ is None else environ
    value = environ.get(env_name, "")
    if not value.strip():
        raise SystemExit(
            f"serve: --api-key-env {env_name}: the environment variable {env_name} is not set or empty; "
            "export the key in it (its value, not the name, is the key)"
        )
    return value.strip()


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """A server reachable from other machines needs a key, or an explicit opt-out that is logged."""
    if api_key or is_loopback(host):
        return
    if not allow_unauthenticated:
        raise SystemExit(
            f"serve: --host {host} is reachable from other machines and no API key is set: give "
            "--api-key-env NAME (the variable holding the key), or --allow-unauthenticated to serve "
            "without one"
        )
    log.warning(
        "serving on %s WITHOUT an API key (--allow-unauthenticated): anyone who can reach this port can use it",
        host,
    )


class ApiKeyAuth:
    """Pure ASGI middleware: ``Authorization: Bearer <key>`` on every path except ``/health``.

    Keys are compared as SHA-256 digests with :func:`secrets.compare_digest` (constant time,
    whatever the length sent), as vLLM's own middleware does. The answer never repeats what was
    sent.
    """

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()
        self.open_paths = open_paths

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.strip().encode("latin-1")).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or scope["path"] in self.open_paths
            or self.allowed(scope.get("headers", []))
        ):
            return await self.app(scope, receive, send)
        error = APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
            "(the openai client does so with api_key=...)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        return await error.response()(scope, receive, send)


# ---------------------------------------------------------------- backpressure


class Overloaded(APIError):
    def __init__(self, retry_after: int, message: str):
        super().__init__(
            429, message, "rate_limit_error", code="server_busy", headers={"Retry-After": str(retry_after)}
        )


class AdmissionGate:
    """At most ``max_active`` requests generate at once; at most ``max_waiting`` wait, first come
    first served; the next one is refused at once with 429 and a ``Retry-After`` estimated from
    recent service times. Lives on the event loop (every method runs on its thread).

    Memory stays bounded: a waiting request holds only its body (bounded by :func:`read_body`);
    an active one also holds one KV cache (at most the context length).
    """

    def __init__(self, max_active: int, max_waiting: int):
        if max_active < 1 or max_waiting < 0:
            raise ValueError(f"max_active must be >= 1 and max_waiting >= 0, got {max_active}, {max_waiting}")
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.active = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.refused = 0
        self._mean_s = 1.0  # exponential moving average of one request's time in a slot

    def retry_after(self) -> int:
        ahead = len(self.waiters) + self.active
        return max(1, min(60, math.ceil(self._mean_s * ahead / self.max_active)))

    async def acquire(self) -> float:
        """Wait for a slot (or raise :class:`Overloaded`); returns the time the slot was granted."""
        if self.active < self.max_active and not self.waiters:
            self.active += 1
            return time.monotonic()
        if len(self.waiters) >= self.max_waiting:
            self.refused += 1
            retry = self.retry_after()
            raise Overloaded(
                retry,
                f"the server is busy ({self.active} requests generating, {len(self.waiters)} waiting, the "
                f"limit of --max-queue {self.max_waiting}); retry after {retry}s",
            )
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            # the client went away while waiting: give back a slot handed over meanwhile
            if waiter in self.waiters:
                self.waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self.release()
            raise
        return time.monotonic()

    def release(self, granted_at: float | None = None) -> None:
        if granted_at is not None:
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - granted_at)
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.active -= 1

    def stats(self) -> dict[str, int]:
        return {"active": self.active, "waiting": len(self.waiters), "refused": self.refused}


class GatedStream:
    """An async iterator over a streaming body that holds an :class:`AdmissionGate` slot until it
    ends, fails, is closed, or is dropped unread (a client gone before the first byte): the slot
    can never leak, whichever way the response dies."""

    def __init__(self, body, gate: AdmissionGate, granted_at: float):
        self._body = body
        self._gate = gate
        self._granted_at = granted_at
        self._loop = asyncio.get_running_loop()
        self._released = False

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._gate.release(self._granted_at)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._gate.release, self._granted_at)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._body.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            closer = getattr(self._body, "aclose", None)
            if closer is not None:
                await closer()
        finally:
            self._release()

    def __del__(self):
        self._release()


class GatedStreamingResponse(StreamingResponse):
    """A streaming response that closes its :class:`GatedStream` however the response ends (a client
    that hangs up makes Starlette stop iterating without closing the iterator; a dropped iterator is
    released by the garbage collector only when nothing references it any more)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (413) before reading them all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes, this server's limit")
        chunks.append(chunk)
    return b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


def merge_hyphenated_max_tokens(body: dict[str, Any]) -> dict[str, Any]:
    """The seed scripts send ``max-tokens``; OpenAI clients send ``max_tokens``: one value."""
    if "max-tokens" in body:
        body = dict(body)
        value = body.pop("max-tokens")
        if body.get("max_tokens") not in (None, value):
            raise bad_request("'max_tokens' and 'max-tokens' disagree; send one of them", param="max_tokens")
        body["max_tokens"] = value
    return body


def validate(model: type[BaseModel], body: dict[str, Any], status: int = 400) -> BaseModel:
    """A request model from a JSON object; errors name the offending field, as OpenAI does."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        where = ".".join(str(p) for p in first["loc"])
        kind = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
        raise APIError(status, f"invalid value for '{where}': {first['msg']}", param=param, code=kind) from exc


# ---------------------------------------------------------------- the NeMo REST shape (module docstring)


class NemoRequest(BaseModel):
    """NeMo's ``rest_model_api.CompletionRequest``: same fields and defaults; unknown keys ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 0.0
    top_k: float = 1  # a number: NeMo's Triton client casts it to an integer (see nemo_sampling)


@dataclass(frozen=True)
class NemoSampling:
    max_tokens: int
    temperature: float
    top_k: int  # 0 = off, 1 = greedy
    top_p: float  # in (0, 1]

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0


def unprocessable(message: str, param: str) -> APIError:
    """NeMo's REST service is FastAPI with pydantic: a body it cannot take is a 422 there, and here."""
    return APIError(422, message, param=param, code="invalid_value")


def nemo_sampling(request: NemoRequest) -> NemoSampling:
    """NeMo/TensorRT-LLM sampling semantics (module docstring), as plain top-k/top-p values."""
    if request.max_tokens < 1:
        raise unprocessable(f"max_tokens must be at least 1, got {request.max_tokens}", "max_tokens")
    if not math.isfinite(request.top_k) or request.top_k < 0:
        raise unprocessable(f"top_k must be 0 or positive, got {request.top_k}", "top_k")
    if not 0.0 <= request.top_p <= 1.0:
        raise unprocessable(f"top_p must be between 0 and 1, got {request.top_p}", "top_p")
    if not 0.0 <= request.temperature <= 2.0:
        raise unprocessable(f"temperature must be between 0 and 2, got {request.temperature}", "temperature")
    top_k = int(request.top_k)  # NemoQueryLLM: np.full(..., top_k, dtype=np.int_) truncates toward zero
    top_p = request.top_p
    if top_k == 0 and top_p == 0.0:
        top_k = 1  # TensorRT-LLM: top_p 0 without top_k is greedy search
    elif top_k > 0 and top_p == 0.0:
        top_p = 1.0  # TensorRT-LLM: top_p 0 with a top_k is plain top-k
    return NemoSampling(max_tokens=request.max_tokens, temperature=request.temperature, top_k=top_k, top_p=top_p)


def parse_nemo(body: dict[str, Any]) -> NemoRequest:
    """The NeMo REST body; a body NeMo's service would refuse is a 422 (FastAPI's status there)."""
    try:
        merged = merge_hyphenated_max_tokens(body)
    except APIError as exc:
        raise unprocessable(exc.message, "max_tokens") from exc
    return validate(NemoRequest, merged, status=422)


# ---------------------------------------------------------------- one port, two servers (blue/green)
#
# Zero-downtime switching (the CPT refresh) uses SO_REUSEPORT rather than a reverse proxy: no extra
# long-lived process to supervise, and the port users call is held by the kernel throughout. Every
# server binds its --port with SO_REUSEPORT; a new one starts on a private port of its own, is
# health-checked and smoke-tested there, then (SIGUSR1) also listens on the shared port through an
# in-process TCP relay to itself; the old one is told to leave (SIGUSR2) and is stopped after its
# in-flight requests finish. A relay, not a second uvicorn socket, because uvicorn cannot add a
# listening socket to a running server.


def listen_socket(host: str, port: int, reuse_port: bool = True):
    """A bound, listening TCP socket; SO_REUSEPORT lets a successor server share the port."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


# setsockopt(SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF) (asm-generic/socket.h), and the one classic BPF
# instruction "return K" (BPF_RET | BPF_K).
SO_ATTACH_REUSEPORT_CBPF = 51
_BPF_RET_K = 0x06


def steer_new_connections_to_newest(sock) -> bool:
    """Make the kernel hand every new connection on this SO_REUSEPORT group to its second member.

    Without it, a SYN is hashed onto any member, and one queued on the leaving server's socket when
    it closes is reset (tcp_migrate_req is off by default): the rare ``Connection reset by peer``
    during a switch. A switch has exactly two members, the serving one (index 0) and the one that
    joined last (index 1), so the program is "return 1". Once the old one closed, index 1 no longer
    exists and the kernel falls back to its hash over the one member left. Python has no binding for
    a socket filter, so the sock_fprog struct is built here (nothing in the serving stack does this).
    Returns False, and changes nothing, where the kernel refuses it.
    """
    import ctypes
    import socket
    import struct

    program = ctypes.create_string_buffer(struct.pack("HBBI", _BPF_RET_K, 0, 0, 1))
    fprog = struct.pack("HxxxxxxQ" if struct.calcsize("P") == 8 else "HxxI", 1, ctypes.addressof(program))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError as exc:
        log.warning("could not steer new connections to this server (%s): a switch may reset a few", exc)
        return False
    return True


def _await_empty_accept_queue(sock, timeout_s: float) -> None:
    """Wait (briefly) until a listening socket holds no connection waiting for accept().

    New connections already go to the successor (:func:`steer_new_connections_to_newest`); this lets
    the event loop take the few queued before that, which closing the socket would reset. Linux
    reports a listener's accept queue length as tcp_info.tcpi_unacked (bytes 24-27).
    """
    import socket
    import struct

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
        except OSError:
            return
        if len(info) < 28 or struct.unpack_from("I", info, 24)[0] == 0:
            return
        time.sleep(0.01)


class PortRelay:
    """Listen on ``shared_port`` (SO_REUSEPORT) and relay each connection to this server's own port."""

    def __init__(self, host: str, shared_port: int, target_port: int):
        self.host, self.shared_port, self.target_port = host, shared_port, target_port
        self._loop = None
        self._server = None
        self._lock = threading.Lock()

    def join(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            try:
                sock = listen_socket(self.host, self.shared_port)
            except OSError as exc:
                log.error(
                    "cannot join port %d (%s): was its server started without SO_REUSEPORT?", self.shared_port, exc
                )
                return
            ready = threading.Event()

            def run() -> None:
                self._loop = asyncio.new_event_loop()
                self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, sock=sock))
                ready.set()
                self._loop.run_forever()

            threading.Thread(target=run, name="port-relay", daemon=True).start()
            ready.wait()
        steer_new_connections_to_newest(sock)
        log.info("joined port %d (relaying to %d)", self.shared_port, self.target_port)

    def leave(self) -> None:
        with self._lock:
            if self._server is None or self._loop is None:
                return
            done = threading.Event()

            # Here, not in close(): the loop must go on accepting while the queue drains.
            for sock in self._server.sockets:
                _await_empty_accept_queue(sock, 2.0)

            def close() -> None:
                self._server.close()
                done.set()

            self._loop.call_soon_threadsafe(close)
            done.wait(5)
            self._server = None
        log.info("left port %d", self.shared_port)

    async def _relay(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host(), self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                try:
                    if dst.can_write_eof():
                        dst.write_eof()
                except (ConnectionError, OSError, RuntimeError):
                    pass

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        for w in (writer, up_writer):
            w.close()

    def target_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else ("::1" if self.host == "::" else self.host)


def install_blue_green(host: str, join_port: int | None, own_port: int) -> None:
    """SIGUSR1: also listen on ``join_port``; SIGUSR2: stop listening there (tasks/promote.py)."""
    if not join_port:
        return
    import signal

    relay = PortRelay(host, join_port, own_port)
    # Handlers only start threads: joining binds a socket and must not run inside a signal handler.
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=relay.join, daemon=True).start())
    signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=relay.leave, daemon=True).start())
