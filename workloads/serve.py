"""An OpenAI-compatible inference server for one checkpoint, on CPU with torch.

    python -m workloads.serve --checkpoint DIR --port 8000 --host 127.0.0.1 --model-name NAME

``DIR`` is the trainer's layout: ``config.json`` + ``model.safetensors``
(``save_pretrained`` of a LlamaForCausalLM or MixtralForCausalLM) and
``tokenizer.model`` (sentencepiece). The tokenizer is used through
sentencepiece itself, never converted to a Hugging Face fast tokenizer, whose
ids differ on runs of whitespace: the server must tokenize exactly like the
data pipeline did.

Endpoints (field names as in OpenAI's API reference):

- ``POST /v1/completions``: ``prompt`` (a string or a list of strings),
  ``max_tokens`` (default 16), ``temperature`` (default 1; 0 means greedy),
  ``top_p``, ``top_k`` (an extension; 0 = off), ``n`` (only 1), ``stop`` (a
  string or up to 4), ``seed``, ``stream`` (server-sent events, ``data: {...}``
  chunks then ``data: [DONE]``; ``stream_options.include_usage`` adds a usage
  chunk). The NeMo/Triton deploy body of the seed scripts is accepted too:
  ``{"prompt", "model", "max-tokens", "temperature", "top_p", "top_k"}``.
- ``POST /v1/chat/completions``: ``messages`` with ``role``/``content``;
  same sampling fields; ``max_tokens`` or ``max_completion_tokens``.
- ``GET /v1/models``; ``GET /health`` (200 once the model is loaded, 503 while
  it loads: the port opens at once so a supervisor can tell "loading" from "dead").

Chat template. A model pretrained here has no chat template, so messages are
rendered as plain dialogue, a format any base model has seen in text::

    {system content}            (only if there is a system message, then a blank line)
    User: {content}
    Assistant: {content}
    ...
    Assistant:

and generation stops at ``"\\nUser:"`` (besides ``stop`` and end of sequence),
so a base model does not write the user's next turn. The reply is stripped of
surrounding whitespace.

The prompt starts with the BOS token (``--no-bos`` turns that off, for models
trained on documents that start without it). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 404 for
an unknown model name or route, 503 while loading.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("nemoflow.serve")

DEFAULT_MAX_TOKENS_CAP = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_STOP = "\nUser:"
MAX_STOP_STRINGS = 4
REQUIRED_FILES = ("config.json", "tokenizer.model")


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI error field's name
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------- request bodies


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


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON body to a request model; errors name the offending field, as OpenAI does."""
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    # The NeMo/Triton deploy scripts send "max-tokens"; OpenAI clients send "max_tokens".
    if "max-tokens" in body:
        value = body.pop("max-tokens")
        if body.get("max_tokens") not in (None, value):
            raise bad_request("'max_tokens' and 'max-tokens' disagree; send one of them", param="max_tokens")
        body["max_tokens"] = value
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        where = ".".join(str(p) for p in first["loc"])
        kind = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=param, code=kind) from exc


# ---------------------------------------------------------------- generation


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "length" | "stop"


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop string (not yet safe to stream)."""
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold


class Engine:
    """One model and its sentencepiece tokenizer.

    Forward passes are serialised by a lock (one CPU model: parallel passes would only
    fight over the cores); concurrent requests interleave step by step, each with its own
    KV cache.
    """

    def __init__(self, checkpoint: Path, add_bos: bool = True, threads: int | None = None):
        self.checkpoint = checkpoint
        self.add_bos = add_bos
        self.threads = threads
        self.model = None
        self.sp = None
        self.context_length = 0
        self.lock = threading.Lock()

    def load(self) -> None:
        import sentencepiece
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        started = time.monotonic()
        sp = sentencepiece.SentencePieceProcessor(model_file=str(self.checkpoint / "tokenizer.model"))
        model = AutoModelForCausalLM.from_pretrained(str(self.checkpoint), dtype=torch.float32)
        model.eval()
        vocab = model.config.vocab_size
        if sp.get_piece_size() > vocab:
            raise ValueError(
                f"{self.checkpoint}/tokenizer.model has {sp.get_piece_size()} pieces but the model's "
                f"vocab_size is {vocab}: the tokenizer does not belong to this checkpoint"
            )
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.sp, self.model = sp, model
        # The KV cache argument is `past_key_values` up to transformers 5.18 (NeMo AutoModel's pin), `cache` later.
        import inspect

        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "loaded %s (%s, %.1fM parameters, context %d) in %.1fs",
            self.checkpoint,
            type(model).__name__,
            params / 1e6,
            self.context_length,
            time.monotonic() - started,
        )

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.sp.bos_id()] if self.add_bos else []) + ids

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[str, Generation | None]]:
        """Yield text deltas as they become final, then ``("", Generation)`` once at the end."""
        import torch

        eos = self.sp.eos_id()
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
        out_ids: list[int] = []
        text, sent = "", 0
        finish, hit_eos = "length", False
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        cache = None
        for _ in range(params.max_tokens):
            # Lock and inference mode per step, never across a yield: a streaming client may
            # go away mid-answer (the generator is then abandoned, not resumed), and each
            # step may run on a different thread of the pool.
            with self.lock, torch.inference_mode():
                out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
                cache = getattr(out, self.cache_arg)
                next_id = self._pick(out.logits[0, -1].float(), params, generator)
            if next_id == eos:
                finish, hit_eos = "stop", True
                break
            out_ids.append(next_id)
            text = self._continuation(prompt_ids, out_ids)
            cut = _first_stop(text, params.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            # An incomplete UTF-8 sequence (byte-fallback pieces) decodes to U+FFFD until it is complete.
            safe = len(text) - _held_back(text, params.stop)
            while safe > sent and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > sent:
                yield text[sent:safe], None
                sent = safe
            input_ids = torch.tensor([[next_id]], dtype=torch.long)
        if len(text) > sent:
            yield text[sent:], None
        # The end-of-sequence token was generated too: it counts, as in OpenAI's usage.
        yield "", Generation(text, len(prompt_ids), len(out_ids) + hit_eos, finish)

    def _continuation(self, prompt_ids: list[int], out_ids: list[int]) -> str:
        """The generated text as it continues the prompt.

        sentencepiece drops the word-boundary space of the first piece it decodes
        ("▁God" alone is "God"), which would glue the completion to the prompt.
        Decoding after the last prompt token and removing that token's text keeps it.
        """
        anchor = [i for i in prompt_ids[-1:] if i != self.sp.bos_id()]
        if anchor:
            head = self.sp.decode(anchor)
            full = self.sp.decode(anchor + out_ids)
            if full.startswith(head):
                return full[len(head) :]
        return self.sp.decode(out_ids)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        result = None
        for _, done in self.stream(prompt_ids, params):
            result = done or result
        assert result is not None
        return result

    @staticmethod
    def _pick(logits, params: SamplingParams, generator) -> int:
        """Greedy, or sample after top-k and top-p (nucleus) filtering.

        A full sort of a 32000-entry vocabulary costs ~5 ms on CPU, more than a forward
        pass of a small model, so candidates come from ``topk``: the k of top_k, or for
        top_p alone the best 1024 when they already hold the requested mass (a full sort
        otherwise). Sampling inverts the cumulative distribution with one seeded draw.
        """
        import torch

        if params.greedy:
            return int(torch.argmax(logits))
        logits = logits.float() / params.temperature
        vocab = logits.numel()
        if 0 < params.top_k < vocab:
            values, ids = torch.topk(logits, params.top_k)
            probs = torch.softmax(values, dim=-1)  # renormalised over the k kept
        elif params.top_p < 1.0:
            full = torch.softmax(logits, dim=-1)
            probs, ids = torch.topk(full, min(vocab, 1024))
            if float(probs.sum()) < params.top_p:
                probs, ids = torch.sort(full, descending=True)
        else:
            probs, ids = torch.softmax(logits, dim=-1), None
        if params.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least the top token)
            cumulative = torch.cumsum(probs, dim=-1)
            probs = probs.masked_fill(cumulative - probs >= params.top_p, 0.0)
        cumulative = torch.cumsum(probs, dim=-1)
        draw = torch.rand(1, generator=generator, dtype=cumulative.dtype) * cumulative[-1]
        index = min(int(torch.searchsorted(cumulative, draw, right=True)), probs.numel() - 1)
        return int(ids[index]) if ids is not None else index


# ---------------------------------------------------------------- the HTTP application


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    created: int = field(default_factory=lambda: int(time.time()))
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None

    def load(self) -> None:
        try:
            self.engine.load()
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
    if request.model is not None and request.model != state.model_name:
        raise APIError(
            404,
            f"The model '{request.model}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )
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


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nemoflow inference server", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, kind).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return JSONResponse(bad_request(f"invalid value for '{param}': {first['msg']}", param=param).body(), 400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body()
        return JSONResponse(body, status_code=500)

    def require_ready() -> None:
        if not state.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", "server_error", code="model_loading")

    @app.get("/health")
    def health():
        if state.ready.is_set():
            return {"status": "ok", "model": state.model_name}
        return JSONResponse({"status": "loading", "model": state.model_name}, status_code=503)

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

    def respond(
        request: _Sampling,
        prompts: list[str],
        params: SamplingParams,
        chunk: Callable[[int, str | None, str | None, bool], dict],
        final: Callable[[int, str, str], dict],
        body: Callable[[list[dict], dict], dict],
        strip: bool,
    ):
        engine = state.engine
        encoded = [engine.encode_prompt(p) for p in prompts]
        for ids in encoded:
            _check_context(state, ids, params)
        if not request.stream:
            choices, prompt_tokens, completion_tokens = [], 0, 0
            for index, ids in enumerate(encoded):
                result = engine.generate(ids, params)
                text = result.text.strip() if strip else result.text
                choices.append(final(index, text, result.finish_reason))
                prompt_tokens += result.prompt_tokens
                completion_tokens += result.completion_tokens
            return body(choices, _usage(prompt_tokens, completion_tokens))
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

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        require_ready()
        req = parse_body(await request.body(), CompletionRequest)
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

        return await _run(
            respond,
            req,
            prompts,
            params,
            chunk,
            final,
            lambda choices, usage: {**head, "choices": choices, "usage": usage},
            False,
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        require_ready()
        req = parse_body(await request.body(), ChatRequest)
        if req.max_completion_tokens is not None and req.max_tokens not in (None, req.max_completion_tokens):
            raise bad_request("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
        prompt = render_chat(req.messages)
        # Without a limit a reply may use the rest of the context (as OpenAI's chat does), up to the cap.
        room = state.engine.context_length - len(state.engine.encode_prompt(prompt))
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

        return await _run(
            respond,
            req,
            [prompt],
            params,
            chunk,
            final,
            lambda choices, usage: {**head, "object": "chat.completion", "choices": choices, "usage": usage},
            True,
        )

    return app


async def _run(fn, *args):
    """Generation is CPU-bound: run it off the event loop so /health keeps answering."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


# ---------------------------------------------------------------- command line


def check_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise SystemExit(f"serve: --checkpoint {path} is not a directory")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("model.safetensors")
    if missing:
        raise SystemExit(
            f"serve: --checkpoint {path} lacks {', '.join(missing)} "
            "(expected the trainer's layout: config.json, model.safetensors, tokenizer.model)"
        )


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


class PortRelay:
    """Listen on ``shared_port`` (SO_REUSEPORT) and relay each connection to this server's own port."""

    def __init__(self, host: str, shared_port: int, target_port: int):
        self.host, self.shared_port, self.target_port = host, shared_port, target_port
        self._loop = None
        self._server = None
        self._lock = threading.Lock()

    def join(self) -> None:
        import asyncio

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
        log.info("joined port %d (relaying to %d)", self.shared_port, self.target_port)

    def leave(self) -> None:
        with self._lock:
            if self._server is None or self._loop is None:
                return
            done = threading.Event()

            def close() -> None:
                self._server.close()
                done.set()

            self._loop.call_soon_threadsafe(close)
            done.wait(5)
            self._server = None
        log.info("left port %d", self.shared_port)

    async def _relay(self, reader, writer) -> None:
        import asyncio

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.serve",
        description="Serve one checkpoint over an OpenAI-compatible HTTP API (completions, chat, models, "
        "health) on CPU. The port opens at once; /health answers 503 until the model is loaded.",
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (trainer layout)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory name)")
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=DEFAULT_MAX_TOKENS_CAP,
        help=f"largest max_tokens a request may ask for (default {DEFAULT_MAX_TOKENS_CAP})",
    )
    parser.add_argument("--no-bos", action="store_true", help="do not start prompts with the BOS token")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--join-port",
        type=int,
        help="blue/green: a port another server already serves (bound with SO_REUSEPORT); this server "
        "starts listening there too on SIGUSR1 (after it was checked on --port) and stops on SIGUSR2",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    checkpoint = args.checkpoint.expanduser().resolve()
    check_checkpoint(checkpoint)
    if args.max_tokens_cap < 1:
        raise SystemExit(f"serve: --max-tokens-cap must be at least 1, got {args.max_tokens_cap}")
    state = ServerState(
        engine=Engine(checkpoint, add_bos=not args.no_bos, threads=args.threads),
        model_name=args.model_name or checkpoint.name,
        max_tokens_cap=args.max_tokens_cap,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    )
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        print(f"serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        return 3
    if args.join_port:
        import signal

        relay = PortRelay(args.host, args.join_port, args.port)
        # Handlers only start threads: joining binds a socket and must not run inside a signal handler.
        signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=relay.join, daemon=True).start())
        signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=relay.leave, daemon=True).start())

    def load() -> None:
        try:
            state.load()
        except Exception:  # noqa: BLE001 - the load error is logged by state.load; the server must not look alive
            server.should_exit = True  # a server that cannot serve must not look alive

    threading.Thread(target=load, name="load-model", daemon=True).start()
    log.info("serving %s as %r on http://%s:%d", checkpoint, state.model_name, args.host, args.port)
    server.run(sockets=[sock])
    if state.load_error:
        # last, so it is the line a supervisor's log tail ends with
        print(f"serve: cannot serve {checkpoint}: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    # uvicorn returns when it could not bind as well; say so with a non-zero code.
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
