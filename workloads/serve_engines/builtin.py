"""The built-in engine: this process serves the checkpoint with torch, on the GPU in bf16 when there is one,
else the CPU (fp32). What clients see (endpoints, NeMo's REST shape, the chat template, the API key,
concurrency and the admission queue) is described in workloads/serve.py, the server's entry point.

``Builtin`` is the engine's options (``serve.engine: {engine: builtin, max_concurrency: 4}``); below it the
engine itself: the model and its tokenizer (:class:`Engine`), the FastAPI application (:func:`create_app`)
and :func:`run_builtin`, which serves it on ``--port``.
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
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from infra import failpoints, phases
from workloads.serve_engines.base import ServeEngine
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


class Builtin(ServeEngine):
    """nemoflow's own server: small models, CPUs, and GPUs where vLLM is not installed."""

    engine: Literal["builtin"] = "builtin"
    max_concurrency: int | None = Field(None, ge=1, description="built-in engine: requests generating at once")
    max_queue: int | None = Field(None, ge=0, description="built-in engine: requests waiting; more get 429")

    def serve(self, args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
        return run_builtin(args, checkpoint, model_name, api_key)


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


def parse_body(body: dict[str, Any], model: type[BaseModel]) -> BaseModel:
    """A JSON object to an OpenAI request model (``max-tokens`` read as ``max_tokens``)."""
    return validate(model, merge_hyphenated_max_tokens(body))


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


class HFTokenizer:
    """sentencepiece's interface over a transformers tokenizer.

    For checkpoints without ``tokenizer.model`` whose tokenizer was written by ``save_pretrained``
    (``tokenizer.json`` / ``tokenizer_config.json``, as NeMo AutoModel's consolidated checkpoints
    are). With ``tokenizer.model`` present, sentencepiece itself is used (see the module docstring).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def bos_id(self) -> int:
        return -1 if self.tokenizer.bos_token_id is None else int(self.tokenizer.bos_token_id)

    def eos_id(self) -> int:
        return -1 if self.tokenizer.eos_token_id is None else int(self.tokenizer.eos_token_id)

    def get_piece_size(self) -> int:
        return len(self.tokenizer)


def load_tokenizer(checkpoint: Path):
    """sentencepiece on ``tokenizer.model`` when the checkpoint has one, else its HF tokenizer files."""
    if (checkpoint / "tokenizer.model").is_file():
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(checkpoint / "tokenizer.model"))
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(checkpoint)))


class Engine:
    """One model and its sentencepiece tokenizer, on the CPU (fp32) or a GPU (bf16).

    Forward passes are serialised by a lock (one model: parallel passes would only fight
    over the cores or the GPU's queue); concurrent requests interleave step by step, each
    with its own KV cache. Sampling runs on the CPU (one vocabulary-sized row per token),
    so a seeded request picks the same tokens from the same logits on either device.
    """

    def __init__(self, checkpoint: Path, add_bos: bool = True, threads: int | None = None, device: str = "auto"):
        self.checkpoint = checkpoint
        self.add_bos = add_bos
        self.threads = threads
        self.device_choice = device
        self.device = None
        self.model = None
        self.sp = None
        self.context_length = 0
        self.lock = threading.Lock()

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        phases.switch(phases.BUILD)  # the model load; the imports before it count as the process's start
        started = time.monotonic()
        device = resolve_device(self.device_choice)
        sp = load_tokenizer(self.checkpoint)
        # bf16 on a GPU, as the trainer computes; fp32 on the CPU (bf16 matmuls are slow there)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(self.checkpoint), dtype=dtype).to(device)
        model.eval()
        self.device = device
        vocab = model.config.vocab_size
        if sp.get_piece_size() > vocab:
            raise ValueError(
                f"{self.checkpoint}: the tokenizer has {sp.get_piece_size()} pieces but the model's "
                f"vocab_size is {vocab}: the tokenizer does not belong to this checkpoint"
            )
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.sp, self.model = sp, model
        # The KV cache argument is `past_key_values` up to transformers 5.18 (NeMo AutoModel's pin), `cache` later.
        import inspect

        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "loaded %s (%s, %.1fM parameters, context %d) on %s (%s) in %.1fs",
            self.checkpoint,
            type(model).__name__,
            params / 1e6,
            self.context_length,
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            str(dtype).removeprefix("torch."),
            time.monotonic() - started,
        )

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.sp.encode(text)
        bos = self.sp.bos_id()
        return ([bos] if self.add_bos and bos >= 0 else []) + ids

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[str, Generation | None]]:
        """Yield text deltas as they become final, then ``("", Generation)`` once at the end."""
        import torch

        eos = self.sp.eos_id()
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
        out_ids: list[int] = []
        text, sent = "", 0
        finish, hit_eos = "length", False
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        cache = None
        delay_s = int(failpoints.value("serve.step_delay_ms") or 0) / 1000
        for _ in range(params.max_tokens):
            if delay_s:
                time.sleep(delay_s)
            # Lock and inference mode per step, never across a yield: a streaming client may
            # go away mid-answer (the generator is then abandoned, not resumed), and each
            # step may run on a different thread of the pool.
            with self.lock, torch.inference_mode():
                out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
                cache = getattr(out, self.cache_arg)
                next_id = self._pick(out.logits[0, -1].float().cpu(), params, generator)
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
            input_ids = torch.tensor([[next_id]], dtype=torch.long, device=self.device)
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


def resolve_device(choice: str):
    """The built-in engine's device: ``auto`` = the first visible GPU, else the CPU; ``cuda`` without one fails."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda but torch sees no GPU (CUDA_VISIBLE_DEVICES empty, no driver, or a CPU build of torch)"
        )
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


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
