"""The proxy's cost measured with both paths at once (benchmarks/bench_serve_vllm.py's paired rounds).

On the H200 (f1327a3) the proxy and vLLM's own port, measured one after the other, met different engine step
times (TPOT 2.3-3.1 ms from level to level): the cost came out -16 % and +14 % in two runs. The paired round
runs a client on each path at the same time against one engine. Here the engine is bench_proxy.py's synthetic
OpenAI server, the proxy the real one in front of it (as bench_proxy.py serves it), and the clients the stand-in
of ``vllm bench serve`` (tests/serve/engine_standins.py: real streamed requests, timed)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "tests" / "serve" / "engine_standins.py"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def engine_and_proxy():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_proxy
        from bench_serve import free_port, wait_ready
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": REPO}
    # 128 tokens a request, one every 3 ms, the first after 20 ms
    engine = subprocess.Popen(
        [sys.executable, "-c", bench_proxy.ENGINE, str(engine_port), "128", "3", "20", bench_proxy.MODEL], **quiet
    )
    proxy = subprocess.Popen(
        [sys.executable, "-c", bench_proxy.PROXY, str(proxy_port), engine_url, bench_proxy.MODEL, bench_proxy.KEY]
        + ["auto", "auto"],
        **quiet,
    )
    try:
        wait_ready(engine_url, engine)
        wait_ready(proxy_url, proxy)
        yield {"proxy": proxy_url, "vllm": engine_url}, bench_proxy.KEY
    finally:
        for proc in (proxy, engine):
            proc.terminate()
            proc.wait(timeout=30)


def test_paired_rounds_run_both_paths_at_once_and_the_cost_is_their_median(engine_and_proxy, tmp_path):
    targets, key = engine_and_proxy
    bench = _module("bench_serve_vllm", REPO / "benchmarks" / "bench_serve_vllm.py")
    client = [sys.executable, str(STANDINS), "vllm"]
    rounds = [bench.bench_pair(client, targets, "unused", 8, 96, tmp_path, key, r) for r in range(2)]

    for pair in rounds:
        for label in ("proxy", "vllm"):
            assert "error" not in pair[label], pair[label]
            assert pair[label]["completed"] == 96 and pair[label]["failed"] == 0
        # measured at the same time: one after the other, the windows would not overlap at all
        assert pair["overlap"] > 0.5, pair
    # the start order alternates, so that neither client is always the one alone at the start
    assert [pair["order"] for pair in rounds] == [["proxy", "vllm"], ["vllm", "proxy"]]

    report = {"levels": {}, "paired": {"8": rounds}}
    bench.summarize(report)
    cost = report["proxy_cost"]["8"]
    assert cost["method"] == "paired" and len(cost["rounds"]) == 2
    lost = [100 * (1 - r["proxy"]["output_throughput"] / r["vllm"]["output_throughput"]) for r in rounds]
    assert cost["output_tok_s_pct"] == pytest.approx(statistics.median(lost), abs=0.01)
    added = [100 * (r["proxy"]["median_ttft_ms"] / r["vllm"]["median_ttft_ms"] - 1) for r in rounds]
    assert cost["ttft_p50_pct"] == pytest.approx(statistics.median(added), abs=0.01)


def test_a_paired_round_whose_client_failed_is_an_error_not_a_cost(tmp_path):
    """A client that cannot reach its path (nothing listens on that port) leaves an error row; the summary takes
    no cost from that round."""
    bench = _module("bench_serve_vllm", REPO / "benchmarks" / "bench_serve_vllm.py")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_serve import free_port
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    dead = {"proxy": f"http://127.0.0.1:{free_port()}", "vllm": f"http://127.0.0.1:{free_port()}"}
    pair = bench.bench_pair([sys.executable, str(STANDINS), "vllm"], dead, "unused", 2, 4, tmp_path, "k", 0)
    assert "error" in pair["proxy"] and "error" in pair["vllm"]
    report = {"levels": {}, "paired": {"2": [pair]}}
    bench.summarize(report)
    assert "proxy_cost" not in report


def _children() -> set[int]:
    """This process's live child processes (from /proc: their parent pid), zombies excluded."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


def test_a_paired_round_over_its_time_leaves_no_client_running(tmp_path):
    """Paths that accept a connection and never answer: the round ends at its time limit and kills both clients
    (a serve part's time limit ends the benchmark the same way: no client may outlive it)."""
    import socket

    bench = _module("bench_serve_vllm", REPO / "benchmarks" / "bench_serve_vllm.py")
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # listening, never accepting
    try:
        targets = {label: f"http://127.0.0.1:{s.getsockname()[1]}" for label, s in zip(("proxy", "vllm"), silent)}
        before = _children()
        with pytest.raises(RuntimeError, match="paired round 0: a vllm bench client ran over 5 s"):
            bench.bench_pair([sys.executable, str(STANDINS), "vllm"], targets, "unused", 2, 4, tmp_path, "k", 0, 5)
        assert _children() - before == set()
    finally:
        for s in silent:
            s.close()
