"""The data stage at SlimPajama scale: cost per shard of cold, no-op and "1% new shards" runs.

    .venv/bin/python benchmarks/bench_scale.py [--shards 1000,2500,5000,10000] [--big 59166]
        [--sources local,http] [--big-sources local,http] [--db postgres|sqlite] [--shards-per-file 1200]

For each size N and each kind of source, a synthetic SlimPajama layout of N tiny shards
(``train/chunk{c}/example_train_{s}.jsonl.zst``, 5 JSON lines of about 400 bytes each,
~2 KB of text, as in the issue's measurement) is prepared three times with
``nemoflow prepare`` (a subprocess: the flow process, as a user runs it), against a Prefect
server on PostgreSQL (devtools/postgres.py; ``--db sqlite`` for Prefect's default):

  cold    nothing prepared yet: download + extract + concatenate + tokenize + blend
  no-op   the same again: nothing changed
  +1%     about 1% more shards (whole new chunks, appended at the end of the order)

Sources: ``local`` reads the layout through a path template; ``http`` serves it over loopback
from a separate process (uvicorn + Starlette's StaticFiles: ETag, Range, HEAD), so downloads
are real HTTP GETs. Layouts have 100 chunks (``--big``: chunks x shards of the factorisation
closest to 100 chunks: 114 x 519 = 59,166), so +1% is whole chunks (here 0.9%).

Measured per run: wall time; the flow process's CPU time and peak RSS (VmHWM, polled from
/proc: the array tasks are other processes); task runs, log rows and events the run added and
the growth of the Prefect database (``pg_database_size``, or the SQLite file with its WAL).
Results go to benchmarks/out/bench_scale.json, and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
VENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))

TEMPLATE = "train/chunk{chunk}/example_train_{shard}.jsonl.zst"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=2, follow_redirects=True).raise_for_status()
            return
        except Exception:  # noqa: BLE001 - not up yet, whatever the error
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ----------------------------------------------------------------------------- layout


def shape(n: int) -> tuple[int, int]:
    """(chunks, shards per chunk) with chunks x shards = n: 100 chunks when n allows, else the factor pair
    nearest to 100 chunks (59,166 = 114 x 519)."""
    if n % 100 == 0:
        return 100, n // 100
    pairs = [(c, n // c) for c in range(1, int(math.isqrt(n)) + 1) if n % c == 0]
    pairs += [(s, c) for c, s in pairs]
    return min(pairs, key=lambda p: abs(p[0] - 100))


def shard_text(chunk: int, shard: int, line: int) -> str:
    words = f"chunk {chunk} shard {shard} line {line}: in the beginning was the word and the word was data "
    return (words * 6)[:400]


def write_layout(root: Path, chunks: int, shards: int, start_chunk: int = 1) -> int:
    """Chunks ``start_chunk..start_chunk+chunks-1`` of ``shards`` shards each (skipped when present)."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=3)
    written = 0
    for c in range(start_chunk, start_chunk + chunks):
        folder = root / "train" / f"chunk{c}"
        if folder.is_dir() and len(os.listdir(folder)) == shards:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        for s in range(shards):
            lines = "".join(json.dumps({"text": shard_text(c, s, i), "meta": {"c": c}}) + "\n" for i in range(5))
            (folder / f"example_train_{s}.jsonl.zst").write_bytes(cctx.compress(lines.encode()))
            written += 1
    return written


# ----------------------------------------------------------------------------- services


class PrefectServer:
    """A Prefect server on PostgreSQL (a fresh database) or SQLite (a fresh PREFECT_HOME)."""

    def __init__(self, db: str, home: Path):
        self.db = db
        self.home = home
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.pg = None
        self.database = "nemoflow_bench_scale"

    def __enter__(self) -> PrefectServer:
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
        env.pop("PREFECT_API_URL", None)
        if self.db == "postgres":
            from devtools.postgres import LocalPostgres

            self.pg = LocalPostgres()
            self.pg.up()
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.pg.create_database(self.database)
        self.log = (self.home / "server.log").open("w")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_http(self.api + "/health", 120, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)
        if self.pg is not None:
            self.pg.drop_database(self.database)

    def size(self) -> int:
        if self.pg is not None:
            return self.pg.database_size(self.database)
        return sum(p.stat().st_size for p in self.home.glob("prefect.db*"))

    def counts(self) -> dict[str, int]:
        tables = {"task_runs": "task_run", "flow_runs": "flow_run", "logs": "log", "events": "events"}
        out = {}
        for key, table in tables.items():
            query = f"SELECT count(*) FROM {table}"
            if self.pg is not None:
                out[key] = int(self.pg.sql(query, database=self.database))
            else:
                with sqlite3.connect(self.home / "prefect.db") as con:
                    out[key] = con.execute(query).fetchone()[0]
        return out


class StaticServer:
    """``root`` over HTTP on loopback, from another process (ETag, Range and HEAD: Starlette's StaticFiles)."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()

    def __enter__(self) -> StaticServer:
        code = (
            "import sys, uvicorn; from starlette.applications import Starlette; "
            "from starlette.routing import Mount; from starlette.staticfiles import StaticFiles; "
            "app = Starlette(routes=[Mount('/', app=StaticFiles(directory=sys.argv[1]))]); "
            "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning', access_log=False)"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.root), str(self.port)], start_new_session=True
        )
        wait_http(f"http://127.0.0.1:{self.port}/probe/train/chunk1/example_train_0.jsonl.zst", 30, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)

    def template(self, folder: Path) -> str:
        return f"http://127.0.0.1:{self.port}/{folder}/{TEMPLATE}"


# ----------------------------------------------------------------------------- one run


def _proc_stats(pid: int) -> tuple[int, float] | None:
    """(VmHWM bytes, CPU seconds) of one process from /proc; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)
    if hwm is None:  # a zombie: exited, not yet reaped
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm, (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def prepare(
    server: PrefectServer, work: Path, name: str, sources: str, chunks: int, shards: int, spf: int, repo: Path
) -> dict:
    env = dict(
        os.environ,
        PREFECT_API_URL=server.api,
        NEMOFLOW_WORK_DIR=str(work),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(repo),  # --repo: another checkout's code (before/after comparisons)
    )
    cmd = [str(VENV_BIN / "nemoflow"), "prepare", "--name", name, "--sources", sources, "--json"]
    cmd += ["--chunks", f"1-{chunks}", "--shards", f"0-{shards - 1}", "--shards-per-file", str(spf)]
    before_size, before = server.size(), server.counts()
    started = time.monotonic()
    log = work.parent.parent / "logs" / f"{name}-{int(time.time())}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=out, stderr=subprocess.STDOUT)
        peak, cpu = 0, 0.0
        while proc.poll() is None:
            if (stats := _proc_stats(proc.pid)) is not None:
                peak, cpu = max(peak, stats[0]), stats[1]
            time.sleep(0.1)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    after = server.counts()
    return {
        "shards": chunks * shards,
        "wall_s": round(wall, 2),
        "flow_cpu_s": round(cpu, 2),
        "flow_peak_rss_mb": round(peak / 2**20, 1),
        "db_growth_mb": round((server.size() - before_size) / 2**20, 2),
        **{f"new_{k}": after[k] - before[k] for k in after},
    }


def scenario(
    server: PrefectServer, base: Path, kind: str, n: int, spf: int, http: StaticServer | None, repo: Path
) -> dict:
    chunks, shards = shape(n)
    src = base / "src" / f"{chunks}x{shards}"
    made = write_layout(src, chunks, shards)
    extra = max(1, round(chunks * 0.01))
    made += write_layout(src, extra, shards, start_chunk=chunks + 1)
    if made:
        print(f"  wrote {made} shard(s) under {src}", flush=True)
    work = base / "work" / f"{kind}-{n}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if http is not None:
        sources = http.template(src.relative_to(http.root))
    else:
        sources = str(src / TEMPLATE)
    name = f"{kind}-{n}"
    out = {"kind": kind, "n": n, "chunks": chunks, "shards_per_chunk": shards}
    for label, c in (("cold", chunks), ("noop", chunks), ("plus1", chunks + extra)):
        result = prepare(server, work, name, sources, c, shards, spf, repo)
        print(f"  {kind} N={n} {label}: {result}", flush=True)
        out[label] = result
    out["plus1"]["added"] = extra * shards
    shutil.rmtree(work, ignore_errors=True)
    return out


def markdown(results: list[dict]) -> str:
    rows = [
        "| source | N shards | cold run | per shard | no-op re-run | per shard | +1% run (new shards)"
        " | +1% minus no-op, per new shard | flow peak RSS cold / no-op | flow CPU cold | DB growth cold / no-op / +1%"
        " | task runs per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cold, noop, plus = r["cold"], r["noop"], r["plus1"]
        rows.append(
            f"| {r['kind']} | {r['n']:,} | {cold['wall_s']:.1f} s | {1000 * cold['wall_s'] / r['n']:.2f} ms"
            f" | {noop['wall_s']:.1f} s | {1000 * noop['wall_s'] / r['n']:.2f} ms"
            f" | {plus['wall_s']:.1f} s ({plus['added']:,})"
            f" | {1000 * (plus['wall_s'] - noop['wall_s']) / plus['added']:.1f} ms"
            f" | {cold['flow_peak_rss_mb']:.0f} / {noop['flow_peak_rss_mb']:.0f} MB | {cold['flow_cpu_s']:.1f} s"
            f" | {cold['db_growth_mb']:.2f} / {noop['db_growth_mb']:.2f} / {plus['db_growth_mb']:.2f} MB"
            f" | {cold['new_task_runs']} / {noop['new_task_runs']} / {plus['new_task_runs']} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", default="1000,2500,5000,10000", help="sizes N, comma-separated")
    parser.add_argument("--big", type=int, default=0, help="one more size (e.g. 59166), for --big-sources")
    parser.add_argument("--big-sources", default="local", help="source kinds of the --big run (default: local)")
    parser.add_argument("--sources", default="local,http", help="local, http or both")
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--shards-per-file", type=int, default=1200)
    parser.add_argument("--base", default=str(OUT / "bench_scale"), help="where layouts and datasets go")
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose code runs (e.g. an older one)")
    parser.add_argument("--label", default="", help="suffix of the results file (bench_scale-LABEL.json)")
    args = parser.parse_args()
    base = Path(args.base)
    base.mkdir(parents=True, exist_ok=True)
    plan = [(kind, int(n)) for n in args.shards.split(",") if n for kind in args.sources.split(",")]
    if args.big:
        plan += [(kind, args.big) for kind in args.big_sources.split(",")]
    results = []
    with PrefectServer(args.db, base / "prefect-home") as server:
        http = StaticServer(base / "src") if any(kind == "http" for kind, _ in plan) else None
        if http is not None:
            write_layout(base / "src" / "probe", 1, 1)
            http.__enter__()
        try:
            for kind, n in plan:
                print(f"{kind} N={n}", flush=True)
                http_server = http if kind == "http" else None
                results.append(scenario(server, base, kind, n, args.shards_per_file, http_server, Path(args.repo)))
        finally:
            if http is not None:
                http.__exit__()
    report = {
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        "db": args.db,
        "shards_per_file": args.shards_per_file,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "repo": args.repo,
        "results": results,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"bench_scale{'-' + args.label if args.label else ''}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(results))
    print(f"\n{report['machine']}; load average at the end {report['load_average_at_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
