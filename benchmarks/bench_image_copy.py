"""Image staging throughput: nemoflow's verified copy against plain tools doing the same transfer.

    .venv/bin/python benchmarks/bench_image_copy.py [--mb 256] [--repeats 3]

Input: a real squashfs image of about ``--mb`` MiB (incompressible bytes packed by
mksquashfs), written once to benchmarks/out/. Contenders, interleaved, medians shown:

  path: nemoflow      ``copy_image(path, dir)``: sha256 of the source (cache key), streamed copy
                      re-hashed and superblock-checked, fsync, ``unsquashfs -l``, atomic rename, sidecar
  path: cp            ``cp SRC DST`` (no verification at all)
  path: cp+sha256sum  ``cp`` then ``sha256sum`` of both files (what a careful manual guide does)
  http: nemoflow      ``copy_image(http://...)`` from a local http.server that sends x-goog-hash (md5)
  http: curl          ``curl -sf -o DST URL`` (no verification), where curl is installed
  cache hit           a second ``copy_image`` of the same HTTP source: HEAD + sidecar + superblock

MiB/s is image bytes per wall-clock second. Results go to benchmarks/out/bench_image_copy.json.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "out"


def make_image(mb: int) -> Path:
    image = OUT / f"bench-{mb}m.sqsh"
    if image.exists():
        return image
    with tempfile.TemporaryDirectory() as tmp:
        rng = random.Random(0)
        for i in range(max(1, mb // 16)):
            (Path(tmp) / f"blob-{i:03d}.bin").write_bytes(rng.randbytes(16 << 20))
        subprocess.run(["mksquashfs", tmp, str(image), "-noappend", "-quiet", "-no-progress"], check=True)
    return image


def serve(root: Path, md5_b64: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

        def end_headers(self):
            self.send_header("x-goog-hash", f"md5={md5_b64}")
            super().end_headers()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    from infra import images
    from infra.images import staged

    image = make_image(args.mb)
    size = image.stat().st_size
    md5_b64 = base64.b64encode(hashlib.md5(image.read_bytes()).digest()).decode()
    httpd = serve(image.parent, md5_b64)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/{image.name}"
    results: dict[str, list[float]] = {}
    work = Path(tempfile.mkdtemp(dir=OUT))

    def fresh(name: str) -> Path:
        d = work / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        return d

    def cp_sha():
        d = fresh("cpsha")
        subprocess.run(["cp", str(image), str(d / image.name)], check=True)
        subprocess.run(["sha256sum", str(image), str(d / image.name)], check=True, capture_output=True)

    contenders = {
        "path: nemoflow": lambda: (staged._local_sha256_memo.clear(), images.copy_image(str(image), str(fresh("nf")))),
        "path: cp": lambda: subprocess.run(["cp", str(image), str(fresh("cp") / image.name)], check=True),
        "path: cp+sha256sum": cp_sha,
        "http: nemoflow": lambda: images.copy_image(url, str(fresh("nfhttp"))),
    }
    if shutil.which("curl"):
        contenders["http: curl"] = lambda: subprocess.run(
            ["curl", "-sf", "-o", str(fresh("curl") / image.name), url], check=True
        )
    try:
        for _ in range(args.repeats):
            for name, fn in contenders.items():
                results.setdefault(name, []).append(timed(fn))
            images.copy_image(url, str(fresh("hit")))
            results.setdefault("cache hit", []).append(timed(lambda: images.copy_image(url, str(work / "hit"))))
    finally:
        httpd.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    print(f"image: {size / (1 << 20):.0f} MiB squashfs, {args.repeats} rounds, medians")
    print(f"{'contender':<22} {'seconds':>9} {'MiB/s':>9}")
    for name, times in results.items():
        median = statistics.median(times)
        rate = size / median / (1 << 20) if name != "cache hit" else None
        rows.append({"contender": name, "seconds": median, "mib_per_s": rate, "runs": times})
        print(f"{name:<22} {median:>9.3f} {rate if rate is not None else float('nan'):>9.0f}")
    (OUT / "bench_image_copy.json").write_text(
        json.dumps(
            {
                "bytes": size,
                "repeats": args.repeats,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
