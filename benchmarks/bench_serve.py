"""Inference server under concurrent load: requests/s and p50/p99 latency at 1, 4 and 16 clients.

    .venv/bin/python benchmarks/bench_serve.py [--clients 1 4 16] [--requests 32] [--max-tokens 32]
        [--max-concurrency 4] [--max-queue 64] [--shape openai|seed] [--repeats 3]

Model: the demo's architecture (Llama, hidden 256, 4 layers, 4 heads, ffn 688, context 256, 19.5M
parameters; what ``nemoflow demo`` trains) with random weights and Mixtral's tokenizer
(mistral-common), written once to benchmarks/out/serve-model. Server: ``python -m workloads.serve``
(the built-in CPU engine) on a free loopback port, default limits unless given. Each level runs
``--requests`` requests (at least 2 per client) from N concurrent clients (threads with their own
httpx connection), each a completion of exactly ``--max-tokens`` tokens (``ignore``-free: the
random model almost never emits end-of-sequence; the table counts the tokens that came back).
Latency is per request, end to end. A warm-up request runs first; the levels run interleaved
``--repeats`` times and the table shows medians (the machine is shared). Results go to
benchmarks/out/bench_serve.json. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
sys.path.insert(0, str(REPO))

PROMPTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void;",
    "The LORD is my shepherd; I shall not want.",
    "Blessed are the meek: for they shall inherit the earth.",
]


def build_model(dest: Path) -> Path:
    import shutil

    import mistral_common
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(0)
    from flows.end_to_end import demo_train_config
    from workloads.train.recipe import hf_model_config

    # the demo's model as the trainer builds it (with Mixtral's 32000-token vocabulary)
    values = hf_model_config(demo_train_config(), vocab_size=32000)
    assert values.pop("_target_") == "transformers.LlamaConfig"
    config = LlamaConfig(**values)
    tmp = dest.with_suffix(".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)
    shutil.copyfile(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", tmp / "tokenizer.model")
    tmp.rename(dest)
    return dest


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"server not ready after {timeout}s")


def request(shape: str, max_tokens: int, index: int) -> tuple[str, dict]:
    prompt = PROMPTS[index % len(PROMPTS)]
    if shape == "seed":
        body = {"prompt": prompt, "model": "bench", "max-tokens": max_tokens, "top_p": 0, "top_k": 0.9}
        return "/v1/chat/completions/", body
    return "/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def run_level(url: str, clients: int, total: int, shape: str, max_tokens: int) -> dict:
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    tokens = 0
    lock = threading.Lock()
    counter = iter(range(total))

    def client() -> None:
        nonlocal tokens
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                path, body = request(shape, max_tokens, index)
                started = time.monotonic()
                response = http.post(url + path, json=body)
                elapsed = time.monotonic() - started
                with lock:
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    if response.status_code == 200:
                        latencies.append(elapsed)
                        if shape == "openai":
                            tokens += response.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, max(0, round(p / 100 * len(latencies)) - 1))]

    return {
        "clients": clients,
        "requests": total,
        "ok": len(latencies),
        "statuses": statuses,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(latencies) / wall, 3),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(pct(99), 3),
        "tokens_per_s": round(tokens / wall, 1) if tokens else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32, help="requests per level (at least 2 per client)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--max-queue", type=int, default=None)
    parser.add_argument("--shape", choices=["openai", "seed"], default="openai")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the levels; the table shows medians")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model = build_model(OUT / "serve-model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "workloads.serve", "--checkpoint", str(model), "--port", str(port)]
    command += ["--model-name", "bench", "--max-tokens-cap", str(max(args.max_tokens, 16))]
    if args.max_concurrency:
        command += ["--max-concurrency", str(args.max_concurrency)]
    if args.max_queue is not None:
        command += ["--max-queue", str(args.max_queue)]
    log = (OUT / "bench_serve.log").open("w")
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=log)
    try:
        wait_ready(url, proc)
        run_level(url, 1, 1, args.shape, args.max_tokens)  # warm-up
        rounds: dict[int, list[dict]] = {c: [] for c in args.clients}
        for _ in range(args.repeats):  # interleaved: the machine is shared, single runs are noisy
            for clients in args.clients:
                rounds[clients].append(
                    run_level(url, clients, max(args.requests, 2 * clients), args.shape, args.max_tokens)
                )
        results = []
        for clients, runs in rounds.items():
            result = {
                "clients": clients,
                "runs": runs,
                **{
                    key: statistics.median(r[key] for r in runs)
                    for key in ("requests_per_s", "p50_s", "p99_s", "tokens_per_s")
                    if runs[0][key] is not None
                },
                "statuses": {code: sum(r["statuses"].get(code, 0) for r in runs) for code in runs[0]["statuses"]},
            }
            results.append(result)
            print(
                f"{clients:>3} clients: {result['requests_per_s']:.2f} req/s, p50 {result['p50_s']:.2f}s, "
                f"p99 {result['p99_s']:.2f}s, {result.get('tokens_per_s')} tok/s, statuses {result['statuses']} "
                f"(medians of {len(runs)})",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "command": " ".join(command),
        "shape": args.shape,
        "max_tokens": args.max_tokens,
        "results": results,
    }
    (OUT / "bench_serve.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
