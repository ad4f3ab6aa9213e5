"""GPU engines behind ``python -m workloads.serve``: vLLM's OpenAI server, or NeMo's Triton deploy.

    python -m workloads.serve --engine vllm --checkpoint DIR --port 8000 --host 0.0.0.0 \\
        --model-name NAME --api-key-env NEMOFLOW_SERVE_API_KEY [--tensor-parallel-size N]

The process runs the engine as a child on a loopback port (``--engine-port``, default a free one)
and a thin proxy on ``--port`` in front of it. Why a proxy rather than the engine on ``--port``:

- the seed's smoke request is NeMo's REST shape (``POST /v1/chat/completions/`` with a prompt,
  answered ``{"output": ...}``, see :mod:`workloads.serve_http`); vLLM has no such route and
  Triton's REST service answers only at ``/v1/completions/``;
- one ``/health`` for every engine (vLLM's ``/health``, Triton's ``/v1/triton_health``);
- the API key checked the same way everywhere (vLLM guards only ``/v1/*``);
- blue/green on one port (``--join-port``, SIGUSR1/SIGUSR2) works as with the built-in engine.

Everything else goes to vLLM unchanged (streaming included), so the OpenAI API is vLLM's own.
NeMo's Triton REST service speaks only the NeMo shape, so with ``--engine triton`` the proxy
answers the NeMo shape, ``/v1/models`` and ``/health``; OpenAI routes get a 404 that says so.

The engine's command line comes from pure functions (:func:`vllm_argv`, :func:`triton_argv`) of our
options; the API key is never on it: vLLM reads it from ``VLLM_API_KEY`` in its environment (vLLM's
own variable), NeMo's REST service has no key and listens on loopback only. The child stays in this
process's group (a group kill stops both); when the engine exits, the proxy exits with its code;
when the proxy is told to stop (SIGTERM), it stops the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here

from workloads.serve_http import (
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    ApiKeyAuth,
    NemoSampling,
    bad_request,
    install_blue_green,
    install_error_handlers,
    json_object,
    listen_socket,
    nemo_sampling,
    parse_nemo,
    read_body,
)

log = logging.getLogger("nemoflow.serve")

ENGINE_HOST = "127.0.0.1"
STOP_GRACE_S = 30
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer", "host", "content-length"}


# ---------------------------------------------------------------- command lines (pure)


def visible_gpus(environ: dict[str, str] | None = None) -> int:
    """GPUs this process was given (Slurm and the NVIDIA device plugin set CUDA_VISIBLE_DEVICES)."""
    environ = os.environ if environ is None else environ
    devices = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not devices or devices in ("-1", "none", "void", "NoDevFiles"):
        return 0
    return len([d for d in devices.split(",") if d.strip()])


def vllm_argv(
    checkpoint: str,
    *,
    model_name: str,
    port: int,
    tensor_parallel_size: int,
    host: str = ENGINE_HOST,
    max_model_len: int | None = None,
    extra: Sequence[str] = (),
    executable: str = "vllm",
) -> list[str]:
    """``vllm serve`` for one checkpoint (vLLM's flag names; its parser checked them, see the README).

    >>> vllm_argv("/ckpt", model_name="m", port=9000, tensor_parallel_size=4)[:5]
    ['vllm', 'serve', '/ckpt', '--host', '127.0.0.1']
    """
    argv = [
        executable,
        "serve",
        checkpoint,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        model_name,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
    ]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    return argv + list(extra)


def vllm_env(api_key: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: ours, plus the key as ``VLLM_API_KEY`` (never on its command line)."""
    env = dict(os.environ if environ is None else environ)
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def triton_argv(
    checkpoint: str,
    *,
    model_name: str,
    model_type: str,
    triton_port: int,
    service_port: int,
    tensor_parallel_size: int,
    max_input_len: int,
    max_output_len: int,
    host: str = ENGINE_HOST,
    script: str = "/opt/NeMo/scripts/deploy/nlp/deploy_triton.py",
    model_repository: str | None = None,
    extra: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """NeMo's ``deploy_triton.py`` exporting a Hugging Face checkpoint to TensorRT-LLM, serving it on
    Triton with NeMo's REST service (the seed's path). Flag names are NeMo's.

    ``--start_rest_service`` is ``type=bool`` in NeMo's parser: any non-empty string is true, so it
    is given "True". ``model_type`` is the checkpoint's architecture (``LlamaForCausalLM``,
    ``MixtralForCausalLM``), the key of NeMo's Hugging Face export table.
    """
    argv = [
        python,
        script,
        "--hf_model_id_path",
        checkpoint,
        "--model_type",
        model_type,
        "--triton_model_name",
        model_name,
        "--triton_port",
        str(triton_port),
        "--triton_http_address",
        host,
        "--tensor_parallelism_size",
        str(tensor_parallel_size),
        "--max_input_len",
        str(max_input_len),
        "--max_output_len",
        str(max_output_len),
        "--start_rest_service",
        "True",
        "--service_http_address",
        host,
        "--service_port",
        str(service_port),
    ]
    if model_repository:
        argv += ["--triton_model_repository", model_repository]
    return argv + list(extra)


def triton_cwd(script: str) -> str:
    """NeMo's checkout root: deploy_triton.py writes, and its REST service reads, the relative path
    ``nemo/deploy/service/config.json``, so the script must run from there."""
    return str(Path(script).resolve().parents[3])


def checkpoint_architecture(checkpoint: Path) -> str:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        return str(config["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(
            f"serve: --engine triton needs {checkpoint}/config.json with an 'architectures' entry "
            f"(the Hugging Face export's model type): {exc}"
        ) from exc


# ---------------------------------------------------------------- the engines, as the proxy sees them


@dataclass
class EngineTarget:
    """Where the engine listens and how the proxy talks to it."""

    kind: str  # "vllm" | "triton"
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    base_url: str  # the engine's OpenAI server (vllm) or NeMo's REST service (triton)
    health_path: str
    model_name: str
    api_key: str | None = field(default=None, repr=False)
    cwd: str | None = None
    max_output_len: int | None = None
    engine_url: str | None = None  # Triton itself, for the log line

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_target(args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> EngineTarget:
    tp = args.tensor_parallel_size or max(1, visible_gpus())
    if args.engine == "vllm":
        port = args.engine_port or free_port()
        max_model_len = args.max_input_len + args.max_output_len if args.max_input_len and args.max_output_len else None
        argv = vllm_argv(
            str(checkpoint),
            model_name=model_name,
            port=port,
            tensor_parallel_size=tp,
            max_model_len=max_model_len,
            extra=args.engine_arg,
            executable=args.vllm_executable,
        )
        return EngineTarget(
            "vllm", argv, vllm_env(api_key), f"http://{ENGINE_HOST}:{port}", "/health", model_name, api_key
        )
    triton_port = args.engine_port or free_port()
    service_port = free_port()
    max_input_len = args.max_input_len or 256  # NeMo's defaults
    max_output_len = args.max_output_len or 256
    argv = triton_argv(
        str(checkpoint),
        model_name=model_name,
        model_type=checkpoint_architecture(checkpoint),
        triton_port=triton_port,
        service_port=service_port,
        tensor_parallel_size=tp,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        script=args.triton_script,
        model_repository=args.triton_model_repository,
        extra=args.engine_arg,
        python=sys.executable,
    )
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    return EngineTarget(
        "triton",
        argv,
        env,
        f"http://{ENGINE_HOST}:{service_port}",
        "/v1/triton_health",
        model_name,
        None,  # NeMo's REST service has no key; it listens on loopback only
        cwd=triton_cwd(args.triton_script),
        max_output_len=max_output_len,
        engine_url=f"http://{ENGINE_HOST}:{triton_port}",
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


def create_proxy_app(state: ProxyState):
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask

    target = state.target
    # no timeout on reads: a long generation is not an error; connecting is quick on loopback
    client = httpx.AsyncClient(base_url=target.base_url, timeout=httpx.Timeout(None, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(
        title=f"nemoflow proxy to {target.kind}", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    install_error_handlers(app)
    if state.api_key:
        app.add_middleware(ApiKeyAuth, api_key=state.api_key)

    def unreachable(exc: Exception) -> APIError:
        return APIError(
            503,
            f"the {target.kind} engine is not answering ({type(exc).__name__}); it may still be loading",
            "server_error",
            code="engine_unavailable",
            headers={"Retry-After": "5"},
        )

    @app.get("/health")
    async def health():
        status, detail = 503, "loading"
        if not state.engine_alive.is_set():
            detail = "engine exited"
        else:
            try:
                response = await client.get(target.health_path, timeout=5)
                if response.status_code == 200:
                    status, detail = 200, "ok"
            except httpx.HTTPError:
                pass
        return JSONResponse({"status": detail, "model": target.model_name, "engine": target.kind}, status)

    async def nemo_vllm(prompt: str, sampling: NemoSampling) -> str:
        max_tokens = sampling.max_tokens
        try:
            counted = await client.post(
                "/tokenize", json={"model": target.model_name, "prompt": prompt}, headers=target.auth_headers()
            )
            if counted.status_code == 200:
                info = counted.json()
                room = int(info["max_model_len"]) - int(info["count"])
                if room < 1:
                    raise bad_request(
                        f"This model's maximum context length is {info['max_model_len']} tokens and the prompt "
                        f"has {info['count']} tokens: no room to generate. Shorten the prompt.",
                        param="prompt",
                        code="context_length_exceeded",
                    )
                max_tokens = min(max_tokens, room)
        except httpx.HTTPError as exc:
            raise unreachable(exc) from exc
        payload: dict[str, Any] = {"model": target.model_name, "prompt": prompt, "max_tokens": max_tokens}
        if sampling.greedy:
            payload["temperature"] = 0.0
        else:
            payload.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.top_k > 1:
                payload["top_k"] = sampling.top_k
        try:
            response = await client.post("/v1/completions", json=payload, headers=target.auth_headers())
        except httpx.HTTPError as exc:
            raise unreachable(exc) from exc
        body = _json_or_none(response)
        if response.status_code != 200 or not isinstance(body, dict):
            raise _engine_error(target.kind, response.status_code, body, response.text)
        return body["choices"][0]["text"]

    async def nemo_triton(prompt: str, sampling: NemoSampling) -> str:
        payload = {
            "model": target.model_name,
            "prompt": prompt,
            "max_tokens": min(sampling.max_tokens, target.max_output_len or sampling.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        try:
            response = await client.post("/v1/completions/", json=payload)
        except httpx.HTTPError as exc:
            raise unreachable(exc) from exc
        body = _json_or_none(response)
        # NeMo's REST service answers failures as 200 {"error": "An exception occurred"}
        if response.status_code != 200 or not isinstance(body, dict) or "output" not in body:
            raise _engine_error(target.kind, response.status_code, body, response.text)
        return body["output"]

    async def nemo(request: Request, body: dict[str, Any]):
        req = parse_nemo(body)
        if req.model != target.model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{target.model_name}'",
                param="model",
                code="model_not_found",
            )
        sampling = nemo_sampling(req)
        generate = nemo_vllm if target.kind == "vllm" else nemo_triton
        return {"output": await generate(req.prompt, sampling)}

    async def forward(request: Request, raw: bytes):
        if target.kind != "vllm":
            raise APIError(
                404,
                f"{request.method} {request.url.path}: the triton engine serves NeMo's REST shape only "
                "(POST /v1/completions/ or /v1/chat/completions/ with a prompt); use --engine vllm for the "
                "OpenAI API",
                code="unsupported_route",
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = client.build_request(
            request.method, request.url.path, params=request.query_params, headers=headers, content=raw
        )
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            raise unreachable(exc) from exc
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers=out_headers,
            background=BackgroundTask(response.aclose),
        )

    @app.get("/v1/models")
    async def models(request: Request):
        if target.kind == "vllm":
            return await forward(request, b"")
        return {
            "object": "list",
            "data": [
                {"id": target.model_name, "object": "model", "created": state.created, "owned_by": "nemoflow-triton"}
            ],
        }

    @app.post("/v1/completions/")
    async def nemo_completions(request: Request):
        return await nemo(request, json_object(await read_body(request, state.max_body_bytes)))

    @app.post("/v1/chat/completions/")
    async def nemo_chat(request: Request):
        raw = await read_body(request, state.max_body_bytes)
        body = json_object(raw)
        if "messages" in body and target.kind == "vllm":
            request.scope["path"] = "/v1/chat/completions"  # vLLM's chat, without its slash redirect
            return await forward(request, raw)
        return await nemo(request, body)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def passthrough(request: Request, path: str):
        return await forward(request, await read_body(request, state.max_body_bytes))

    return app


def _json_or_none(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _engine_error(kind: str, status: int, body: Any, text: str) -> APIError:
    """An engine's error passed on: its own status and message when it gave one (4xx), else 502."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else (error or text[:300])
    if 400 <= status < 500 and isinstance(error, dict):
        return APIError(
            status, message, error.get("type") or "invalid_request_error", error.get("param"), error.get("code")
        )
    return APIError(502, f"the {kind} engine failed (HTTP {status}): {message}", "server_error", code="engine_error")


# ---------------------------------------------------------------- supervision


def run_engine(args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
    """Start the engine, serve the proxy until told to stop or the engine exits; the exit code says which."""
    import uvicorn

    target = build_target(args, checkpoint, model_name, api_key)
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
    try:
        child = subprocess.Popen(target.argv, env=target.env, cwd=target.cwd)
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
