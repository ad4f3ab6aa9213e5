"""What nemoflow's serving proxy costs per streamed token, on the CPU, against an engine that costs nothing.

    .venv/bin/python benchmarks/bench_proxy.py [--concurrency 16 64] [--requests 128] [--tokens 256]
        [--tpot-ms 3] [--ttft-ms 20] [--repeats 3]

On the H200 (issue 32, 59069c5) vLLM behind the proxy made 9.7 % fewer output tokens/s than vLLM's own port at
concurrency 16 and its TTFT p99 was 127 ms against 73 ms: the proxy relays every streamed token as one SSE
event, in Python. Measuring that needs no GPU: the engine here is a synthetic OpenAI server (a raw ASGI app in
its own process) that streams ``--tokens`` completion events per request, the first after ``--ttft-ms``, then
one every ``--tpot-ms`` (about what vLLM's TPOT was at concurrency 16), so the only work in the path is HTTP.
The proxy is ``workloads.serve_engines.proxy.create_proxy_app`` served by uvicorn with the options
``run_engine`` gives it, in its own process, with an API key (as deployed). The clients are asyncio + httpx
streams, ``--concurrency`` at a time, each request timed from send to its first event (TTFT) and its last.

Each level runs direct (the engine's port) and through the proxy, interleaved ``--repeats`` times; the table
shows medians: output tokens/s, TTFT p50/p99, end-to-end p50, and the proxy process's CPU-seconds per 1,000
relayed tokens (from /proc). The client shares the machine's cores: compare the two rows of a level, not
levels or machines. Results go to benchmarks/out/bench_proxy.json. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_serve import free_port, wait_ready  # the benchmarks' directory is sys.path[0]

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
KEY = "sk-bench-proxy"

ENGINE = r"""
import asyncio, json, sys
import uvicorn

tokens, tpot, ttft, model = int(sys.argv[2]), float(sys.argv[3]) / 1000, float(sys.argv[4]) / 1000, sys.argv[5]
HEAD = [(b"content-type", b"text/event-stream")]


def event(i):
    choice = {"index": 0, "text": " tok%d" % i, "logprobs": None, "finish_reason": None if i < tokens - 1 else "length"}
    body = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await asyncio.sleep(ttft)
    for i in range(tokens):
        if i:
            await asyncio.sleep(tpot)
        await send({"type": "http.response.body", "body": event(i), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

# The proxy as workloads.serve_engines.proxy.run_engine serves it (the same uvicorn options; no engine child).
PROXY = r"""
import sys
import uvicorn
from workloads.serve_engines.proxy import EngineTarget, ProxyState, create_proxy_app


async def no_nemo(*args):
    return ""


target = EngineTarget(kind="bench", argv=[], env={}, base_url=sys.argv[2], health_path="/health",
                      model_name=sys.argv[3], nemo=no_nemo, openai=True)
state = ProxyState(target=target, api_key=sys.argv[4], warmed=True)
state.engine_alive.set()
config = uvicorn.Config(create_proxy_app(state), host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                        timeout_graceful_shutdown=5, loop=sys.argv[5], http=sys.argv[6])
print("uvicorn loop %s, http %s" % (config.loop, config.http), file=sys.stderr)
uvicorn.Server(config).run()
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(client, url: str, tokens: int) -> tuple[float, float, int]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": tokens, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.perf_counter()
    first, events = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                if first is None:
                    first = time.perf_counter() - started
    return first or float("nan"), time.perf_counter() - started, events


async def level(url: str, concurrency: int, requests: int, tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[tuple[float, float, int]] = []
    queue = iter(range(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:

        async def worker():
            for _ in queue:
                results.append(await one(client, url, tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ttft = sorted(r[0] for r in results)
    e2e = sorted(r[1] for r in results)
    events = sum(r[2] for r in results)
    return {
        "requests": len(results),
        "tokens": events,
        "tokens_per_s": events / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "e2e_p50_ms": 1000 * statistics.median(e2e),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tpot-ms", type=float, default=3.0)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop", default="auto", help="the proxy's uvicorn --loop (auto: as deployed)")
    parser.add_argument("--http", default="auto", help="the proxy's uvicorn --http (auto: as deployed)")
    parser.add_argument(
        "--proxy-path", help="a directory put first on the proxy's sys.path (e.g. where uvloop and httptools are)"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "bench_proxy.json"))
    args = parser.parse_args()

    env = dict(os.environ, PYTHONPATH=str(REPO))
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": REPO}
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(engine_port), str(args.tokens), str(args.tpot_ms), str(args.ttft_ms), MODEL],
        **quiet,
    )
    proxy_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [args.proxy_path, str(REPO)])))
    proxy = subprocess.Popen(
        [sys.executable, "-c", PROXY, str(proxy_port), engine_url, MODEL, KEY, args.loop, args.http],
        **{**quiet, "env": proxy_env},
    )
    rows: list[dict] = []
    try:
        wait_ready(engine_url, engine)
        wait_ready(proxy_url, proxy)
        runs: dict[tuple[int, str], list[dict]] = {}
        for repeat in range(args.repeats):
            for c in args.concurrency:
                for path, url in (("direct", engine_url), ("proxy", proxy_url)):
                    cpu = cpu_seconds(proxy.pid)
                    result = asyncio.run(level(url, c, max(args.requests, c), args.tokens))
                    result["proxy_cpu_s_per_1k_tokens"] = 1000 * (cpu_seconds(proxy.pid) - cpu) / result["tokens"]
                    runs.setdefault((c, path), []).append(result)
                    print(
                        f"repeat {repeat + 1}, concurrency {c:3d}, {path:6s}: {result['tokens_per_s']:9,.0f} tokens/s, "
                        f"TTFT p50/p99 {result['ttft_p50_ms']:.1f}/{result['ttft_p99_ms']:.1f} ms",
                        flush=True,
                    )
        for (c, path), results in runs.items():
            row = {"concurrency": c, "path": path}
            for key in results[0]:
                row[key] = statistics.median(r[key] for r in results)
            rows.append(row)
    finally:
        for proc in (proxy, engine):
            proc.terminate()
            proc.wait(timeout=30)

    print()
    print(
        "| concurrency | path | output tokens/s | TTFT p50 / p99 ms | end-to-end p50 ms | proxy CPU-s per 1k tokens |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: (r["concurrency"], r["path"])):
        cpu = f"{row['proxy_cpu_s_per_1k_tokens']:.3f}" if row["path"] == "proxy" else "-"
        print(
            f"| {row['concurrency']} | {row['path']} | {row['tokens_per_s']:,.0f} | "
            f"{row['ttft_p50_ms']:.1f} / {row['ttft_p99_ms']:.1f} | {row['e2e_p50_ms']:.0f} | {cpu} |"
        )
    for c in args.concurrency:
        direct = next(r for r in rows if r["concurrency"] == c and r["path"] == "direct")
        proxied = next(r for r in rows if r["concurrency"] == c and r["path"] == "proxy")
        cost = 100 * (1 - proxied["tokens_per_s"] / direct["tokens_per_s"])
        print(f"concurrency {c}: the proxy costs {cost:.1f} % of output tokens/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = ("requests", "tokens", "tpot_ms", "ttft_ms", "repeats", "loop", "http", "proxy_path")
    settings = {k: getattr(args, k) for k in names}
    machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
    out.write_text(json.dumps({"settings": settings, "machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
