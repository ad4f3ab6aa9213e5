"""``nemoflow fetch``: expand a source spec and download (optionally extract) its shards, no Prefect needed."""

from __future__ import annotations

import sys

from nemoflow.commands import add_command

DESCRIPTION = (
    "Expand SOURCES (URIs, a glob, or a URL template with {chunk}/{shard}) and download each "
    "file to DEST/<name>, resuming partial files and retrying transient errors. A file already "
    "downloaded and verified is not fetched again. HF_TOKEN is sent to huggingface.co only. "
    "`nemoflow prepare` does the same inside the full flow; use this to check a spec or pre-stage data."
)

EPILOG = """examples:
  nemoflow fetch --list 'https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/train/chunk{chunk}/example_train_{shard}.jsonl.zst' \\
      --chunks 1 --shards 0-9 --probe
  nemoflow fetch 'gs://my-bucket/raw/**/*.jsonl.zst' --dest /data/raw --extract
  nemoflow fetch https://example.org/a.jsonl.zst https://example.org/b.jsonl.zst --dest gs://my-bucket/raw"""


def register(sub) -> None:
    parser = add_command(
        sub,
        "fetch",
        "list or download dataset shards (resume, retries, checksums) without running a flow",
        DESCRIPTION,
        epilog=EPILOG,
    )
    parser.add_argument("sources", nargs="+", help="URIs or paths, one glob, or one URL template with {chunk}/{shard}")
    parser.add_argument("--chunks", help="values for {chunk}: '1-10', '0,3,5-7'")
    parser.add_argument("--shards", help="values for {shard}: '0-99', '0,3,5-7'")
    parser.add_argument("--dest", help="download directory (local path or gs://); required unless --list")
    parser.add_argument("--list", action="store_true", help="only print what SOURCES expand to (name and URL)")
    parser.add_argument("--probe", action="store_true", help="with --list: also ask each source its size (HEAD)")
    parser.add_argument("--extract", action="store_true", help="also decompress each .zst next to it (.jsonl)")
    parser.add_argument("--delete-compressed", action="store_true", help="with --extract: delete each .zst after")
    parser.add_argument("--retries", type=int, default=8, help="retries per file on transient errors (default 8)")
    parser.add_argument("--timeout", type=float, default=60, help="network timeout in seconds (default 60)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from infra import storage
    from infra.fetch import FetchError, download, probe, redact
    from infra.sources import expand_sources, local_name
    from workloads.shards import CorruptArchive, extract_zst

    spec = args.sources[0] if len(args.sources) == 1 else args.sources
    sources = expand_sources(spec, chunks=args.chunks, shards=args.shards)
    if args.list:
        for src in sources:
            size = ""
            if args.probe:
                try:
                    info = probe(src.url, timeout=args.timeout)
                    size = f"{info.size if info.size is not None else '?':>14}  "
                except FetchError as exc:
                    size = f"{'error':>14}  "
                    print(f"{src.name}: {exc}", file=sys.stderr)
            print(f"{size}{src.name}  {redact(src.url)}")
        print(f"{len(sources)} source(s)", file=sys.stderr)
        return 0
    if not args.dest:
        raise ValueError("--dest is required to download (or use --list)")
    failed = 0
    for i, src in enumerate(sources, 1):
        dest = storage.join(args.dest, local_name(src))
        try:
            result = download(
                src.url, dest, retries=args.retries, timeout=args.timeout, log=lambda m: print(m, file=sys.stderr)
            )
            state = "present" if result.skipped else f"{result.attempts} attempt(s)"
            print(f"[{i}/{len(sources)}] {src.name}: {result.size} bytes, sha256 {result.sha256[:16]}, {state}")
            if args.extract and dest.endswith(".zst"):
                out = extract_zst(dest, dest[: -len(".zst")], delete_source=args.delete_compressed)
                print(f"[{i}/{len(sources)}] {src.name}: extracted {out.lines} lines -> {out.uri}")
        except (FetchError, CorruptArchive) as exc:
            failed += 1
            print(f"[{i}/{len(sources)}] {src.name}: FAILED: {exc}", file=sys.stderr)
    if failed:
        print(f"{failed} of {len(sources)} file(s) failed", file=sys.stderr)
        return 1
    return 0
