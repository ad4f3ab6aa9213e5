"""The built-in engine's HTTP application: OpenAI's completions and chat, NeMo's REST shape, /tokenize, /health
(:func:`create_app`), behind the API key and the admission gate; :func:`run_builtin` serves it on ``--port``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from infra import phases
from workloads.serve_engines.builtin.model import Engine, SamplingParams
from workloads.serve_http import (
    DEFAULT_MAX_BODY_BYTES,
    AdmissionGate,
    APIError,
    ApiKeyAuth,
    GatedStream,
    GatedStreamingResponse,
    bad_request,
    install_blue_green,
    install_error_handlers,
    json_object,
    listen_socket,
    merge_hyphenated_max_tokens,
    nemo_sampling,
    parse_nemo,
    read_body,
    validate,
)

log = logging.getLogger("nemoflow.serve")

DEFAULT_MAX_TOKENS_CAP = 1024
DEFAULT_MAX_CONCURRENCY = 4
DEFAULT_MAX_QUEUE = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_STOP = "\nUser:"
MAX_STOP_STRINGS = 4


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    best_of: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


def parse_body(body: dict[str, Any], model: type[BaseModel]) -> BaseModel:
    """A JSON object to an OpenAI request model (``max-tokens`` read as ``max_tokens``)."""
    return validate(model, merge_hyphenated_max_tokens(body))


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = field(default=None, repr=False)
    created: int = field(default_factory=lambda: int(time.time()))
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None

    def load(self) -> None:
        try:
            self.engine.load()
            phases.stop()  # the server's start ends here (/health reports its phases to the deploy stage)
            self.ready.set()
        except Exception as exc:
            log.error("loading %s failed:\n%s", self.engine.checkpoint, traceback.format_exc())
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise


def render_chat(messages: list[ChatMessage]) -> str:
    """The plain dialogue template described in the module docstring."""
    system: list[str] = []
    turns: list[str] = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        content = (content or "").strip()
        if message.role in ("system", "developer"):
            system.append(content)
        elif message.role == "user":
            turns.append(f"User: {content}")
        else:
            turns.append(f"Assistant: {content}")
    head = "\n".join(system) + "\n\n" if system else ""
    return head + "\n".join(turns) + "\nAssistant:"


def _sampling(request: _Sampling, state: ServerState, max_tokens: int | None, default_max: int) -> SamplingParams:
    _check_model(state, request.model)
    if max_tokens is None:
        max_tokens = default_max
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > state.max_tokens_cap:
        raise bad_request(
            f"max_tokens {max_tokens} is above this server's cap of {state.max_tokens_cap} "
            "(python -m workloads.serve --max-tokens-cap)",
            param="max_tokens",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}", param="temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = request.top_k or 0
    if top_k < 0:
        raise bad_request(f"top_k must be 0 (off) or positive, got {top_k}", param="top_k")
    if request.n not in (None, 1):
        raise bad_request(f"only n=1 is supported, got n={request.n}", param="n", code="unsupported_value")
    if request.best_of not in (None, 1):
        raise bad_request("best_of is not supported", param="best_of", code="unsupported_parameter")
    if request.logprobs not in (None, False):
        raise bad_request("logprobs are not supported by this server", param="logprobs", code="unsupported_parameter")
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=request.seed, stop=stops
    )


def _check_context(state: ServerState, prompt_ids: list[int], params: SamplingParams) -> None:
    limit = state.engine.context_length
    if limit and len(prompt_ids) + params.max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens; the prompt has {len(prompt_ids)} tokens "
            f"and max_tokens is {params.max_tokens}. Shorten the prompt or lower max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


def create_app(state: ServerState) -> FastAPI:
    from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

    app = FastAPI(title="nemoflow inference server", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if state.api_key:
        app.add_middleware(ApiKeyAuth, api_key=state.api_key)
    gate = AdmissionGate(state.max_concurrency, state.max_queue)
    app.state.gate = gate

    def require_ready() -> None:
        if not state.ready.is_set():
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                "server_error",
                code="model_loading",
                headers={"Retry-After": "5"},
            )

    async def body_of(request: Request) -> dict[str, Any]:
        require_ready()
        return json_object(await read_body(request, state.max_body_bytes))

    async def generate(work: Callable[[], Any], stream: bool):
        """Run ``work`` (a whole answer, or a sync iterator of SSE lines) in a gate slot."""
        granted = await gate.acquire()
        if not stream:
            try:
                return await run_in_threadpool(work)
            finally:
                gate.release(granted)
        try:
            events = GatedStream(iterate_in_threadpool(work()), gate, granted)
        except BaseException:
            gate.release(granted)
            raise
        return GatedStreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    def health():
        body = {"status": "ok" if state.ready.is_set() else "loading", "model": state.model_name, **gate.stats()}
        if state.ready.is_set():
            body["phases"] = phases.report()  # how the start's seconds went (tasks/gpu_time.py)
        return JSONResponse(body, status_code=200 if state.ready.is_set() else 503)

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "nemoflow"}],
        }

    @app.get("/v1/models/{model_id}")
    def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "nemoflow"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize (the engine proxy clamps NeMo-shaped requests with it)."""
        body = await body_of(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", param="prompt")
        _check_model(state, body.get("model"))
        tokens = await run_in_threadpool(state.engine.encode_prompt, prompt)
        return {"count": len(tokens), "max_model_len": state.engine.context_length, "tokens": tokens}

    async def respond(
        request: _Sampling,
        prompts: list[str],
        params: SamplingParams,
        chunk: Callable[[int, str | None, str | None, bool], dict | None],
        final: Callable[[int, str, str], dict],
        body: Callable[[list[dict], dict], dict],
        strip: bool,
    ):
        engine = state.engine
        encoded = await run_in_threadpool(lambda: [engine.encode_prompt(p) for p in prompts])
        for ids in encoded:
            _check_context(state, ids, params)
        if not request.stream:

            def answer() -> dict:
                choices, prompt_tokens, completion_tokens = [], 0, 0
                for index, ids in enumerate(encoded):
                    result = engine.generate(ids, params)
                    text = result.text.strip() if strip else result.text
                    choices.append(final(index, text, result.finish_reason))
                    prompt_tokens += result.prompt_tokens
                    completion_tokens += result.completion_tokens
                return body(choices, _usage(prompt_tokens, completion_tokens))

            return await generate(answer, stream=False)
        include_usage = bool((request.stream_options or {}).get("include_usage"))

        def events() -> Iterator[str]:
            prompt_tokens = completion_tokens = 0
            for index, ids in enumerate(encoded):
                opening = chunk(index, None, None, True)
                if opening is not None:
                    yield _sse(opening)
                started = False
                for delta, done in engine.stream(ids, params):
                    if done is not None:
                        prompt_tokens += done.prompt_tokens
                        completion_tokens += done.completion_tokens
                        yield _sse(chunk(index, None, done.finish_reason, False))
                        break
                    if strip and not started:
                        delta = delta.lstrip()
                    if delta:
                        started = True
                        yield _sse(chunk(index, delta, None, False))
            if include_usage:
                usage_chunk = chunk(0, None, None, False)
                usage_chunk["choices"] = []
                usage_chunk["usage"] = _usage(prompt_tokens, completion_tokens)
                yield _sse(usage_chunk)
            yield "data: [DONE]\n\n"

        return await generate(events, stream=True)

    async def completions_from(body: dict[str, Any]):
        req = parse_body(body, CompletionRequest)
        if req.echo:
            raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts:
            raise bad_request("prompt must not be an empty list", param="prompt")
        params = _sampling(req, state, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}

        def chunk(index, text, finish, first):
            if first:  # completions streams have no role chunk
                return None
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "choices": [choice]}

        def final(index, text, finish):
            return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

        return await respond(
            req,
            prompts,
            params,
            chunk,
            final,
            lambda choices, usage: {**head, "choices": choices, "usage": usage},
            False,
        )

    async def chat_from(body: dict[str, Any]):
        req = parse_body(body, ChatRequest)
        if req.max_completion_tokens is not None and req.max_tokens not in (None, req.max_completion_tokens):
            raise bad_request("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
        prompt = render_chat(req.messages)
        # Without a limit a reply may use the rest of the context (as OpenAI's chat does), up to the cap.
        prompt_len = len(await run_in_threadpool(state.engine.encode_prompt, prompt))
        room = state.engine.context_length - prompt_len
        default_max = max(1, min(state.max_tokens_cap, room)) if state.engine.context_length else state.max_tokens_cap
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling(req, state, requested, default_max)
        params.stop = params.stop + [CHAT_STOP]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

        def chunk(index, text, finish, first):
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        def final(index, text, finish):
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}

        return await respond(
            req,
            [prompt],
            params,
            chunk,
            final,
            lambda choices, usage: {**head, "object": "chat.completion", "choices": choices, "usage": usage},
            True,
        )

    async def nemo_from(body: dict[str, Any]):
        """NeMo's REST shape: ``{"output": continuation}`` (see workloads.serve_http)."""
        req = parse_nemo(body)
        _check_model(state, req.model)
        sampling = nemo_sampling(req)
        ids = await run_in_threadpool(state.engine.encode_prompt, req.prompt)
        limit = state.engine.context_length
        room = limit - len(ids) if limit else state.max_tokens_cap
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens and the prompt has {len(ids)} tokens: "
                "no room to generate. Shorten the prompt.",
                param="prompt",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=min(sampling.max_tokens, state.max_tokens_cap, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        result = await generate(lambda: state.engine.generate(ids, params), stream=False)
        return {"output": result.text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completions_from(await body_of(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await chat_from(await body_of(request))

    @app.post("/v1/completions/")
    async def nemo_completions(request: Request):
        return await nemo_from(await body_of(request))

    @app.post("/v1/chat/completions/")
    async def nemo_chat(request: Request):
        body = await body_of(request)
        # NeMo's OpenAI server answers chat here; NeMo's REST service shape has a prompt (the seed's request)
        return await (chat_from(body) if "messages" in body else nemo_from(body))

    return app


def run_builtin(args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
    import uvicorn

    state = ServerState(
        engine=Engine(checkpoint, add_bos=not args.no_bos, threads=args.threads, device=args.device),
        model_name=model_name,
        max_tokens_cap=args.max_tokens_cap,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        api_key=api_key,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    )
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        print(f"serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return 3
    install_blue_green(args.host, args.join_port, args.port)

    def load() -> None:
        try:
            state.load()
        except Exception:  # noqa: BLE001 - the load error is logged by state.load; the server must not look alive
            server.should_exit = True  # a server that cannot serve must not look alive

    threading.Thread(target=load, name="load-model", daemon=True).start()
    log.info(
        "serving %s as %r on http://%s:%d (API key: %s; up to %d generating, %d queued)",
        checkpoint,
        model_name,
        args.host,
        args.port,
        f"required, from ${args.api_key_env}" if api_key else "none",
        args.max_concurrency,
        args.max_queue,
    )
    server.run(sockets=[sock])
    if state.load_error:
        # last, so it is the line a supervisor's log tail ends with
        print(f"serve: cannot serve {checkpoint}: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    # uvicorn returns when it could not bind as well; say so with a non-zero code.
    return 0 if server.started else 3
