"""Build the nemoflow container image with podman, caching every step that can be cached.

    nemoflow image build                      # localhost/nemoflow:<version>-cpu
    scripts/build-image.sh --tag registry.example.com/team/nemoflow:0.1.0

CPU variant (``Containerfile.cpu``), built without any container registry:

1. **base**: a Debian bookworm root file system of the packages in ``base-packages.txt``,
   made by ``mmdebstrap`` and ``podman import``ed as
   ``localhost/nemoflow-base:bookworm-<key>``; the key hashes the package list, suite
   and mirrors. The tarball is kept in the cache directory, so a fresh podman store
   re-imports it (seconds) instead of bootstrapping again (minutes).
2. **wheelhouse**: every wheel of the pinned runtime dependencies (``pip wheel -c
   constraints.txt``, run on the host, which sees PyPI and the local torch CPU wheel),
   in ``<cache>/wheels-<key>``, keyed by ``constraints.txt`` and the dependency list.
3. **image**: ``podman build`` with the wheelhouse mounted at ``/wheels`` and no network
   (``--network none``): the Python layer is podman's cached layer until
   ``constraints.txt`` or the dependency list changes; the repository layer is rebuilt
   from a staged copy of the files git sees (tracked, plus untracked files not ignored:
   no ``.venv``, no caches).

CUDA variant (``Containerfile.cuda``): a plain ``podman build`` FROM NVIDIA's PyTorch
container; it needs nvcr.io and is never built on the test machines.

The cache directory is ``$NEMOFLOW_IMAGE_CACHE`` or ``~/.cache/nemoflow-image``.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deployments.image import podman

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# The build backend of the editable install (pyproject's build-system), pinned; in the wheelhouse.
BUILD_REQUIREMENTS = ("setuptools==84.2.1",)
BASE_REPO = "localhost/nemoflow-base"
VARIANTS = ("cpu", "cuda")


class ImageBuildError(RuntimeError):
    """A build step failed; the message names the step and the command to look at."""


def cache_dir() -> Path:
    return Path(os.environ.get("NEMOFLOW_IMAGE_CACHE", Path.home() / ".cache" / "nemoflow-image"))


def default_tag(variant: str = "cpu") -> str:
    return f"localhost/nemoflow:{_version()}-{variant}"


def _version() -> str:
    with open(REPO / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["project"]["version"]


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def base_packages() -> list[str]:
    lines = (HERE / "base-packages.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _bootstrap_args() -> list[str]:
    """mmdebstrap's options (before SUITE TARGET MIRRORS); part of the base image's key."""
    return [
        "--variant=minbase",
        "--include=" + ",".join(base_packages()),
        "--aptopt=APT::Install-Recommends false",
        "--format=tar",
    ]


def base_tag() -> str:
    key = _sha(SUITE, *MIRRORS, *_bootstrap_args())
    return f"{BASE_REPO}:{SUITE}-{key}"


def runtime_requirements() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as fh:
        return list(tomllib.load(fh)["project"]["dependencies"])


def wheelhouse_dir(base: str) -> Path:
    key = _sha(base, (REPO / "constraints.txt").read_bytes(), *runtime_requirements(), *BUILD_REQUIREMENTS)
    return cache_dir() / f"wheels-{key}"


Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(step: str, cmd: list[str], log: Log, **kwargs) -> None:
    log(f"[image] {step}: {' '.join(cmd)}")
    # the tools' output is progress: stderr, so stdout keeps only the command's result
    kwargs.setdefault("stdout", sys.stderr)
    proc = subprocess.run(cmd, check=False, **kwargs)
    if proc.returncode != 0:
        raise ImageBuildError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd[:3])} ...; see the output above")


def _need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise ImageBuildError(f"{tool} not found; install it: apt-get install {package} (scripts/debian-packages.txt)")
    return path


def ensure_base(log: Log = _stderr, *, rebuild: bool = False) -> str:
    """The base image's tag, bootstrapping and importing it only if podman does not have it."""
    tag = base_tag()
    if not rebuild and podman.image_exists(tag):
        log(f"[image] base {tag}: cached in podman")
        return tag
    tarball = cache_dir() / f"{tag.rsplit('/', 1)[-1].replace(':', '-')}.tar"
    if rebuild or not tarball.exists():
        mmdebstrap = _need("mmdebstrap", "mmdebstrap")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        tmp = tarball.with_suffix(f".tmp-{os.getpid()}.tar")
        started = time.monotonic()
        try:
            _run(
                "bootstrap the Debian base",
                [mmdebstrap, *_bootstrap_args(), SUITE, str(tmp), *MIRRORS],
                log,
            )
            os.replace(tmp, tarball)  # only a complete tarball gets the final name
        finally:
            tmp.unlink(missing_ok=True)
        log(f"[image] base bootstrapped in {time.monotonic() - started:.0f} s: {tarball}")
    _run(
        "import the base",
        podman.command("import", "--change", 'CMD ["/bin/bash"]', str(tarball), tag),
        log,
        stdout=subprocess.DEVNULL,
    )
    return tag


def host_pip_settings() -> tuple[dict[str, str], list[str]]:
    """This host's pip configuration as ``PIP_*`` variables, and ``-v`` mounts for the paths it names.

    The wheelhouse is resolved inside the base image, so pip sees the host's indexes,
    find-links directories, constraints and CA bundle (a TLS-intercepting proxy needs it)
    exactly as the host's own pip does.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], check=False, capture_output=True, text=True
    ).stdout
    env: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            value = value.strip("'\"")
        env["PIP_" + key.split(".", 1)[-1].upper().replace("-", "_")] = str(value)
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    mounts: set[str] = set()
    for value in env.values():
        for token in value.split():
            path = token.removeprefix("file://")
            if token.startswith("file://"):
                # a local index (.../simple) links to files beside it: mount its parent
                path = os.path.dirname(path.rstrip("/"))
            if path.startswith("/") and os.path.exists(path):
                mounts.add(path)
    return env, [arg for path in sorted(mounts) for arg in ("--volume", f"{path}:{path}:ro")]


def ensure_wheelhouse(base: str, log: Log = _stderr, *, rebuild: bool = False) -> Path:
    """Every wheel the image's Python environment needs, built once per constraints.txt.

    ``pip wheel`` runs in a container of the base image, with the base's own Python, so
    environment markers are those of the image (bookworm's Python 3.11.2 needs
    async-timeout for redis, a newer host Python does not); the host's pip cache and pip
    configuration are mounted, so nothing is downloaded twice.
    """
    final = wheelhouse_dir(base)
    if final.exists() and not rebuild:
        log(f"[image] wheelhouse {final}: cached")
        return final
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    inputs = tmp / "inputs"
    inputs.mkdir(parents=True)
    shutil.copy(REPO / "constraints.txt", inputs / "constraints.txt")
    (inputs / "requirements.txt").write_text("\n".join([*runtime_requirements(), *BUILD_REQUIREMENTS]) + "\n")
    env, mounts = host_pip_settings()
    pip_cache = Path(os.environ.get("PIP_CACHE_DIR", Path.home() / ".cache" / "pip"))
    pip_cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        _run(
            "build the wheelhouse",
            podman.run_args(
                "--rm",
                "--network=host",
                *mounts,
                "--volume",
                f"{pip_cache}:/root/.cache/pip",
                "--volume",
                f"{tmp}:/wheels",
                *[arg for key, value in sorted(env.items()) for arg in ("--env", f"{key}={value}")],
                base,
                "sh",
                "-c",
                "python3 -m venv /tmp/venv && /tmp/venv/bin/pip wheel --quiet --wheel-dir /wheels "
                "-c /wheels/inputs/constraints.txt -r /wheels/inputs/requirements.txt",
            ),
            log,
        )
        shutil.rmtree(inputs)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # keep the two newest wheelhouses (e.g. two branches with different constraints), drop older ones
    houses = sorted(
        (p for p in cache_dir().glob("wheels-*") if p.is_dir() and ".tmp-" not in p.name),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for stale in houses[2:]:
        shutil.rmtree(stale, ignore_errors=True)
    log(f"[image] wheelhouse built in {time.monotonic() - started:.0f} s: {final}")
    return final


def stage_context(dest: Path | None = None) -> Path:
    """A build context holding the files git sees (tracked and untracked-not-ignored), as they are now."""
    dest = dest or cache_dir() / "context"
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        ).stdout.split(b"\0")
        files = {Path(os.fsdecode(name)) for name in listed if name}
    except (OSError, subprocess.CalledProcessError):
        # not a git checkout (an unpacked release): everything but environments and caches
        skip = {".venv", ".git", "__pycache__", ".pytest_cache", "build", "dist", ".cache"}
        files = {
            p.relative_to(REPO) for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)
        }
    files = {f for f in files if (REPO / f).is_file()}  # deleted-but-tracked files are gone
    if dest.exists():
        for path in sorted(dest.rglob("*"), reverse=True):
            rel = path.relative_to(dest)
            if path.is_file() and rel not in files:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    for rel in files:
        src, out = REPO / rel, dest / rel
        # copy only what changed (size and mtime), keeping mtimes: podman's COPY cache stays valid
        if out.exists():
            a, b = src.stat(), out.stat()
            if a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime):
                continue
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)
    return dest


@dataclass
class BuildResult:
    tag: str
    seconds: float
    image_id: str
    size_bytes: int


def build(
    variant: str = "cpu",
    tags: list[str] | None = None,
    *,
    log: Log = _stderr,
    rebuild_base: bool = False,
    no_cache: bool = False,
    base_image: str | None = None,
    quiet: bool = False,
) -> BuildResult:
    """Build the image (see the module docstring); returns its first tag, time, id and size."""
    if variant not in VARIANTS:
        raise ImageBuildError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
    cache_dir().mkdir(parents=True, exist_ok=True)
    # one build at a time per cache directory: they share the staged context and the wheelhouse
    with open(cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(
            variant, tags, log=log, rebuild_base=rebuild_base, no_cache=no_cache, base_image=base_image, quiet=quiet
        )


def _build(
    variant: str,
    tags: list[str] | None,
    *,
    log: Log,
    rebuild_base: bool,
    no_cache: bool,
    base_image: str | None,
    quiet: bool,
) -> BuildResult:
    started = time.monotonic()
    tags = tags or [default_tag(variant)]
    context = stage_context(cache_dir() / f"context-{variant}")
    args = [
        "build",
        "--file",
        str(HERE / f"Containerfile.{variant}"),
        "--layers",
        *[a for tag in tags for a in ("--tag", tag)],
    ]
    if quiet:
        args.append("--quiet")
    if no_cache:
        args.append("--no-cache")
    if variant == "cpu":
        base = base_image or ensure_base(log, rebuild=rebuild_base)
        wheels = ensure_wheelhouse(base, log)
        args += [
            *podman.limit_args(),
            "--pull=never",
            "--network=none",
            "--volume",
            f"{wheels}:/wheels:ro",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            "PIP_ARGS=--no-index --find-links /wheels",
            "--build-arg",
            "BUILD_REQUIREMENTS=" + " ".join(BUILD_REQUIREMENTS),
        ]
    elif base_image:
        args += ["--build-arg", f"BASE_IMAGE={base_image}"]
    _run(f"build {tags[0]}", podman.command(*args, str(context)), log)
    inspect = subprocess.run(
        podman.command("image", "inspect", "--format", "{{.Id}} {{.Size}}", tags[0]),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    result = BuildResult(tags[0], time.monotonic() - started, inspect[0], int(inspect[1]))
    log(f"[image] built {result.tag} ({result.size_bytes / 1e9:.2f} GB) in {result.seconds:.0f} s")
    return result
