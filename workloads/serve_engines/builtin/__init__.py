"""The built-in engine: this process serves the checkpoint with torch, on the GPU in bf16 when there is one,
else the CPU (fp32). What clients see (endpoints, NeMo's REST shape, the chat template, the API key,
concurrency and the admission queue) is described in workloads/serve.py, the server's entry point.

``Builtin`` (here) is the engine's options (``serve.engine: {engine: builtin, max_concurrency: 4}``); the
engine itself is in two modules: model.py the model and its tokenizer (:class:`Engine`), app.py the FastAPI
application (:func:`create_app`) and :func:`run_builtin`, which serves it on ``--port``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from pydantic import Field

from workloads.serve_engines.base import ServeEngine
from workloads.serve_engines.builtin.app import (
    CHAT_STOP,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS_CAP,
    MAX_STOP_STRINGS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ServerState,
    create_app,
    parse_body,
    render_chat,
    run_builtin,
)
from workloads.serve_engines.builtin.model import (
    Engine,
    Generation,
    HFTokenizer,
    SamplingParams,
    load_tokenizer,
    resolve_device,
)


class Builtin(ServeEngine):
    """nemoflow's own server: small models, CPUs, and GPUs where vLLM is not installed."""

    engine: Literal["builtin"] = "builtin"
    max_concurrency: int | None = Field(None, ge=1, description="built-in engine: requests generating at once")
    max_queue: int | None = Field(None, ge=0, description="built-in engine: requests waiting; more get 429")

    def serve(self, args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
        return run_builtin(args, checkpoint, model_name, api_key)


__all__ = [
    "CHAT_STOP",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_TOKENS_CAP",
    "MAX_STOP_STRINGS",
    "Builtin",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "Engine",
    "Generation",
    "HFTokenizer",
    "SamplingParams",
    "ServerState",
    "create_app",
    "load_tokenizer",
    "parse_body",
    "render_chat",
    "resolve_device",
    "run_builtin",
]
