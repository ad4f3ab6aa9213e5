"""vLLM behind nemoflow's proxy, vLLM's own port, and the built-in engine, measured with vLLM's own benchmark.

    NEMOFLOW_VLLM_PYTHON=/tmp/vllm-venv/bin/python .venv/bin/python benchmarks/bench_serve_vllm.py \\
        --out benchmarks/out/serve-vllm [--checkpoint HF_DIR] [--concurrency 1 16 64] [--requests 200]

``vllm bench serve`` (the client in the vllm package: it runs from the engine environment) with random prompts of
128 tokens and 256 output tokens (``--ignore-eos``: every request generates all 256), at each concurrency:
(a) nemoflow's deployed endpoint: ``python -m workloads.serve --engine vllm`` (the proxy, with an API key)
    -> vLLM on a loopback port;
(b) that same vLLM's own port, directly (the proxy's cost is (a) against (b), same engine, same run): at the
    ``--direct-concurrency`` levels one after the other, and in ``--paired-rounds`` rounds at each
    ``--paired-concurrency`` with a client on (a) and one on (b) at the same time (the engine serves both in the
    same steps, so its step time, which moves from level to level, is the same for both: the fair measure);
(c) the built-in engine (``--engine builtin --device cuda``) on the same checkpoint: it generates one token
    per forward pass (~20 tokens/s on an H200), so it runs ``--builtin-requests`` requests per level, not 200
    (the JSON says how many), and only at the concurrencies in ``--builtin-concurrency``.
Also: each server's start-to-ready time (process start -> /health 200) and the seed's request (NeMo REST
shape, through the proxy) timed end to end; with ``--restart``, (d) the nightly refresh's start: vLLM again, after
the first server stopped, on a new directory holding a checkpoint of the same shape (a copy), with whether vLLM
loaded its compiled graphs from its cache (nemoflow serves every checkpoint from a few stable paths:
workloads/serve_engines/vllm.py ``model_link``). The model: ``--checkpoint`` (a Hugging Face export, e.g. the GPU
demo's ``model/consolidated``), else the GPU demo's architecture (0.25B Llama, hidden 1024, 16 layers, GQA
16/8, SwiGLU 2816, Mixtral's 32000-token tokenizer) with random weights, made once under --out. Results:
OUT/bench_serve_vllm.json, rewritten after every level (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL_NAME = "bench"
KEY_ENV = "NEMOFLOW_BENCH_API_KEY"
SEED_REQUEST = {"prompt": "In the beginning", "model": MODEL_NAME, "max-tokens": 1024, "top_p": 0, "top_k": 0.9}


def make_model(dest: Path) -> Path:
    """The GPU demo's architecture with random weights (bf16), Mixtral's tokenizer.model beside it."""
    import mistral_common
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dest / "config.json").exists():
        return dest
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    tmp = dest.with_name(dest.name + ".tmp")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    model = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    (tmp / "tokenizer.model").write_bytes(model.read_bytes())
    os.replace(tmp, dest)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict, log: Path, url: str, timeout: float) -> tuple[subprocess.Popen, float]:
    """Start a server; seconds from process start to /health 200 (it exiting first is an error)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            tail = log.read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"{command[:4]} exited {proc.returncode} before ready:\n" + "\n".join(tail))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise RuntimeError(f"not ready after {timeout:.0f} s: see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# vLLM 0.26's log lines about its torch.compile cache (vllm/compilation/decorators.py, backends.py, monitor.py)
COMPILE_LOADED = ("Directly load AOT compilation from path", "Directly load the compiled graph")
COMPILED = ("Compiling a graph for compile range", "Compiling model again due to a load failure")


def compile_cache(log_text: str) -> dict:
    """What an engine's log says of vLLM's compile cache: ``hit`` (its compiled graphs loaded, none compiled),
    ``miss`` (graphs compiled: ``graphs_compiled`` of them), ``unknown`` (neither line: no compile, or not vLLM's
    log); torch.compile's seconds and the engine's init seconds as vLLM logs them; the model path it was given."""
    loaded = sum(log_text.count(line) for line in COMPILE_LOADED)
    compiled = sum(log_text.count(line) for line in COMPILED)
    took = re.findall(r"torch\.compile took ([0-9.]+) s in total", log_text)
    init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", log_text)
    model = re.findall(r"Initializing a V1 LLM engine \(v[^)]*\) with config: model='([^']*)'", log_text)
    return {
        "compile_cache": "miss" if compiled else "hit" if loaded else "unknown",
        "graphs_compiled": compiled,
        "graphs_loaded": loaded,
        "torch_compile_s": float(took[-1]) if took else None,
        "engine_init_s": float(init[-1]) if init else None,
        "model_path": model[-1] if model else None,
    }


def copy_checkpoint(source: Path, dest: Path) -> Path:
    """A checkpoint of the same shape in a new directory, as the next night's export would be: the files
    hard-linked where the file system allows (nothing vLLM reads differs), else copied."""

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, copy_function=link_or_copy)
    return dest


_SEEDS = itertools.count()  # one per level, in the order the levels run


def bench_command(
    vllm: list[str],
    url: str,
    tokenizer: str,
    concurrency: int,
    requests: int,
    out: Path,
    name: str,
    output_len: int = 256,
) -> tuple[list[str], int]:
    """One ``vllm bench serve`` command line and the seed it draws its prompts with.

    Each level draws its own prompts (a seed of its own) and warms up first with ``concurrency`` requests (vLLM's
    ``--num-warmups``). With one seed for all levels (at 59069c5 and d1f5225) the level after the first met its
    200 prompts already in vLLM's prefix cache (its log: hit rate 0.7 % after the first level, 44 % after the
    second): vLLM's own port, measured second, was compared on cached prompts with the proxy on cold ones."""
    cmd = [*vllm, "bench", "serve", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions"]
    cmd += ["--model", MODEL_NAME, "--tokenizer", tokenizer, "--dataset-name", "random"]
    seed = next(_SEEDS)
    cmd += ["--random-input-len", "128", "--random-output-len", str(output_len), "--ignore-eos", "--seed", str(seed)]
    cmd += ["--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--request-rate", "inf"]
    cmd += ["--num-warmups", str(concurrency)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    cmd += ["--ready-check-timeout-sec", "0", "--save-result", "--result-dir", str(out), "--result-filename", name]
    return cmd, seed


def bench_env(key: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OPENAI_API_KEY"] = key  # the bench client's bearer token (vLLM's benchmark reads this variable)
    return env


def result_row(out: Path, name: str, returncode: int, stderr: str) -> dict:
    """The numbers of one finished ``vllm bench serve`` (its result JSON), or the error it ended with."""
    if returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["?"])[-1], "exit": returncode}
    r = json.loads((out / name).read_text())
    keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput"]
    keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("median", "p50", "p99", "mean")]
    return {k: r[k] for k in keys if k in r}


def bench(
    vllm: list[str],
    url: str,
    tokenizer: str,
    concurrency: int,
    requests: int,
    out: Path,
    label: str,
    key: str,
    output_len: int = 256,
):
    """One ``vllm bench serve`` level on its own; its result JSON's numbers."""
    name = f"{label}-c{concurrency}.json"
    cmd, seed = bench_command(vllm, url, tokenizer, concurrency, requests, out, name, output_len)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=bench_env(key), capture_output=True, text=True, timeout=900)
    (out / f"{label}-c{concurrency}.log").write_text(proc.stdout + proc.stderr)
    row = result_row(out, name, proc.returncode, proc.stderr)
    if "error" not in row:
        row.update(requests=requests, concurrency=concurrency, seed=seed, wall_s=round(time.monotonic() - t0, 1))
    return row


def bench_pair(
    vllm: list[str],
    targets: dict[str, str],
    tokenizer: str,
    concurrency: int,
    requests: int,
    out: Path,
    key: str,
    round_no: int,
    timeout_s: float = 900,
) -> dict:
    """One round of the proxy's cost: a ``vllm bench serve`` client against each of ``targets`` (label -> URL:
    the proxy and vLLM's own port) *at the same time*, each at ``concurrency``, on the one engine behind both.

    Measured one after the other (as at f1327a3), the two paths met different engine step times: vLLM's TPOT
    moved between 2.3 and 3.1 ms from level to level on the same node, more than the 5 % the proxy may cost, and
    a repeat gave the opposite sign (-16 % and +14 %). Run together, every step serves both clients' requests in
    one batch, so what differs between them is the path. The clients start in turn (the order alternates from
    round to round, so neither is always alone first); each one's start-up (imports) and warm-up requests come
    before its measured requests, and the round records when each process ran, so the overlap is on record."""
    labels = list(targets) if round_no % 2 == 0 else list(reversed(targets))
    runs = {}
    for label in labels:
        stem = f"paired-{label}-c{concurrency}-r{round_no}"
        cmd, seed = bench_command(vllm, targets[label], tokenizer, concurrency, requests, out, stem + ".json")
        with (out / f"{stem}.log").open("w") as log:
            proc = subprocess.Popen(cmd, env=bench_env(key), stdout=log, stderr=subprocess.STDOUT)
        runs[label] = {"proc": proc, "stem": stem, "seed": seed, "started": time.monotonic()}
    deadline = time.monotonic() + timeout_s
    try:
        while any("ended" not in run for run in runs.values()):
            for run in runs.values():
                if "ended" not in run and run["proc"].poll() is not None:
                    run["ended"] = time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"paired round {round_no}: a vllm bench client ran over {timeout_s:g} s")
            time.sleep(0.05)
    finally:  # a time limit's SIGTERM (sys.exit in main) or the deadline: no client outlives the round
        for run in runs.values():
            if run["proc"].poll() is None:
                run["proc"].kill()
                run["proc"].wait()
    rows = {}
    for label, run in runs.items():
        log = (out / f"{run['stem']}.log").read_text()
        rows[label] = result_row(out, run["stem"] + ".json", run["proc"].returncode, log)
        rows[label].update(requests=requests, concurrency=concurrency, seed=run["seed"])
    # when each client measured: its benchmark's duration, ending when its process ended (start-up and warm-up
    # are before it); the overlap is the share of the two measured windows' union during which both measured
    windows = {
        label: (run["ended"] - rows[label].get("duration", run["ended"] - run["started"]), run["ended"])
        for label, run in runs.items()
    }
    union = max(w[1] for w in windows.values()) - min(w[0] for w in windows.values())
    both = min(w[1] for w in windows.values()) - max(w[0] for w in windows.values())
    return {
        "order": labels,
        **rows,
        "wall_s": {label: round(run["ended"] - run["started"], 1) for label, run in runs.items()},
        "overlap": round(max(0.0, both) / union, 3) if union > 0 else 0.0,
    }


def run_vllm(args, report, save, serve, env, vllm, tokenizer, out, key) -> None:
    """(a) + (b): one vLLM behind the proxy; its own port known (--engine-port)."""
    port, engine_port = free_port(), free_port()
    cmd = serve + ["--port", str(port), "--engine", "vllm", "--engine-port", str(engine_port)]
    cmd += [f"--engine-arg={a}" for a in args.engine_arg]
    proxy, ready_s = start(cmd, env, out / "vllm-proxy.log", f"http://127.0.0.1:{port}", 600)
    report["vllm_start_to_ready_s"] = round(ready_s, 1)
    report["vllm_start"] = compile_cache((out / "vllm-proxy.log").read_text(errors="replace"))
    print(f"vLLM behind the proxy ready in {ready_s:.1f} s", flush=True)
    save()
    try:
        auth = {"Authorization": f"Bearer {key}"}
        times = []
        for _ in range(3):  # the seed's request (NeMo REST shape) through the proxy, end to end
            t0 = time.monotonic()
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions/", json=SEED_REQUEST, headers=auth, timeout=120
            )
            times.append(round(time.monotonic() - t0, 3))
            r.raise_for_status()
        report["seed_request_s"] = times
        report["seed_request_output_chars"] = len(r.json()["output"])
        save()
        for c in args.concurrency:
            targets = [("proxy", f"http://127.0.0.1:{port}"), ("vllm", f"http://127.0.0.1:{engine_port}")]
            if args.direct_concurrency is not None and c not in args.direct_concurrency:
                targets = targets[:1]  # the proxy's cost is measured at the other levels
            for label, url in targets:
                row = bench(vllm, url, tokenizer, c, max(args.requests, c), out, label, key)
                report["levels"].setdefault(label, {})[str(c)] = row
                print(label, c, json.dumps(row), flush=True)
                save()
        targets = {"proxy": f"http://127.0.0.1:{port}", "vllm": f"http://127.0.0.1:{engine_port}"}
        for c in args.paired_concurrency:
            for round_no in range(args.paired_rounds):
                requests = max(args.paired_requests or args.requests, c)
                pair = bench_pair(vllm, targets, tokenizer, c, requests, out, key, round_no)
                report.setdefault("paired", {}).setdefault(str(c), []).append(pair)
                print("paired", c, round_no, json.dumps(pair), flush=True)
                save()
    finally:
        stop(proxy)


def run_vllm_restart(args, report, save, serve, env, vllm, tokenizer, out, key) -> None:
    """(d) the nightly refresh's start: the first server stopped, vLLM behind the proxy again on a copy of the
    checkpoint in a new directory; start-to-ready, the seed's request, and its compile cache (compile_cache)."""
    ckpt = Path(serve[serve.index("--checkpoint") + 1])
    night = out / "next-checkpoint"
    shutil.rmtree(night, ignore_errors=True)
    copy = copy_checkpoint(ckpt, night / ckpt.name)
    port = free_port()
    cmd = [*serve[: serve.index("--checkpoint") + 1], str(copy), *serve[serve.index("--checkpoint") + 2 :]]
    cmd += ["--port", str(port), "--engine", "vllm", *[f"--engine-arg={a}" for a in args.engine_arg]]
    log = out / "vllm-restart.log"
    restart: dict = {"checkpoint": str(copy)}
    try:
        proxy, ready_s = start(cmd, env, log, f"http://127.0.0.1:{port}", 600)
        restart["start_to_ready_s"] = round(ready_s, 1)
        try:
            t0 = time.monotonic()
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions/",
                json=SEED_REQUEST,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            r.raise_for_status()
            restart["seed_request_s"] = round(time.monotonic() - t0, 3)
        finally:
            stop(proxy)
    except (RuntimeError, httpx.HTTPError) as exc:  # the levels measured stand; the report says what failed
        text = str(exc)
        restart["error"] = text if len(text) <= 1000 else f"{text[:300]} ... {text[-600:]}"  # what and how it ended
    finally:
        shutil.rmtree(night, ignore_errors=True)
    if log.exists():
        restart.update(compile_cache(log.read_text(errors="replace")))
    report["vllm_restart"] = restart
    print("vLLM restarted on a new checkpoint directory:", json.dumps(restart), flush=True)
    save()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "serve-vllm")
    p.add_argument("--checkpoint", type=Path, help="a Hugging Face export (default: the GPU demo's shape, random)")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[16, 64, 1],
        help="levels, in order (the targets first: a run cut short keeps them)",
    )
    p.add_argument("--requests", type=int, default=200)
    p.add_argument(
        "--direct-concurrency",
        type=int,
        nargs="*",
        help="the levels at which vLLM's own port is measured too (default: every level)",
    )
    p.add_argument(
        "--paired-concurrency",
        type=int,
        nargs="*",
        default=[],
        help="the proxy's cost measured fairly: at each of these, a client on the proxy and one on vLLM's own port at "
        "the same time, each at this concurrency (the engine serves both in the same steps); --paired-rounds rounds",
    )
    p.add_argument("--paired-rounds", type=int, default=2, help="rounds per paired level (the start order alternates)")
    p.add_argument(
        "--paired-requests",
        type=int,
        help="requests per client in a paired round (default --requests): each client starts for about 25 s before "
        "its requests, and the two starts differ by seconds, so longer rounds overlap more (at e5b86ee: 200 requests, "
        "10-13 s of them, overlap 0.50 and 0.86)",
    )
    p.add_argument("--builtin-concurrency", type=int, nargs="*", default=[1, 16])
    p.add_argument("--builtin-requests", type=int, default=4, help="per level (at least the concurrency)")
    p.add_argument(
        "--builtin-output-len",
        type=int,
        default=256,
        help="output tokens a request for the built-in engine (default 256, vLLM's); it decodes one token a step "
        "for all its requests in turn, so its output tokens/s hardly depends on this, and 64 makes a level 4x "
        "shorter",
    )
    p.add_argument("--engine-arg", action="append", default=[], help="one more vllm serve argument (repeat)")
    p.add_argument("--skip-builtin", action="store_true", help="only vLLM (a) and (b)")
    p.add_argument(
        "--builtin-first",
        action="store_true",
        help="the built-in engine (c) before vLLM: a time limit then cuts vLLM's last levels, not (c)",
    )
    p.add_argument("--skip-vllm", action="store_true", help="only the built-in engine (c)")
    p.add_argument(
        "--restart",
        action="store_true",
        help="(d) after vLLM's levels: vLLM again on a copy of the checkpoint in a new directory (the nightly "
        "refresh's start): its start-to-ready time and whether its compiled graphs came from vLLM's cache",
    )
    p.add_argument("--builtin-device", default="cuda", help="the built-in engine's --device (default cuda)")
    p.add_argument("--model-dir", type=Path, help="where the random-weight model is made (default: under --out)")
    return p


def main() -> int:
    from workloads.serve_engines.hf_tokenizer import tokenizer_dir
    from workloads.serve_engines.vllm import vllm_command

    args = parser().parse_args()
    # A time limit's SIGTERM (gpu_node.sh's acceptance bounds this part) ends the run through the `finally`s:
    # the servers stop and the levels measured so far stay in the JSON.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = (args.checkpoint or make_model((args.model_dir or out / "model-0.25b-random").absolute())).absolute()
    tokenizer = str(tokenizer_dir(ckpt) or ckpt)
    vllm = vllm_command()
    key = "sk-bench-" + secrets.token_hex(12)
    report: dict = {
        "checkpoint": str(ckpt),
        "command": " ".join(sys.argv),
        # the device machine's copy of the tree may carry a stale .git: gpu_node.sh passes the commit it was told
        "commit": os.environ.get("NEMOFLOW_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "host": platform.node(),
        "vllm": vllm,
        "workload": "vllm bench serve, random dataset, 128 tokens in, 256 out (--ignore-eos), a seed a level "
        "(0, 1, ... in the order run), as many warm-up requests as the concurrency",
        "levels": {},
    }

    def save() -> None:
        summarize(report)
        (out / "bench_serve_vllm.json").write_text(json.dumps(report, indent=2) + "\n")

    env = dict(os.environ, PYTHONPATH=str(REPO), **{KEY_ENV: key})
    serve = [sys.executable, "-m", "workloads.serve", "--checkpoint", str(ckpt)]
    serve += ["--model-name", MODEL_NAME, "--api-key-env", KEY_ENV]
    order = (
        [run_builtin, run_vllm, run_vllm_restart] if args.builtin_first else [run_vllm, run_vllm_restart, run_builtin]
    )
    skipped = {
        run_vllm: args.skip_vllm,
        run_vllm_restart: args.skip_vllm or not args.restart,
        run_builtin: args.skip_builtin,
    }
    for section in order:
        if not skipped[section]:
            section(args, report, save, serve, env, vllm, tokenizer, out, key)
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "levels"}, indent=1))
    return 0


def run_builtin(args, report, save, serve, env, vllm, tokenizer, out, key) -> None:
    """(c): the built-in engine on the same checkpoint, fewer requests (it makes one token per forward pass)."""
    port = free_port()
    cmd = serve + ["--port", str(port), "--engine", "builtin", "--device", args.builtin_device]
    url = f"http://127.0.0.1:{port}"
    server, ready_s = start(cmd, env, out / "builtin.log", url, 600)
    report["builtin_start_to_ready_s"] = round(ready_s, 1)
    try:
        for c in args.builtin_concurrency:
            n = max(args.builtin_requests, c)
            row = bench(vllm, url, tokenizer, c, n, out, "builtin", key, args.builtin_output_len)
            row["output_len"] = args.builtin_output_len
            row["note"] = (
                f"{n} requests of {args.builtin_output_len} output tokens, not {args.requests} of 256: the built-in "
                "engine makes one token per forward pass, one request's step at a time; "
                "it ignores ignore_eos (output tokens/s counts the tokens that came back)"
            )
            report["levels"].setdefault("builtin", {})[str(c)] = row
            print("builtin", c, json.dumps(row), flush=True)
            save()
    finally:
        stop(server)


def summarize(report: dict) -> None:
    """The proxy's cost and vLLM over the built-in engine, from the levels measured so far (rewritten with
    every save: a run its time limit cuts short keeps them). The proxy's cost comes from the paired rounds where
    they ran (the median of the rounds' costs: ``method: paired``), else from the two paths' levels measured one
    after the other (``method: sequential``)."""
    levels = report["levels"]
    for c, a in levels.get("proxy", {}).items():
        b = levels.get("vllm", {}).get(c, {})
        cost = path_cost(a, b)
        if cost:
            report.setdefault("proxy_cost", {})[c] = {**cost, "method": "sequential"}
    for c, rounds in (report.get("paired") or {}).items():
        costs = [cost for cost in (path_cost(r.get("proxy", {}), r.get("vllm", {})) for r in rounds) if cost]
        if costs:
            ttft = [x["ttft_p50_pct"] for x in costs if "ttft_p50_pct" in x]
            report.setdefault("proxy_cost", {})[c] = {
                "output_tok_s_pct": round(statistics.median(x["output_tok_s_pct"] for x in costs), 2),
                **({"ttft_p50_pct": round(statistics.median(ttft), 2)} if ttft else {}),
                "method": "paired",
                "rounds": costs,
            }
    builtin16 = levels.get("builtin", {}).get("16", {}).get("output_throughput")
    if builtin16 and levels.get("proxy", {}).get("16", {}).get("output_throughput"):
        report["vllm_over_builtin_c16"] = round(levels["proxy"]["16"]["output_throughput"] / builtin16, 1)


def path_cost(proxy: dict, direct: dict) -> dict | None:
    """What the proxy costs against vLLM's own port: % of output tokens/s lost, % added to TTFT p50."""
    if "error" in proxy or "error" in direct:
        return None
    if not (proxy.get("output_throughput") and direct.get("output_throughput")):
        return None
    cost = {"output_tok_s_pct": round(100 * (1 - proxy["output_throughput"] / direct["output_throughput"]), 2)}
    if proxy.get("median_ttft_ms") and direct.get("median_ttft_ms"):
        cost["ttft_p50_pct"] = round(100 * (proxy["median_ttft_ms"] / direct["median_ttft_ms"] - 1), 2)
    return cost


if __name__ == "__main__":
    sys.exit(main())
