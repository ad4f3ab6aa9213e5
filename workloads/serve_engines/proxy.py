"""The proxy and supervisor in front of an engine that runs as a child process (vLLM, NeMo's Triton deploy).

    python -m workloads.serve --engine vllm --checkpoint DIR --port 8000 --host 0.0.0.0 \\
        --model-name NAME --api-key-env NEMOFLOW_SERVE_API_KEY [--tensor-parallel-size N]

The process runs the engine as a child on a loopback port (``--engine-port``, default a free one)
and a thin proxy on ``--port`` in front of it. Why a proxy rather than the engine on ``--port``:

- the seed's smoke request is NeMo's REST shape (``POST /v1/chat/completions/`` with a prompt,
  answered ``{"output": ...}``, see :mod:`workloads.serve_http`); vLLM has no such route and
  Triton's REST service answers only at ``/v1/completions/``;
- one ``/health`` for every engine (vLLM's ``/health``, Triton's ``/v1/triton_health``);
- the API key checked the same way everywhere (vLLM guards only ``/v1/*``);
- blue/green on one port (``--join-port``, SIGUSR1/SIGUSR2) works as with the built-in engine;
- a server started on standby (``--standby``: the engine on random weights of the model's shape, started while the
  model trains) refuses model routes with 503 until ``POST /nemoflow/load {"checkpoint", "fingerprint"}`` loads
  the validated checkpoint into it (once; the engine's ``load``), and its ``/health`` says ``standby``, then
  ``ok`` with what it serves.

Everything else goes to vLLM unchanged (streaming included), so the OpenAI API is vLLM's own.
NeMo's Triton REST service speaks only the NeMo shape, so with ``--engine triton`` the proxy
answers the NeMo shape, ``/v1/models`` and ``/health``; OpenAI routes get a 404 that says so.

The engine's command line comes from pure functions of its options (``vllm.vllm_argv``,
``triton.triton_argv``), and what differs between engines is a value (:class:`EngineTarget`: its
command, health path, whether it speaks OpenAI, its NeMo-shape adapter): the proxy never asks which
engine it fronts. The API key is checked here only: the engines listen on loopback without one (vLLM would
write a key in its environment to disk: ``vllm.vllm_env``), as NeMo's REST service has none. The child stays in this
process's group (a group kill stops both); when the engine exits, the proxy exits with its code;
when the proxy is told to stop (SIGTERM), it stops the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here
from starlette.responses import Response as StarletteResponse

from infra import phases
from workloads.serve_engines.base import ENGINE_HOST
from workloads.serve_http import (
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    ApiKeyAuth,
    NemoSampling,
    install_blue_green,
    install_error_handlers,
    json_object,
    listen_socket,
    nemo_sampling,
    parse_nemo,
    read_body,
)

log = logging.getLogger("nemoflow.serve")

STOP_GRACE_S = 30
# One short greedy generation through the engine's own NeMo adapter before /health first says ok: an engine
# that answers its health check may still initialise lazily on its first request, and whoever waits for ready
# (the deploy stage, a blue/green switch) then routes users to a server that has answered once. (vLLM 0.26 on
# an H200 at 59069c5: 0.06 s for this first generation, so it was warm already; Triton's is not measured.)
WARM_UP = NemoSampling(max_tokens=8, temperature=0.0, top_k=1, top_p=1.0)
WARM_UP_PROMPT = "Hello"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer", "host", "content-length"}


# ---------------------------------------------------------------- the engines, as the proxy sees them


# The engine's answer to NeMo's REST shape: (client, target, prompt, sampling) -> the generated text.
NemoAdapter = Callable[[Any, "EngineTarget", str, NemoSampling], Awaitable[str]]
# How a standby engine loads a checkpoint's weights in place: (client, target, checkpoint directory) -> None.
WeightLoader = Callable[[Any, "EngineTarget", str], Awaitable[None]]


@dataclass
class EngineTarget:
    """Where the engine listens and how the proxy talks to it (built by the engine's module)."""

    kind: str  # the engine's name, for logs, /health and errors
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    base_url: str  # the engine's OpenAI server (vllm) or NeMo's REST service (triton)
    health_path: str
    model_name: str
    nemo: NemoAdapter  # how the engine answers NeMo's REST shape
    openai: bool = False  # the engine serves the OpenAI API itself: the proxy forwards those routes
    api_key: str | None = field(default=None, repr=False)
    cwd: str | None = None
    max_output_len: int | None = None
    engine_url: str | None = None  # Triton itself, for the log line
    pass_fds: tuple[int, ...] = ()  # open files the engine inherits (vLLM: its model path's lock)
    # started on standby (``--standby``): the engine runs on random weights of the model's shape and serves nothing
    # until POST /nemoflow/load gives it a checkpoint, which ``load`` loads in place (vLLM: reload_weights)
    standby: bool = False
    load: WeightLoader | None = None
    # the path prefixes passed through to the engine (None: every path); a standby vLLM has its development
    # routes on (/collective_rpc, /sleep, ...), which must never be reachable from outside
    forward_only: tuple[str, ...] | None = None

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def unreachable(target: EngineTarget, exc: Exception) -> APIError:
    return APIError(
        503,
        f"the {target.kind} engine is not answering ({type(exc).__name__}); it may still be loading",
        "server_error",
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


def free_port(host: str = ENGINE_HOST) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the proxy


@dataclass
class ProxyState:
    target: EngineTarget
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_alive: threading.Event = field(default_factory=threading.Event)
    created: int = field(default_factory=lambda: int(time.time()))
    warmed: bool = False  # the warm-up generation ran (WARM_UP): /health says ok only after it
    # where the server's start went: the proxy's start and imports, the engine's start (run_engine switches to
    # "server start" as it launches the engine), the warm-up generation; /health reports them once ready, as the
    # built-in engine does, so the deploy stage itemises an engine's start (tasks/gpu_time.py)
    timer: phases.Timer = field(default_factory=phases.timer, repr=False)
    serves: dict[str, Any] | None = None  # a standby server: the checkpoint (and deploy fingerprint) it loaded


class Relay(StarletteResponse):
    """The engine's response relayed to the client as it arrives: an ASGI response (what a FastAPI route
    returns that is a ``Response`` is called with the connection's ``send``).

    Each chunk the engine sends goes on as one ``http.response.body`` message, with nothing between them
    (Starlette's StreamingResponse wraps each in its own task group's work). A client that goes away
    stops the relay and closes the engine's connection, so that the engine stops generating for it.
    """

    def __init__(self, upstream):  # nothing of Response's own state: the status and headers are the engine's
        self.upstream = upstream
        self.status_code = upstream.status
        self.background = None  # FastAPI sets a route's background tasks here

    async def __call__(self, scope, receive, send) -> None:
        upstream = self.upstream

        async def relay() -> None:
            headers = [(k, v) for k, v in upstream.raw_headers if k.decode("latin-1").lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(relay()), asyncio.ensure_future(client_gone())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done:
                tasks[0].result()  # the engine's stream broke: the client's connection is aborted, not ended
        finally:
            for task in tasks:
                task.cancel()
            upstream.close()  # a response read to its end went back to the pool already; otherwise the engine's
            # connection is closed, which is how the engine learns that nobody waits for the rest
        if self.background is not None:
            await self.background()


def create_proxy_app(state: ProxyState):
    import aiohttp
    import httpx
    import yarl
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    target = state.target
    # no timeout on reads: a long generation is not an error; connecting is quick on loopback
    client = httpx.AsyncClient(base_url=target.base_url, timeout=httpx.Timeout(None, connect=10.0))
    # The OpenAI routes pass through on aiohttp, not httpx: a streamed response is one SSE event per token,
    # and httpx spent 42 % of the proxy's CPU receiving them (a timeout scope and a pure-Python h11 parse per
    # read); aiohttp parses in C (benchmarks/bench_proxy.py, docs/serving.md). Made in the serving loop.
    sessions: list = []

    def relay_session():
        if not sessions or sessions[0].closed:
            sessions[:] = [
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
                    auto_decompress=False,  # the body goes on as the engine encoded it, with its headers
                    # only what the client sent: an encoding it never asked for would reach it still encoded
                    skip_auto_headers=("User-Agent", "Accept-Encoding"),
                )
            ]
        return sessions[0]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()
        if sessions:
            await sessions[0].close()

    app = FastAPI(
        title=f"nemoflow proxy to {target.kind}", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    install_error_handlers(app)
    if state.api_key:
        app.add_middleware(ApiKeyAuth, api_key=state.api_key)

    warm_up_lock = asyncio.Lock()
    load_lock = asyncio.Lock()

    def loaded() -> bool:
        return not target.standby or state.serves is not None

    def require_loaded() -> None:
        if not loaded():
            raise APIError(
                503,
                "no model is loaded yet: this server was started before its checkpoint existed (serve.start_early) "
                "and serves once the deploy stage loads the validated checkpoint",
                "server_error",
                code="model_not_loaded",
                headers={"Retry-After": "10"},
            )

    async def warm_up() -> None:
        started = time.monotonic()
        try:
            await target.nemo(client, target, WARM_UP_PROMPT, WARM_UP)
            log.info("the %s engine is warm (%.2f s for its first generation)", target.kind, time.monotonic() - started)
        except (APIError, httpx.HTTPError) as exc:  # never keeps a healthy engine from serving
            log.warning("warm-up generation failed (%s); serving anyway", exc)
        state.warmed = True

    @app.get("/health")
    async def health():
        status, detail = 503, "loading"
        if not state.engine_alive.is_set():
            detail = "engine exited"
        else:
            try:
                response = await client.get(target.health_path, timeout=5)
                if response.status_code == 200 and not loaded():
                    status, detail = 200, "standby"  # up, on random weights: waits for POST /nemoflow/load
                    state.timer.stop()  # the standby server's start ends here
                elif response.status_code == 200:
                    async with warm_up_lock:
                        if not state.warmed:
                            state.timer.switch(phases.GENERATION)  # the engine is up: the warm-up generation
                            await warm_up()
                            state.timer.stop()  # the server's start ends here
                    status, detail = 200, "ok"
            except httpx.HTTPError:
                pass
        body = {"status": detail, "model": target.model_name, "engine": target.kind}
        if state.serves is not None:
            body["serves"] = state.serves
        if status == 200:
            body["phases"] = state.timer.report()
        return JSONResponse(body, status)

    @app.post("/nemoflow/load")
    async def load(request: Request):
        """Load a checkpoint into a standby engine (once): its weights in place, then one generation, which must
        differ from the random weights' (else the weights were not replaced); serving starts when this answers."""
        body = json_object(await read_body(request, state.max_body_bytes))
        checkpoint, fingerprint = body.get("checkpoint"), body.get("fingerprint")
        if not isinstance(checkpoint, str) or not checkpoint:
            raise APIError(400, "'checkpoint' must be the checkpoint directory on this node", param="checkpoint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise APIError(400, "'fingerprint' must be a string", param="fingerprint")
        if not target.standby or target.load is None:
            raise APIError(
                409, "this server was not started on standby: it serves its own checkpoint", code="not_standby"
            )
        if load_lock.locked() or state.serves is not None:
            what = state.serves["checkpoint"] if state.serves else "another checkpoint"
            raise APIError(409, f"this server loads or serves {what} already; start another", code="already_loaded")
        async with load_lock:
            if not state.engine_alive.is_set():
                raise APIError(503, f"the {target.kind} engine exited", "server_error", code="engine_unavailable")
            started = time.monotonic()
            try:
                before = await target.nemo(client, target, WARM_UP_PROMPT, WARM_UP)
                await target.load(client, target, checkpoint)
                loaded_s = time.monotonic() - started
                after = await target.nemo(client, target, WARM_UP_PROMPT, WARM_UP)
            except httpx.HTTPError as exc:
                raise unreachable(target, exc) from exc
            if after == before:
                raise APIError(
                    500,
                    f"the {target.kind} engine answers as before loading {checkpoint}: its weights were not replaced",
                    "server_error",
                    code="load_failed",
                )
            state.serves = {"checkpoint": checkpoint, "fingerprint": fingerprint}
            state.warmed = True  # the generation above was the loaded model's first
            state.timer.stop()
            seconds = time.monotonic() - started
            log.info("loaded %s into the %s engine in %.2f s; serving it", checkpoint, target.kind, seconds)
            return {
                "status": "ok",
                "checkpoint": checkpoint,
                "load_s": round(loaded_s, 3),
                "seconds": round(seconds, 3),
            }

    async def nemo(request: Request, body: dict[str, Any]):
        require_loaded()
        req = parse_nemo(body)
        if req.model != target.model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{target.model_name}'",
                param="model",
                code="model_not_found",
            )
        sampling = nemo_sampling(req)
        return {"output": await target.nemo(client, target, req.prompt, sampling)}

    async def forward(request: Request, raw: bytes):
        if not target.openai:
            raise APIError(
                404,
                f"{request.method} {request.url.path}: the {target.kind} engine serves NeMo's REST shape only "
                "(POST /v1/completions/ or /v1/chat/completions/ with a prompt); use --engine vllm for the "
                "OpenAI API",
                code="unsupported_route",
            )
        path = request.url.path
        if target.forward_only is not None and not any(path.startswith(p) for p in target.forward_only):
            raise APIError(404, f"{request.method} {path}: no such route", code="unknown_route")
        require_loaded()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        query = request.url.query
        url = yarl.URL(target.base_url + request.url.path + (f"?{query}" if query else ""), encoded=True)
        try:
            response = await relay_session().request(request.method, url, headers=headers, data=raw or None)
        except aiohttp.ClientError as exc:
            raise unreachable(target, exc) from exc
        return Relay(response)

    @app.get("/v1/models")
    async def models(request: Request):
        require_loaded()
        if target.openai:
            return await forward(request, b"")
        return {
            "object": "list",
            "data": [
                {
                    "id": target.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": f"nemoflow-{target.kind}",
                }
            ],
        }

    @app.post("/v1/completions/")
    async def nemo_completions(request: Request):
        return await nemo(request, json_object(await read_body(request, state.max_body_bytes)))

    @app.post("/v1/chat/completions/")
    async def nemo_chat(request: Request):
        raw = await read_body(request, state.max_body_bytes)
        body = json_object(raw)
        if "messages" in body and target.openai:
            request.scope["path"] = "/v1/chat/completions"  # vLLM's chat, without its slash redirect
            return await forward(request, raw)
        return await nemo(request, body)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def passthrough(request: Request, path: str):
        return await forward(request, await read_body(request, state.max_body_bytes))

    return app


def json_or_none(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def engine_error(kind: str, status: int, body: Any, text: str) -> APIError:
    """An engine's error passed on: its own status and message when it gave one (4xx), else 502."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else (error or text[:300])
    if 400 <= status < 500 and isinstance(error, dict):
        return APIError(
            status, message, error.get("type") or "invalid_request_error", error.get("param"), error.get("code")
        )
    return APIError(502, f"the {kind} engine failed (HTTP {status}): {message}", "server_error", code="engine_error")


# ---------------------------------------------------------------- supervision


def run_engine(args: argparse.Namespace, target: EngineTarget, checkpoint: Path, api_key: str | None) -> int:
    """Start the engine, serve the proxy until told to stop or the engine exits; the exit code says which."""
    import uvicorn

    model_name = target.model_name
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        print(f"serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return 3
    state = ProxyState(target=target, api_key=api_key, max_body_bytes=args.max_body_bytes)
    server = uvicorn.Server(
        uvicorn.Config(
            create_proxy_app(state), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5
        )
    )
    install_blue_green(args.host, args.join_port, args.port)
    log.info("starting the %s engine: %s", target.kind, " ".join(target.argv))
    state.timer.switch(phases.SERVER_START)  # the proxy's own start and imports end here
    try:
        child = subprocess.Popen(target.argv, env=target.env, cwd=target.cwd, pass_fds=target.pass_fds)
    except OSError as exc:
        print(f"serve: cannot start the {target.kind} engine ({target.argv[0]}): {exc}", file=sys.stderr, flush=True)
        return 4
    state.engine_alive.set()
    exit_code: dict[str, int] = {}

    def watch() -> None:
        code = child.wait()
        state.engine_alive.clear()
        exit_code["engine"] = code
        if not server.should_exit:
            log.error("the %s engine exited with code %s; stopping", target.kind, code)
            server.should_exit = True

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    log.info(
        "serving %s as %r on http://%s:%d through %s at %s (API key: %s)",
        checkpoint,
        model_name,
        args.host,
        args.port,
        target.kind,
        target.base_url,
        f"required, from ${args.api_key_env}" if api_key else "none",
    )
    # uvicorn re-raises the SIGTERM/SIGINT it caught once it has shut down: with the default handler
    # that would kill this process before it stops the engine (Kubernetes signals PID 1 only).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        stopped_by_us = child.poll() is None
        stop_child(child)
    code = exit_code.get("engine")
    if not stopped_by_us and code:
        # last, so it is the line a supervisor's log tail ends with
        print(f"serve: the {target.kind} engine exited with code {code}", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0 if server.started else 3


def stop_child(child: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
