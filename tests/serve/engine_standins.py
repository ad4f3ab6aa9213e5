"""Stand-ins for the GPU engines, which cannot run on this machine (no GPU; vLLM's wheels are CUDA
builds, NeMo's Triton deploy lives in the NeMo container). Each takes the engine's real command line
and serves the routes the proxy uses with the built-in engine:

    python tests/serve/engine_standins.py vllm serve CKPT --host H --port P --served-model-name M \\
        --tensor-parallel-size N [...]                      # vLLM: OpenAI API, /tokenize, /health
        [--load-format dummy]                               # random weights of CKPT's config.json; with
                                                            # VLLM_SERVER_DEV_MODE=1: /collective_rpc
                                                            # (update_config, reload_weights), /reset_prefix_cache
    python tests/serve/engine_standins.py vllm bench serve --base-url URL --num-prompts N \\
        --max-concurrency C --result-dir D --result-filename F [...]   # vLLM's benchmark client
    python tests/serve/engine_standins.py triton --hf_model_id_path CKPT --triton_model_name M \\
        --service_port P [...]                              # NeMo's REST service: /v1/completions/,
                                                            # /v1/triton_health

What they prove is the proxy's side (routes, translation, key passing, supervision), not the engines.
Each records its argv, cwd, pid and whether ``VLLM_API_KEY`` was set (never its value) to the JSON file
``$STANDIN_RECORD``. The triton stand-in writes ``nemo/deploy/service/config.json`` relative to its
working directory, as NeMo's deploy_triton.py does (so a wrong cwd fails here as it would there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here


def record(kind: str, argv: list[str]) -> None:
    path = os.environ.get("STANDIN_RECORD")
    if path:
        info = {
            "kind": kind,
            "argv": argv,
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "vllm_api_key_set": bool(os.environ.get("VLLM_API_KEY")),
            "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"),
            # set by a stand-in engine environment (tests/serve/test_vllm_env.py): how it was started
            "via": os.environ.get("STANDIN_VIA"),
            "pythonpath": os.environ.get("STANDIN_PYTHONPATH"),
        }
        Path(path).write_text(json.dumps(info))


def vllm_bench(argv: list[str]) -> int:
    """``vllm bench serve`` as benchmarks/bench_serve_vllm.py calls it: ``--num-warmups`` requests, then
    ``--num-prompts`` streamed completions at ``--max-concurrency`` against ``--base-url``, each timed by
    benchmarks/bench_proxy.py's client; vLLM's result fields (those the benchmark reads) in the result file."""
    import asyncio
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_proxy

    parser = argparse.ArgumentParser()
    parser.add_argument("subcommand", choices=["bench"])
    parser.add_argument("what", choices=["serve"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--max-concurrency", type=int, required=True)
    parser.add_argument("--num-warmups", type=int, default=0)
    parser.add_argument("--random-output-len", type=int, default=256)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--result-filename", required=True)
    args, _ = parser.parse_known_args(argv)
    url, c, tokens = args.base_url, args.max_concurrency, args.random_output_len
    if args.num_warmups:
        asyncio.run(bench_proxy.level(url, c, args.num_warmups, tokens))
    started = time.perf_counter()
    r = asyncio.run(bench_proxy.level(url, c, args.num_prompts, tokens))
    result = {
        "completed": r["requests"],
        "failed": args.num_prompts - r["requests"],
        "duration": time.perf_counter() - started,
        "output_throughput": r["tokens_per_s"],
        "median_ttft_ms": r["ttft_p50_ms"],
        "p50_ttft_ms": r["ttft_p50_ms"],
        "p99_ttft_ms": r["ttft_p99_ms"],
    }
    (Path(args.result_dir) / args.result_filename).write_text(json.dumps(result))
    return 0


def vllm(argv: list[str]) -> int:
    from workloads.serve import main

    if argv[:1] == ["bench"]:
        return vllm_bench(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("subcommand", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--load-format", default="auto")
    args, _ = parser.parse_known_args(argv)
    record("vllm", ["vllm", *argv])
    if args.load_format == "dummy":
        return vllm_dummy(args)
    serve = ["--checkpoint", args.model, "--host", args.host, "--port", str(args.port)]
    serve += ["--model-name", args.served_model_name, "--threads", "1"]
    if os.environ.get("VLLM_API_KEY"):
        serve += ["--api-key-env", "VLLM_API_KEY"]
    return main(serve)


def vllm_dummy(args) -> int:
    """vLLM's ``--load-format dummy`` and the development routes a standby server is loaded through, as vLLM 0.26
    has them: random weights of the model directory's config.json; ``update_config`` through ``/collective_rpc``
    sets the loader back to reading files, and ``reload_weights`` refuses before that ("Model reloading with
    `dummy` format", as vLLM's runner does); ``/reset_prefix_cache``. Each call is appended to
    ``$STANDIN_RECORD.calls`` (JSON lines)."""
    import shutil
    import tempfile
    import threading

    import torch
    import uvicorn
    from fastapi.responses import JSONResponse
    from transformers import AutoConfig, AutoModelForCausalLM

    from workloads.serve_engines.builtin import Engine, ServerState, create_app

    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    dummy = Path(tempfile.mkdtemp(prefix="standin-dummy-"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model)).save_pretrained(dummy)
    shutil.copy(Path(args.model) / "tokenizer.model", dummy / "tokenizer.model")
    state = ServerState(engine=Engine(dummy, threads=1), model_name=args.served_model_name)
    app = create_app(state)
    load_format = {"value": "dummy"}

    def note(call: dict) -> None:
        path = os.environ.get("STANDIN_RECORD")
        if path:
            with open(path + ".calls", "a") as fh:
                fh.write(json.dumps(call) + "\n")

    if dev_mode:

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            body = await request.json()
            method, kwargs = body.get("method"), body.get("kwargs", {})
            note({"route": "/collective_rpc", "method": method, "kwargs": kwargs})
            if method == "update_config":
                load_format["value"] = kwargs["overrides"]["load_config"]["load_format"]
                return JSONResponse({"results": [None]})
            if method == "reload_weights":
                if load_format["value"] == "dummy":
                    return JSONResponse({"error": "NotImplementedError: Model reloading with `dummy` format"}, 500)
                engine = Engine(Path(kwargs["weights_path"]), threads=1)
                engine.load()
                state.engine = engine
                return JSONResponse({"results": [None]})
            return JSONResponse({"error": f"no method {method}"}, 500)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            note({"route": "/reset_prefix_cache"})
            return JSONResponse({})

    threading.Thread(target=state.load, daemon=True).start()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def triton(argv: list[str]) -> int:
    import threading

    import uvicorn

    from workloads.serve_engines.builtin import Engine, ServerState, create_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--hf_model_id_path", required=True)
    parser.add_argument("--triton_model_name", required=True)
    parser.add_argument("--triton_port", type=int, required=True)
    parser.add_argument("--triton_http_address", required=True)
    parser.add_argument("--start_rest_service", type=bool, default=False)
    parser.add_argument("--service_http_address", required=True)
    parser.add_argument("--service_port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    record("triton", [sys.argv[0], *argv])
    if not args.start_rest_service:
        print("standin: NeMo's REST service was not asked for (--start_rest_service)", file=sys.stderr)
        return 2
    with open("nemo/deploy/service/config.json", "w") as fh:  # what deploy_triton.py does, relative to cwd
        json.dump({"triton_service_ip": args.triton_http_address, "triton_service_port": args.triton_port}, fh)
    state = ServerState(engine=Engine(Path(args.hf_model_id_path), threads=1), model_name=args.triton_model_name)
    app = create_app(state)

    @app.get("/v1/triton_health")
    def triton_health():
        from fastapi.responses import JSONResponse

        ready = state.ready.is_set()
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    threading.Thread(target=state.load, daemon=True).start()
    uvicorn.run(app, host=args.service_http_address, port=args.service_port, log_level="warning")
    return 0


if __name__ == "__main__":
    kind, rest = sys.argv[1], sys.argv[2:]
    sys.exit(vllm(rest) if kind == "vllm" else triton(rest))
