"""The inference server: one entry point, three engines.

    python -m workloads.serve --checkpoint DIR --port 8000 --host 127.0.0.1 --model-name NAME
    python -m workloads.serve --engine vllm --checkpoint DIR --port 8000 --host 0.0.0.0 \\
        --model-name NAME --api-key-env NEMOFLOW_SERVE_API_KEY --tensor-parallel-size 4
    python -m workloads.serve --engine triton --checkpoint DIR --port 8000 ... \\
        --tensor-parallel-size 4 --max-input-len 2048 --max-output-len 2048

``--engine auto`` (the default) is decided here, on the node: vLLM where it is installed and a GPU is
visible, else ``builtin``, which serves the checkpoint itself with torch (on the GPU in bf16 when there is
one, else the CPU). ``--engine vllm`` runs vLLM's OpenAI server and ``--engine triton`` NeMo's Triton deploy
script behind a thin proxy on ``--port`` that adds the seed's NeMo-shaped endpoint, the API key check and
blue/green. Each engine is one module of :mod:`workloads.serve_engines`; this entry point asks none
which it is. Whatever the engine, clients see the same endpoints,
``/health`` is the readiness probe, and ``--join-port`` + SIGUSR1/SIGUSR2 switch servers on one port.

``DIR`` is a Hugging Face checkpoint directory: ``config.json``, safetensors weights (one file or
shards) loaded with ``from_pretrained``, and a tokenizer: ``tokenizer.model`` (sentencepiece, the
trainer's layout) or the files ``save_pretrained`` writes (``tokenizer.json``, NeMo AutoModel's
consolidated checkpoints). With ``tokenizer.model`` the built-in engine tokenizes with sentencepiece
itself, never a converted Hugging Face fast tokenizer, whose ids differ on runs of whitespace: the
server must tokenize exactly like the data pipeline did.

Endpoints (field names as in OpenAI's API reference):

- ``POST /v1/completions``: ``prompt`` (a string or a list of strings),
  ``max_tokens`` (default 16), ``temperature`` (default 1; 0 means greedy),
  ``top_p``, ``top_k`` (an extension; 0 = off), ``n`` (only 1), ``stop`` (a
  string or up to 4), ``seed``, ``stream`` (server-sent events, ``data: {...}``
  chunks then ``data: [DONE]``; ``stream_options.include_usage`` adds a usage
  chunk). A hyphenated ``max-tokens`` is read as ``max_tokens``.
- ``POST /v1/chat/completions``: ``messages`` with ``role``/``content``;
  same sampling fields; ``max_tokens`` or ``max_completion_tokens``.
- NeMo's REST shape, the seed's smoke request: ``POST /v1/chat/completions/`` (trailing slash) or
  ``/v1/completions/`` with ``{"prompt", "model", "max-tokens"|"max_tokens", "temperature", "top_p",
  "top_k"}`` answers ``{"output": "<the continuation>"}``; sampling values mean what they mean to
  NeMo's Triton/TensorRT-LLM path (``top_k: 0.9, top_p: 0`` is greedy): see
  :mod:`workloads.serve_http`. ``/v1/chat/completions/`` with ``messages`` is OpenAI chat.
- ``GET /v1/models``; ``POST /tokenize`` (vLLM's: ``{"prompt"}`` -> ``{"count", "max_model_len",
  "tokens"}``); ``GET /health`` (200 once the model is loaded, 503 while it loads: the port opens at
  once so a supervisor can tell "loading" from "dead"; also reports the queue).

API key. ``--api-key-env NAME`` names the environment variable that holds the key (the key itself
never goes on the command line); every endpoint but ``/health`` then wants ``Authorization: Bearer
<key>`` (what the openai client sends) and answers 401 otherwise. Binding a non-loopback address
without a key is refused unless ``--allow-unauthenticated`` is given, which is logged as a warning.

Concurrency (built-in engine). Up to ``--max-concurrency`` requests generate at once, interleaved
token by token (one CPU model: a forward pass at a time); up to ``--max-queue`` more wait in
arrival order; beyond that a request is refused at once with 429 and a ``Retry-After`` estimate
(the openai client retries those by itself), 503 + ``Retry-After`` while the model loads. Bodies
over ``--max-body-bytes`` get 413. Memory is bounded by the model, ``--max-concurrency`` KV caches
of at most the context length, and ``--max-queue`` bodies. Queueing, not batching: on two CPU
cores a batched forward pass of a small model gains little over interleaving and would need padded
per-sequence caches; GPU clusters get continuous batching from vLLM (``--engine vllm``).

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
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input, 401 without the key,
404 for an unknown model name or route, 413 for a body too large, 429 when the queue is full,
503 while loading.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from workloads.serve_engines import ENGINES, engine_named
from workloads.serve_engines.builtin import DEFAULT_MAX_CONCURRENCY, DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS_CAP
from workloads.serve_http import DEFAULT_MAX_BODY_BYTES, check_exposure, resolve_api_key

log = logging.getLogger("nemoflow.serve")

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------- command line


def check_checkpoint(path: Path, standby: bool = False) -> None:
    """A Hugging Face checkpoint directory: config.json, safetensors (or .bin) weights, a tokenizer (on standby:
    no weights, the model's shape only)."""
    if not path.is_dir():
        raise SystemExit(f"serve: --checkpoint {path} is not a directory")
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not standby and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("model weights (*.safetensors)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer.model")
    if missing:
        raise SystemExit(
            f"serve: --checkpoint {path} lacks {', '.join(missing)} (expected a Hugging Face checkpoint: "
            "config.json, model.safetensors or shards, tokenizer.model or tokenizer.json)"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.serve",
        description="Serve one checkpoint over an OpenAI-compatible HTTP API (completions, chat, models, "
        "health) plus NeMo's REST shape, with the built-in CPU engine, vLLM or NeMo's Triton deploy. "
        "The port opens at once; /health answers 503 until the model is loaded.",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="Hugging Face checkpoint directory (a path, or gs:// copied here first)"
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory name)")
    parser.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="auto",
        help="auto (default): vllm when this node has a GPU and vLLM is installed, else builtin; builtin: this "
        "process, on the GPU when there is one (bf16), else the CPU; vllm: vLLM's OpenAI server; triton: NeMo's "
        "Triton deploy script (in the NeMo container). vllm/triton run behind a proxy on --port",
    )
    auth = parser.add_argument_group("API key")
    auth.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="the environment variable holding the API key (never the key itself); clients then send "
        "'Authorization: Bearer <key>' to every endpoint but /health",
    )
    auth.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without an API key (logged as a warning at start)",
    )
    builtin = parser.add_argument_group("built-in engine")
    builtin.add_argument(
        "--max-tokens-cap",
        type=int,
        default=DEFAULT_MAX_TOKENS_CAP,
        help=f"largest max_tokens a request may ask for (default {DEFAULT_MAX_TOKENS_CAP})",
    )
    builtin.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULT_MAX_CONCURRENCY,
        help=f"requests generating at once, interleaved token by token (default {DEFAULT_MAX_CONCURRENCY})",
    )
    builtin.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting for a slot; more get 429 + Retry-After (default {DEFAULT_MAX_QUEUE})",
    )
    builtin.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    builtin.add_argument("--no-bos", action="store_true", help="do not start prompts with the BOS token")
    builtin.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    builtin.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the built-in engine runs: auto (default) = the first visible GPU if any, else the CPU",
    )
    engines = parser.add_argument_group("vllm and triton engines")
    engines.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="GPUs to shard the model over (default: the GPUs given, from CUDA_VISIBLE_DEVICES, else 1)",
    )
    engines.add_argument(
        "--max-input-len",
        type=int,
        help="longest prompt in tokens (triton; vllm: with --max-output-len sets --max-model-len)",
    )
    engines.add_argument(
        "--max-output-len", type=int, help="most tokens generated per request (triton; vllm: see --max-input-len)"
    )
    engines.add_argument(
        "--engine-port", type=int, help="loopback port of the engine behind the proxy (default: a free one)"
    )
    engines.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the engine's own command line, verbatim (repeatable; "
        "e.g. --engine-arg=--gpu-memory-utilization=0.85)",
    )
    engines.add_argument("--vllm-executable", default="vllm", help="the vllm command (default: vllm on PATH)")
    engines.add_argument(
        "--python",
        dest="vllm_python",
        help="the Python of vLLM's own environment (scripts/setup.sh --engine-venv); default "
        "$NEMOFLOW_VLLM_PYTHON, else --vllm-executable",
    )
    engines.add_argument(
        "--triton-script",
        default="/opt/NeMo/scripts/deploy/nlp/deploy_triton.py",
        help="NeMo's deploy_triton.py (default: its place in the NeMo container)",
    )
    engines.add_argument("--triton-model-repository", help="folder for the TensorRT-LLM engine (NeMo's default: /tmp)")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="start before the checkpoint exists: --checkpoint holds only its config.json and tokenizer; the engine "
        "runs on random weights of that shape and serves nothing (503) until POST /nemoflow/load "
        '{"checkpoint": DIR} loads the trained weights in place (engines that can: vllm)',
    )
    parser.add_argument(
        "--join-port",
        type=int,
        help="blue/green: a port another server already serves (bound with SO_REUSEPORT); this server "
        "starts listening there too on SIGUSR1 (after it was checked on --port) and stops on SIGUSR2",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("max_tokens_cap", "max_concurrency", "max_body_bytes", "tensor_parallel_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"serve: --{name.replace('_', '-')} must be at least 1, got {value}")
    if args.max_queue < 0:
        raise SystemExit(f"serve: --max-queue must be 0 or more, got {args.max_queue}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from workloads.staging import local_checkpoint

    # gs://: a local copy of every file its MANIFEST.json lists (reused while the objects are unchanged)
    try:
        checkpoint = Path(local_checkpoint(args.checkpoint)).expanduser().resolve()
    except FileNotFoundError as exc:
        raise SystemExit(f"serve: --checkpoint {args.checkpoint}: {exc}") from None
    check_checkpoint(checkpoint, standby=args.standby)
    api_key = resolve_api_key(args.api_key_env)
    check_exposure(args.host, api_key, args.allow_unauthenticated)
    model_name = args.model_name or checkpoint.name
    engine = engine_named(args.engine).on_node(args)  # auto: decided here, where the server runs
    log.info("engine: %s", engine.engine)
    if args.standby and not engine.can_standby:
        print(
            f"serve: --standby: the {engine.engine} engine cannot load weights into a running server "
            "(engines that can: " + ", ".join(n for n, cls in ENGINES.items() if cls.can_standby and n != "auto") + ")",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return engine.serve(args, checkpoint, model_name, api_key)


if __name__ == "__main__":
    sys.exit(main())
