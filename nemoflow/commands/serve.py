"""``nemoflow serve``: start, stop, smoke-test and inspect local OpenAI-compatible inference servers."""

from __future__ import annotations

import json
import sys

from nemoflow.commands import add_command

EPILOG = """\
examples:
  nemoflow serve start --checkpoint runs/tiny/checkpoints/step-60 --model-name tiny --port 8000
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "In the beginning", "model": "tiny", "max_tokens": 20}'
  NEMOFLOW_SERVE_API_KEY=$(openssl rand -hex 16) \\
    nemoflow serve start --checkpoint DIR --model-name tiny --host 0.0.0.0 --api-key-env NEMOFLOW_SERVE_API_KEY
  nemoflow serve smoke tiny                     # the seed's request (NeMo REST shape), with the key
  nemoflow serve list
  nemoflow serve status tiny
  nemoflow serve logs tiny -n 20
  nemoflow serve stop tiny

Servers run in the background (their own process group, output in a log file
under <work_dir>/services/logs) until stopped; `list` shows those started by
any process on this machine, including Prefect flow runs (deploy_inference)."""


DESCRIPTION = (
    "Manage inference servers (python -m workloads.serve) for checkpoints in the trainer's "
    "layout (config.json, model.safetensors, tokenizer.model)."
)


def register(sub) -> None:
    parser = add_command(
        sub, "serve", "start, stop and list local OpenAI-compatible inference servers", DESCRIPTION, epilog=EPILOG
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", title="actions")

    start = actions.add_parser(
        "start",
        help="start a server and wait until it answers /health",
        description="Start a server in the background; return once /health answers 200 "
        "(or fail with its last log lines and leave nothing running).",
    )
    start.add_argument("--checkpoint", required=True, help="checkpoint directory or gs:// URI")
    start.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    start.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    start.add_argument("--model-name", help="model id clients send (default: the checkpoint directory name)")
    start.add_argument("--name", help="registry name to stop it by (default: derived from the model name)")
    start.add_argument("--ready-timeout", type=float, default=120, help="seconds to wait for /health (default 120)")
    start.add_argument("--max-tokens-cap", type=int, help="largest max_tokens a request may ask for")
    start.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the API key the server requires (the key is read from the "
        "environment, never given on the command line)",
    )
    start.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow a non-loopback --host without an API key (the server logs a warning)",
    )
    from workloads.serve_engines import ENGINES

    start.add_argument("--engine", choices=list(ENGINES), default="builtin", help="inference engine (default builtin)")
    start.add_argument("--max-concurrency", type=int, help="requests generating at once (built-in engine)")
    start.add_argument("--max-queue", type=int, help="requests waiting; more get 429 (built-in engine)")
    start.set_defaults(func=run_start)

    smoke = actions.add_parser(
        "smoke",
        help="send the seed's request (or an OpenAI completion) to a server and show the answer",
        description="Smoke-test a running server: by registry name, or any --url. The seed's request is NeMo's "
        'REST shape (POST /v1/chat/completions/ with a prompt, answered {"output": ...}). Transient failures '
        "are retried with backoff.",
    )
    smoke.add_argument("name", nargs="?", help="registry name (see `nemoflow serve list`)")
    smoke.add_argument("--url", help="base URL of a server not in the registry (e.g. http://host:8000)")
    smoke.add_argument("--model", help="model name to send (default: the registered one)")
    smoke.add_argument("--prompt", default=None, help="prompt (default: the smoke test's)")
    smoke.add_argument("--max-tokens", type=int, default=None, help="max tokens (default: the seed's 2048)")
    smoke.add_argument("--shape", choices=["seed", "openai"], default="seed", help="request shape (default seed)")
    smoke.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the API key (default: the one the server was started with)",
    )
    smoke.add_argument("--timeout", type=float, default=60, help="seconds per request (default 60)")
    smoke.add_argument("--retry", type=float, default=30, help="seconds to keep retrying transient failures")
    smoke.set_defaults(func=run_smoke)

    stop = actions.add_parser("stop", help="stop a server (SIGTERM its process group, SIGKILL after a grace period)")
    stop.add_argument("name", nargs="?", help="registry name (see `nemoflow serve list`)")
    stop.add_argument("--all", action="store_true", help="stop every registered server")
    stop.add_argument("--grace", type=float, default=10, help="seconds between SIGTERM and SIGKILL (default 10)")
    stop.set_defaults(func=run_stop)

    status = actions.add_parser("status", help="show one server and probe its /health (exit 1 if not healthy)")
    status.add_argument("name")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=run_status)

    logs = actions.add_parser("logs", help="print the last lines of a server's log")
    logs.add_argument("name")
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many lines (default 50)")
    logs.set_defaults(func=run_logs)

    listing = actions.add_parser("list", help="list running servers")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=run_list)

    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def run_start(args) -> int:
    import os

    from infra import services, storage
    from infra.jobs import ServiceSpec
    from nemoflow.cli import UserError
    from tasks.serve import local_checkpoint, serve_args, service_name

    directory = local_checkpoint(args.checkpoint)
    if not os.path.isdir(directory):
        raise UserError(f"--checkpoint {args.checkpoint} is not a directory")
    model_name = args.model_name or storage.basename(args.checkpoint)  # not the cache dir of a gs:// copy
    name = service_name(args.name or model_name)
    command = [sys.executable, "-m", "workloads.serve", *serve_args(directory, args.port, model_name, args.host)]
    command += server_flags(args)
    if args.api_key_env and not os.environ.get(args.api_key_env, "").strip():
        raise UserError(f"--api-key-env {args.api_key_env}: the environment variable {args.api_key_env} is not set")
    spec = ServiceSpec(name=name, command=command, port=args.port)
    try:
        handle = services.start_service(
            spec,
            services.table_path().parent / "logs",
            host=args.host,
            ready_timeout_s=args.ready_timeout,
            checkpoint=args.checkpoint,
            model=model_name,
        )
    except services.ServiceError as exc:
        raise UserError(str(exc)) from exc
    print(f"{name}: serving {model_name} at {handle.url} (pid {handle.pid}, log {handle.log_path})")
    print(f"  try: curl -s {handle.url}/v1/models")
    print(f"  stop: nemoflow serve stop {name}")
    return 0


def server_flags(args) -> list[str]:
    """The ``python -m workloads.serve`` flags for the start options (the key by variable name only): the
    engine is a value (``--engine`` names it; its options are its model's fields), its flags its own."""
    from nemoflow.cli import UserError
    from workloads.serve_engines import ENGINES

    flags: list[str] = []
    if args.max_tokens_cap:
        flags += ["--max-tokens-cap", str(args.max_tokens_cap)]
    if args.api_key_env:
        flags += ["--api-key-env", args.api_key_env]
    if args.allow_unauthenticated:
        flags.append("--allow-unauthenticated")
    engine = ENGINES[args.engine]
    options = {name: value for name in ("max_concurrency", "max_queue") if (value := getattr(args, name)) is not None}
    for name in options:
        if name not in engine.model_fields:
            raise UserError(f"--{name.replace('_', '-')} is not an option of the {args.engine} engine")
    return flags + engine(**options).server_args()


def flag_value(command: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in a recorded command line."""
    for i, part in enumerate(command):
        if part == flag and i + 1 < len(command):
            return command[i + 1]
        if part.startswith(flag + "="):
            return part.split("=", 1)[1]
    return None


def run_smoke(args) -> int:
    from infra import services
    from nemoflow.cli import UserError
    from tasks.refs import EndpointRef
    from tasks.smoke import (
        DEFAULT_PROMPT,
        SEED_MAX_TOKENS,
        SmokeTestFailed,
        read_api_key,
        request_for,
        smoke_with_retries,
    )

    if bool(args.name) == bool(args.url):
        raise UserError("give a server name (see `nemoflow serve list`) or --url")
    api_key_env, model = args.api_key_env, args.model
    if args.name:
        entry = services.get_service(args.name)
        if entry is None:
            raise UserError(f"no server named {args.name!r} is running (see `nemoflow serve list`)")
        url, model = entry.url, model or entry.model
        api_key_env = api_key_env or flag_value(entry.command, "--api-key-env")
    else:
        url = args.url
    if not model:
        raise UserError("--model is needed with --url (the model name the server serves)")
    try:
        api_key = read_api_key(api_key_env)
    except SmokeTestFailed as exc:
        raise UserError(str(exc)) from exc
    endpoint = EndpointRef(url=url, model=model)
    _, body = request_for(args.shape, model, args.prompt or DEFAULT_PROMPT, args.max_tokens or SEED_MAX_TOKENS)
    result = smoke_with_retries(endpoint, body, args.timeout, shape=args.shape, api_key=api_key, retry_s=args.retry)
    if not result.passed:
        raise UserError(f"smoke test of {model} at {url} failed: {result.status}")
    print(f"{model} at {url} answered in {result.latency_s:.2f}s ({result.shape} request):")
    print(result.output)
    return 0


def run_stop(args) -> int:
    from infra import services
    from nemoflow.cli import UserError

    if args.all == bool(args.name):
        raise UserError("give a server name or --all (see `nemoflow serve list`)")
    names = [entry.name for entry in services.list_services()] if args.all else [args.name]
    code = 0
    for name in names:
        if services.stop_service(name, grace_s=args.grace):
            print(f"{name}: stopped")
        else:
            print(f"{name}: not running")
            code = 1
    return code if not args.all else 0


def run_status(args) -> int:
    from infra import services

    entry = services.get_service(args.name)
    if entry is None:
        print(json.dumps({"name": args.name, "running": False}) if args.json else f"{args.name}: not running")
        return 1
    healthy = services.is_healthy(entry)
    if args.json:
        print(json.dumps({**entry.model_dump(mode="json"), "running": True, "healthy": healthy}, indent=2))
    else:
        print(f"{entry.name}: {'healthy' if healthy else 'NOT healthy'} at {entry.url}")
        for key in ("model", "checkpoint", "pid", "started", "log_path"):
            print(f"  {key:<11} {getattr(entry, key)}")
    return 0 if healthy else 1


def run_list(args) -> int:
    from infra import services

    entries = services.list_services()
    if args.json:
        print(json.dumps([e.model_dump(mode="json") for e in entries], indent=2))
        return 0
    if not entries:
        print("no servers running")
        return 0
    print(f"{'NAME':<24} {'URL':<28} {'PID':>7}  {'STATE':<8} CHECKPOINT")
    for e in entries:
        print(f"{e.name:<24} {e.url:<28} {e.pid:>7}  {e.state:<8} {e.checkpoint or ''}")
    return 0


def run_logs(args) -> int:
    from infra import services
    from nemoflow.cli import UserError

    entry = services.get_service(args.name)
    if entry is None:
        raise UserError(f"no server named {args.name!r} is running (see `nemoflow serve list`)")
    for line in services.log_tail(entry.log_path, args.lines):
        print(line)
    return 0
