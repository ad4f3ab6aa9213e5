"""A serving engine's own Python environment for a node without internet (vLLM: issue 32).

vLLM runs as its own process (``vllm serve``) and pins versions nemoflow's venv cannot hold beside the node's
packages (vLLM 0.26.0 pins numba 0.65.0; the node has 0.68.0), so it gets an environment of its own that
reuses the node's torch. Built on a machine that reaches PyPI:

    scripts/wheelhouse.sh build --engine vllm==0.26.0 --out .wheelhouse/vllm --python-version 3.12 \\
        --glibc 2.35 --have deployments/nodes/h200-freeze.txt --split-mb 52

installed on the node (one call per chunk; the last one finishes and checks):

    scripts/setup.sh --offline .wheelhouse/vllm/chunk-1 --engine-venv /tmp/vllm-venv --reuse-torch /usr/bin/python3

The closure is pip's own resolution of the engine for the node's Python and platform (``pip install
--dry-run --report``: metadata only, no torch download), walked from the engine with the extras each
requirement asks for. A package stays out when
- the node has it at a version every requirement in the walked closure accepts (torch, transformers...);
- it is one of the engine's lazily imported extras that serving a dense model does not import
  (``OPTIONAL``, each with the reason read in the engine's source), or named with ``--without``: then what
  only it required stays out too.
A wheel bigger than ``--split-mb`` travels in parts (``FILE.part-NN``) that the install joins and checks
against the wheel's sha256 before pip sees it; chunks hold at most ``--split-mb`` MiB each.
``--strip PACKAGE:MEMBER`` removes files from a wheel before it is split (its RECORD rewritten; the original's
sha256 is kept in the manifest beside the new one).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "nemoflow-engine.json"
PIP_VERSION = "26.3"  # the pip that installs the engine venv (carried in chunk 1; wheelhouse.BUILD_TOOLS)
FORMAT = 1
MIB = 1 << 20
PART = ".part-"
STATE = ".nemoflow-engine"  # inside the engine venv: staged parts, joined wheels, what is installed


@dataclass(frozen=True)
class EngineSpec:
    """What an engine's environment needs beyond its wheel's metadata."""

    check_imports: tuple[str, ...]  # imported on the node to prove the environment works
    optional: dict[str, str]  # distribution -> why serving does not need it (read in the engine's source)
    strip: tuple[str, ...] = ()  # members dropped from the engine's own wheel by default (none)
    # Python run in the engine venv once it imports: one-time work its first start would do otherwise (best
    # effort: a failure is reported, the install stands). It prints one line of what it did.
    prepare: str = ""


# vLLM 0.26.0: a static walk of the module-level imports reachable from `vllm serve`, the OpenAI server, the
# V1 engine core, the GPU worker and model runner, the Llama model and the FLASH_ATTN backend found none of
# these; each is imported inside a function or behind an availability check. (apache-tvm-ffi was listed too,
# wrongly: on the H200 `import vllm.v1.engine.core` failed with "No module named 'tvm_ffi'"; it is required.)
VLLM_OPTIONAL = {
    "flashinfer-python": "attention/sampling kernels JIT-compiled with nvcc; vllm_env sets VLLM_USE_FLASHINFER_SAMPLER=0",
    "nvidia-cudnn-frontend": "used through flashinfer only",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4 / Blackwell paths), imported inside functions",
    "quack-kernels": "CuTe DSL kernels, imported inside functions",
    "humming-kernels": "quantized GEMM kernels, imported inside functions",
    "tilelang": "TileLang kernels (sparse MLA), imported inside functions",
    "tokenspeed-mla": "MLA attention (DeepSeek-style models), chosen by the attention registry by name",
    "numba": "n-gram speculative decoding only (vllm.utils.import_utils.is_numba_available)",
    "pynvvideocodec": "video inputs (vllm.multimodal.video, imported inside a function)",
    "torchcodec": "video inputs (vllm.multimodal.video, behind an availability check)",
    "fastsafetensors": "an optional weight loader (try/except import)",
    "mistral-common": "Mistral-format tokenizers (--tokenizer-mode mistral) only",
    "mcp": "the MCP tool server (vllm.entrypoints.mcp.tool_server, imported inside functions)",
    "anthropic": "not imported by vLLM 0.26.0's code (its Anthropic API is its own module)",
    "opentelemetry-sdk": "tracing (vllm.tracing.otel, try/except import)",
    "opentelemetry-api": "tracing",
    "opentelemetry-exporter-otlp": "tracing",
    "opentelemetry-semantic-conventions-ai": "tracing",
    "fastapi-cloud-cli": "fastapi[standard]'s `fastapi deploy` command",
}
# vLLM inspects a model class (its interfaces: multimodal, pooling, ...) in a subprocess that imports vLLM and
# torch again, unless $VLLM_CACHE_ROOT/modelinfos holds the answer for that model file's hash. On the H200 the
# GPU demo's first `vllm serve` spent 22 s between its arguments and "Resolved architecture" (59069c5's log);
# asking the registry here, once per install, writes those files for the architectures nemoflow trains.
VLLM_PREPARE = """
import time
t = time.monotonic()
from vllm.model_executor.models.registry import ModelRegistry
archs = ("LlamaForCausalLM", "MixtralForCausalLM")
for arch in archs:
    ModelRegistry.models[arch].inspect_model_cls()
print("vLLM's model registry: %s inspected and cached in %.0f s" % (", ".join(archs), time.monotonic() - t))
"""
ENGINES = {
    "vllm": EngineSpec(
        check_imports=(
            "vllm",
            "vllm._C_stable_libtorch",  # vLLM 0.26.0's name for vllm._C (its CUDA kernels)
            "vllm._moe_C_stable_libtorch",
            "vllm.platforms.cuda",
            "vllm.vllm_flash_attn",
            "vllm.entrypoints.openai.api_server",
            "vllm.v1.engine.core",
            "vllm.v1.worker.gpu_model_runner",
            "vllm.model_executor.models.llama",
            "vllm.v1.attention.backends.flash_attn",
            "vllm.benchmarks.serve",
        ),
        optional=VLLM_OPTIONAL,
        prepare=VLLM_PREPARE,
    ),
}


class EngineEnvError(RuntimeError):
    """The engine environment cannot be built or installed; the message names what and how to fix it."""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


TORCH_LIKE = ("torch", "torchvision", "torchaudio")  # the node's own, never carried (checked against the pins)


def _packaging():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - a Python without packaging: pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def engine_spec(requirement: str) -> EngineSpec | None:
    """The spec of the engine a build was made for (its manifest names the requirement: ``vllm==0.26.0``)."""
    return ENGINES.get(canon(_packaging()(requirement).name))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


# -- splitting and joining (pure file work) --------------------------------------------------


def split_file(path: Path, out_dir: Path, limit: int) -> list[dict]:
    """``path`` cut into ``NAME.part-01``... of at most ``limit`` bytes in ``out_dir``: [{file, size, sha256}]."""
    if limit < 1:
        raise EngineEnvError(f"--split-mb: a part must hold at least one byte (got {limit} bytes)")
    parts = []
    with open(path, "rb") as f:
        n = 0
        while block := f.read(limit):
            n += 1
            part = out_dir / f"{path.name}{PART}{n:02d}"
            part.write_bytes(block)
            parts.append({"file": part.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    return parts


def join_parts(parts: list[Path], dest: Path, want_sha256: str) -> Path:
    """Join ``parts`` in order into ``dest``, atomically, only if the whole has ``want_sha256``."""
    tmp = dest.with_name(dest.name + ".joining")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != want_sha256:
        tmp.unlink()
        raise EngineEnvError(
            f"{dest.name}: its {len(parts)} parts joined have sha256 {h.hexdigest()[:16]}..., the build recorded "
            f"{want_sha256[:16]}...: a part was damaged in transfer; copy its chunk again"
        )
    os.replace(tmp, dest)
    return dest


def strip_wheel(wheel: Path, members: list[str]) -> list[str]:
    """Remove ``members`` (globs, e.g. ``vllm/vllm_flash_attn/_vllm_fa2_C*.so``) from a wheel, in place, and
    from its RECORD; the names removed. Nothing matching is an error (a wrong name must not pass silently)."""
    import fnmatch

    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        gone = [i.filename for i in infos if any(fnmatch.fnmatch(i.filename, m) for m in members)]
        if not gone:
            raise EngineEnvError(f"--strip {','.join(members)}: nothing in {wheel.name} matches")
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        tmp = wheel.with_name(wheel.name + ".stripping")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename in gone:
                    continue
                data = z.read(info)
                if info.filename == record:
                    lines = data.decode().splitlines()
                    data = ("\n".join(ln for ln in lines if ln.split(",", 1)[0] not in gone) + "\n").encode()
                out.writestr(info, data, compress_type=info.compress_type)
    os.replace(tmp, wheel)
    return gone


def pack_chunks(sizes: dict[str, int], limit: int, first: tuple[str, ...] = ()) -> list[list[str]]:
    """Files -> chunks of at most ``limit`` bytes: ``first`` in chunk 1, then biggest first into the first
    chunk with room (first fit)."""
    chunks: list[list[str]] = []
    used: list[int] = []
    for f in [*first, *sorted((f for f in sizes if f not in first), key=lambda f: (-sizes[f], f))]:
        if sizes[f] > limit:
            raise EngineEnvError(f"{f} ({sizes[f] / MIB:.1f} MiB) is bigger than a chunk: split it first")
        i = next((i for i in range(len(chunks)) if used[i] + sizes[f] <= limit), None)
        if i is None:
            chunks.append([])
            used.append(0)
            i = len(chunks) - 1
        chunks[i].append(f)
        used[i] += sizes[f]
    return [sorted(c) for c in chunks]


# -- the closure ------------------------------------------------------------------------------


def resolve(requirement: str, target_args: list[str], log=print) -> dict[str, dict]:
    """pip's resolution of ``requirement`` for the node: {name: {name, version, url, sha256, requires, extras}}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--target", str(Path(tmp) / "t"), "--report", str(report), *target_args, requirement]
        log(f"==> resolving {requirement} for the node (pip --dry-run --report; metadata only)")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            err = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-3:]
            raise EngineEnvError(f"pip cannot resolve {requirement} for the node: {' '.join(err)[-600:]}")
        data = json.loads(report.read_text())
    out = {}
    for item in data["install"]:
        meta = item["metadata"]
        info = item["download_info"]
        out[canon(meta["name"])] = {
            "name": meta["name"],
            "version": meta["version"],
            "url": info["url"],
            "sha256": (info.get("archive_info") or {}).get("hashes", {}).get("sha256"),
            "requires": meta.get("requires_dist") or [],
        }
    return out


def node_requirements(pins: dict[str, str], target_args: list[str], log=print) -> dict[str, list[str]]:
    """The requirements of the node's versions (``pins``: {name: version}) from the index's metadata: one pip
    ``--dry-run --no-deps --report`` (no wheel is downloaded). A version the index does not have for the node
    is left out of the answer (said once), so that package keeps the resolved release's requirements."""
    pins = dict(pins)
    while pins:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
            cmd += ["--target", str(Path(tmp) / "t"), "--report", str(report), *target_args]
            cmd += [f"{n}=={v}" for n, v in sorted(pins.items())]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                data = json.loads(report.read_text())
                return {canon(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in data["install"]}
        said = proc.stderr.lower()
        missing = [n for n in pins if f"for {n}=={pins[n]}".lower() in said or f"requirement {n}==".lower() in said]
        if not missing:
            raise EngineEnvError(f"pip cannot read the node's package versions from the index: {proc.stderr[-500:]}")
        log(
            f"    the index has no {', '.join(f'{n} {pins[n]}' for n in missing)} for the node: the newest release's "
            "requirements stand in"
        )
        for n in missing:
            del pins[n]
    return {}


def walk(
    root: str, packages: dict[str, dict], env: dict[str, str], leave_out: set[str]
) -> tuple[dict[str, set[str]], dict[str, list[tuple[object, str]]]]:
    """From ``root``, the packages reached (with the extras asked of each) and who requires what, not entering
    ``leave_out``. Requirements are evaluated with the node's markers and the extras asked of their package."""
    Requirement = _packaging()
    root_req = Requirement(root)
    reached: dict[str, set[str]] = {}
    required_by: dict[str, list[tuple[object, str]]] = defaultdict(list)
    stack = [(canon(root_req.name), set(root_req.extras))]
    while stack:
        name, extras = stack.pop()
        if name in leave_out or name not in packages:
            continue
        known = reached.get(name)
        if known is not None and extras <= known:
            continue
        reached[name] = (known or set()) | extras
        for line in packages[name]["requires"]:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({**env, "extra": e}) for e in reached[name] | {""}
            ):
                continue
            dep = canon(req.name)
            if (req, name) not in required_by[dep]:
                required_by[dep].append((req, name))
            stack.append((dep, set(req.extras)))
    return reached, required_by


def decide(
    reached: dict[str, set[str]],
    required_by: dict[str, list],
    packages: dict[str, dict],
    have: dict[str, str | None],
) -> tuple[list[str], dict[str, dict]]:
    """Which reached packages travel, and which the node supplies (with the requirements its copy must meet)."""
    carried, reused = [], {}
    for name in sorted(reached):
        reqs = required_by.get(name, [])
        node = have.get(name, "") if name in have else None
        ok = name in have and all(
            have[name] is None or r.specifier.contains(have[name], prereleases=True) for r, _ in reqs
        )
        if ok:
            reused[name] = {"node_version": node, "requires": sorted({f"{by}: {r}" for r, by in reqs})}
        else:
            carried.append(name)
    return carried, reused


def build(args, target_args: list[str], env: dict[str, str], have: dict[str, str | None], log=print) -> dict:
    Requirement = _packaging()
    req = Requirement(args.engine)
    engine = canon(req.name)
    spec = ENGINES.get(engine, EngineSpec(check_imports=(engine.replace("-", "_"),), optional={}))
    if not have:
        raise EngineEnvError("--engine needs --have FREEZE: the node's packages decide what travels")
    out = Path(args.out)
    t0 = time.monotonic()
    packages = resolve(args.engine, target_args, log)
    without = {canon(n) for item in args.without or [] for n in item.split(",") if n.strip()}
    leave_out = {**{n: why for n, why in spec.optional.items()}, **{n: "--without" for n in without}}
    leave_out.pop(engine, None)
    reached, required_by = walk(args.engine, packages, env, set(leave_out))
    for torch_like in TORCH_LIKE:
        for r, by in required_by.get(torch_like, []):
            node = have.get(torch_like)
            if torch_like in reached and node and not r.specifier.contains(node, prereleases=True):
                raise EngineEnvError(
                    f"{by} requires {r}; the node has {torch_like} {node}: choose the {engine} version whose "
                    f"{torch_like} pin is the node's (a second torch does not travel)"
                )
    carried, reused = decide(reached, required_by, packages, have)
    # The node's copy of a package it supplies is what the engine imports, so that copy's requirements hold,
    # not those of the release pip resolved: walk again with them until the node's set stops changing. (The
    # H200's transformers 5.17.0 wants huggingface-hub < 2.0; walked with 5.25.0's requirements, huggingface-hub
    # 2.4.0 travelled, shadowed the node's 1.33.0, and vLLM's import of transformers failed.) A node copy whose
    # requirements reject what the engine needs travels too, at the resolved release, to be imported instead.
    node_meta: dict[str, list[str]] = {}
    asked: set[str] = set()
    forced: dict[str, str] = {}
    for _ in range(16):
        want = {n: have[n] for n in reused if have.get(n) and n not in TORCH_LIKE and n not in asked}
        if want:
            asked |= set(want)
            node_meta.update(node_requirements(want, target_args, log))
        view = {
            n: {**p, "requires": node_meta[n]} if n in reused and n in node_meta else p for n, p in packages.items()
        }
        reached, required_by = walk(args.engine, view, env, set(leave_out))
        carried, now = decide(reached, required_by, view, {n: v for n, v in have.items() if n not in forced})
        clash = {
            by: f"the node's {by} {have[by]} requires {r}; {name} {packages[name]['version']} travels"
            for name in carried
            for r, by in required_by.get(name, [])
            if by in now and by in node_meta and not r.specifier.contains(packages[name]["version"], prereleases=True)
        }
        for by, why in clash.items():
            if by in TORCH_LIKE:
                raise EngineEnvError(f"{why}: the node's {by} cannot be replaced (choose another {engine} version)")
            log(f"    {why}: {by} {packages[by]['version']} travels too")
        forced.update(clash)
        stable = set(now) == set(reused) and not want and not clash
        reused = now
        if stable:
            break
    left = {n: leave_out[n] for n in sorted(leave_out) if n in packages and n not in reached}
    dropped_with = sorted(n for n in packages if n not in reached and n not in left)
    wheels_dir = out / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    pins = [f"{packages[n]['name']}=={packages[n]['version']}" for n in carried]
    log(f"==> downloading {len(pins)} wheels (pip download --no-deps)")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels_dir), *target_args, *pins],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise EngineEnvError(f"pip download failed: {proc.stderr.strip()[-800:]}")
    by_file = {}
    for n in carried:
        fname = packages[n]["url"].rsplit("/", 1)[-1]
        path = wheels_dir / fname
        if not path.is_file():
            raise EngineEnvError(f"pip download did not write {fname} ({n})")
        digest = sha256_of(path)
        if packages[n]["sha256"] and digest != packages[n]["sha256"]:
            raise EngineEnvError(f"{fname}: sha256 {digest} differs from the index's {packages[n]['sha256']}")
        by_file[fname] = {"name": n, "version": packages[n]["version"], "file": fname, "index_sha256": digest}
    strip = list(spec.strip) + list(args.strip or [])
    for item in strip:
        pkg, _, member = item.partition(":")
        target = next((f for f, w in by_file.items() if w["name"] == canon(pkg)), None)
        if target is None or not member:
            raise EngineEnvError(f"--strip {item}: expected PACKAGE:MEMBER-GLOB of a carried package")
        gone = strip_wheel(wheels_dir / target, [member])
        by_file[target].setdefault("stripped", []).extend(gone)
        log(f"==> stripped from {target}: {', '.join(gone)}")
    # pip itself, in chunk 1: the venv is made without pip (the node's Python may have none) and each
    # install call runs pip from this wheel
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(out / "pip"), "--only-binary=:all:"]
        + [f"pip=={getattr(args, 'pip_version', None) or PIP_VERSION}"],
        capture_output=True,
        text=True,
    )
    pip_whl = next((out / "pip").glob("pip-*.whl"), None)
    if proc.returncode != 0 or pip_whl is None:
        raise EngineEnvError(f"pip download pip failed: {proc.stderr.strip()[-500:]}")
    limit = int(args.split_mb * MIB) if args.split_mb else None
    staged = out / "staged"
    staged.mkdir(exist_ok=True)
    os.replace(pip_whl, staged / pip_whl.name)
    (out / "pip").rmdir()
    sizes: dict[str, int] = {pip_whl.name: (staged / pip_whl.name).stat().st_size}
    for fname, w in by_file.items():
        path = wheels_dir / fname
        w["sha256"] = sha256_of(path)
        w["size"] = path.stat().st_size
        if limit and w["size"] > limit:
            w["parts"] = split_file(path, staged, limit)
            sizes.update({p["file"]: p["size"] for p in w["parts"]})
        else:
            shutil.copyfile(path, staged / fname)
            sizes[fname] = w["size"]
    chunks = pack_chunks(sizes, limit, first=(pip_whl.name,)) if limit else [sorted(sizes)]
    where = {f: f"chunk-{i + 1}" for i, c in enumerate(chunks) for f in c}
    for w in by_file.values():
        for p in w.get("parts", []):
            p["chunk"] = where[p["file"]]
        if "parts" not in w:
            w["chunk"] = where[w["file"]]
    manifest = {
        "format": FORMAT,
        "engine": args.engine,
        "executable": engine,
        "build_id": hashlib.sha256(json.dumps(sorted(by_file.items()), sort_keys=True).encode()).hexdigest()[:16],
        "target": {"python": ".".join((args.python_version or "").split(".")[:2]), "args": target_args},
        "check_imports": list(spec.check_imports),
        "pip": {"file": pip_whl.name, "sha256": sha256_of(staged / pip_whl.name)},
        "wheels": sorted(by_file.values(), key=lambda w: w["name"]),
        "reused": reused,
        "left_out": left,
        "left_out_with_them": dropped_with,
        "chunks": len(chunks),
        "total_size": sum(w["size"] for w in by_file.values()),
    }
    for i, files in enumerate(chunks):
        d = out / f"chunk-{i + 1}" if limit else out
        d.mkdir(exist_ok=True)
        for f in files:
            os.replace(staged / f, d / f)
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(staged)
    shutil.rmtree(wheels_dir)
    log(summary(manifest))
    log(f"==> engine wheelhouse in {out} ({time.monotonic() - t0:.0f} s)")
    return manifest


def summary(m: dict) -> str:
    lines = [f"{m['engine']}: {len(m['wheels'])} wheels, {m['total_size'] / MIB:.1f} MiB in {m['chunks']} chunk(s)"]
    for w in sorted(m["wheels"], key=lambda w: -w["size"]):
        where = f"{len(w['parts'])} parts" if "parts" in w else w["chunk"]
        note = f"; stripped {', '.join(w['stripped'])}" if w.get("stripped") else ""
        lines.append(f"  {w['name']}=={w['version']}  {w['size'] / MIB:.1f} MiB  ({where}{note})")
    node = ", ".join(f"{n} {r['node_version']}" for n, r in sorted(m["reused"].items()))
    lines.append(f"  the node's: {node}")
    lines.append(f"  left out: {', '.join(m['left_out'])}; with them: {', '.join(m['left_out_with_them'])}")
    return "\n".join(lines)


# -- installing on the node -------------------------------------------------------------------


def _read_manifests(dirs: list[Path]) -> dict:
    found = [json.loads((d / MANIFEST).read_text()) for d in dirs if (d / MANIFEST).is_file()]
    missing = [str(d) for d in dirs if not (d / MANIFEST).is_file()]
    if missing:
        raise EngineEnvError(f"{', '.join(missing)}: no {MANIFEST} (not a chunk of `wheelhouse.sh build --engine`)")
    if len({m["build_id"] for m in found}) > 1:
        raise EngineEnvError("these chunks come from different builds: use the chunks of one build")
    return found[0]


def _py(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def site_dirs_of(python: str) -> tuple[str, list[str], str]:
    """A Python's version, its site directories (torch's first) and its torch's version, for the .pth
    (as devtools/wheelhouse.py's --reuse-torch reads them)."""
    code = (
        "import json,os,site,sys\n"
        "try:\n import torch; t=os.path.dirname(os.path.dirname(torch.__file__)); v=torch.__version__\n"
        "except Exception as e:\n t=None; v='missing: %s'%e\n"
        "dirs=[d for d in ([t] if t else [])+site.getsitepackages() if d and os.path.isdir(d)]\n"
        "print(json.dumps({'python':'%d.%d'%sys.version_info[:2],'dirs':list(dict.fromkeys(dirs)),'torch':v}))"
    )
    try:
        proc = _run([python, "-c", code])
    except OSError as e:
        raise EngineEnvError(f"--reuse-torch {python}: it does not run ({e.strerror})") from e
    if proc.returncode != 0:
        raise EngineEnvError(f"--reuse-torch {python}: it does not run: {proc.stderr.strip()[-300:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    return info["python"], info["dirs"], info["torch"]


def install(dirs: list[Path], venv: Path, reuse_python: str, check: bool = True, log=print) -> int:
    """Install what these chunks carry into the engine venv; the last chunk finishes: checks and imports."""
    venv = venv.absolute()
    state = venv / STATE
    if dirs:
        manifest = _read_manifests(dirs)
    elif (state / MANIFEST).is_file():
        manifest = json.loads((state / MANIFEST).read_text())
    else:
        raise EngineEnvError(f"no chunk given and {venv} has no engine install begun: pass a chunk directory")
    py, site_dirs, torch_version = site_dirs_of(reuse_python)
    if torch_version.startswith("missing"):
        raise EngineEnvError(f"--reuse-torch {reuse_python}: torch does not import there ({torch_version})")
    want = manifest["target"]["python"]
    if want and py != want:
        raise EngineEnvError(f"--reuse-torch {reuse_python} is Python {py}; the engine wheelhouse is for {want}")
    if not _py(venv).exists():
        log(f"==> creating {venv} from {reuse_python} (its torch {torch_version} reused)")
        proc = _run([reuse_python, "-m", "venv", "--without-pip", venv])
        if proc.returncode != 0:
            raise EngineEnvError(f"{reuse_python} -m venv {venv} failed: {proc.stderr.strip()[-500:]}")
    site = next(Path(venv).glob("lib/python*/site-packages"))
    # After the venv's own site-packages: the engine's pins (numba...) win, the node's torch is found.
    (site / "_nemoflow_reuse.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs))
    state.mkdir(exist_ok=True)
    (state / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    pip_whl = state / manifest["pip"]["file"]
    if not pip_whl.is_file():
        src = next((d / pip_whl.name for d in dirs if (d / pip_whl.name).is_file()), None)
        if src is None:
            raise EngineEnvError(f"{venv} has no pip yet and these directories carry none: install chunk-1 first")
        if sha256_of(src) != manifest["pip"]["sha256"]:
            raise EngineEnvError(f"{src}: sha256 differs from the build's record (damaged): copy it again")
        shutil.copyfile(src, pip_whl)
    done_file = state / "installed.json"
    done = set(json.loads(done_file.read_text())) if done_file.is_file() else set()
    ready: list[Path] = []
    for w in manifest["wheels"]:
        if w["file"] in done:
            continue
        if "parts" not in w:
            src = next((d / w["file"] for d in dirs if (d / w["file"]).is_file()), None)
            if src is not None:
                if sha256_of(src) != w["sha256"]:
                    raise EngineEnvError(f"{src}: sha256 differs from the build's record (damaged): copy it again")
                ready.append(src)
            continue
        for p in w["parts"]:  # stage each part here as it arrives, checked, until all are here
            src = next((d / p["file"] for d in dirs if (d / p["file"]).is_file()), None)
            if src is not None and not (state / p["file"]).is_file():
                if sha256_of(src) != p["sha256"]:
                    raise EngineEnvError(f"{src}: sha256 differs from the build's record (damaged): copy it again")
                shutil.copyfile(src, state / (p["file"] + ".tmp"))
                os.replace(state / (p["file"] + ".tmp"), state / p["file"])
        if all((state / p["file"]).is_file() for p in w["parts"]):
            joined = join_parts([state / p["file"] for p in w["parts"]], state / w["file"], w["sha256"])
            for p in w["parts"]:
                (state / p["file"]).unlink()
            log(f"==> joined {w['file']} from {len(w['parts'])} parts (sha256 verified)")
            ready.append(joined)
    if ready:
        log(f"==> installing {len(ready)} wheels ({sum(p.stat().st_size for p in ready) / MIB:.1f} MiB), no network")
        t0 = time.monotonic()
        # pip run from its wheel by the venv's Python: the venv needs no pip of its own, the node's is not used
        proc = _run(
            [_py(venv), pip_whl / "pip", "install", "--isolated", "--no-index", "--no-deps"]
            + ["--ignore-installed", "--no-compile", "-q", *ready],
            env={**os.environ, "PIP_NO_INDEX": "1"},
        )
        if proc.returncode != 0:
            raise EngineEnvError(f"pip install into {venv} failed: {proc.stderr.strip()[-1500:]}")
        log(f"    done in {time.monotonic() - t0:.0f} s")
        done |= {p.name for p in ready}
        done_file.write_text(json.dumps(sorted(done)) + "\n")
        for p in ready:
            if p.parent == state:
                p.unlink()  # a joined wheel: installed, its bytes are not needed again
    missing = [w for w in manifest["wheels"] if w["file"] not in done]
    if missing:
        # the chunks still to come: a missing wheel's, or a missing wheel's parts not staged here yet
        chunks = sorted(
            {w["chunk"] for w in missing if "parts" not in w}
            | {p["chunk"] for w in missing for p in w.get("parts", []) if not (state / p["file"]).is_file()}
        )
        log(
            f"==> {len(manifest['wheels']) - len(missing)} of {len(manifest['wheels'])} wheels installed; still to "
            f"come: {', '.join(chunks)} ({sum(w['size'] for w in missing) / MIB:.1f} MiB)"
        )
        return 0
    problems = check_reused(venv, manifest)
    for p in problems:
        log(f"error: {p}")
    if problems:
        return 1
    compile_bytecode(venv, log)
    if check:
        code = check_imports(venv, manifest["check_imports"], log)
        if code:
            return code
        spec = engine_spec(manifest["engine"])
        if spec is not None and spec.prepare:
            prepare(venv, spec.prepare, log)
    (state / "ready").write_text(json.dumps({"engine": manifest["engine"], "build_id": manifest["build_id"]}) + "\n")
    log(f"==> ready: {venv}/bin/{manifest['executable']} (NEMOFLOW_VLLM_PYTHON={venv}/bin/python)")
    return 0


def check_reused(venv: Path, manifest: dict) -> list[str]:
    """The versions the engine venv really sees against what the carried packages require of them."""
    Requirement = _packaging()
    code = (
        "import json,sys,importlib.metadata as m\nout={}\n"
        "for n in json.loads(sys.argv[1]):\n"
        "    try: out[n]=m.version(n)\n"
        "    except m.PackageNotFoundError: out[n]=None\n"
        "print(json.dumps(out))"
    )
    proc = _run([_py(venv), "-c", code, json.dumps(list(manifest["reused"]))])
    if proc.returncode != 0:
        return [f"{venv}/bin/python cannot read its packages: {proc.stderr.strip()[-300:]}"]
    found = json.loads(proc.stdout)
    problems = []
    for name, info in manifest["reused"].items():
        have = found.get(name)
        if have is None:
            problems.append(f"{name}: the build expected the node to have it, the engine venv does not see it")
            continue
        for line in info["requires"]:
            by, _, req = line.partition(": ")
            if not Requirement(req).specifier.contains(have, prereleases=True):
                problems.append(f"{by} requires {req}; the node has {name} {have}")
    return problems


def prepare(venv: Path, code: str, log=print) -> bool:
    """Run an engine's one-time preparation in its venv (as :func:`check_imports` runs Python there); a failure
    is one warning line: the engine then does that work at its first start."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = _run([_py(venv), "-c", code], cwd=tempfile.gettempdir(), env=env)
    if proc.returncode == 0:
        for line in proc.stdout.strip().splitlines()[-3:]:
            log(f"    {line}")
        return True
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    log(f"    warning: the engine's one-time preparation failed ({last}); its first start does that work")
    return False


def compile_bytecode(venv: Path, log=print, sources: tuple[Path, ...] = ()) -> bool:
    """Byte-compile the venv's own packages (and ``sources``, e.g. an editable checkout) once, on every core.

    The chunks install with ``pip --no-compile`` (each chunk's call stays short), so a module's ``.pyc`` is
    written at its first import, unless the environment sets PYTHONDONTWRITEBYTECODE: the H200 node's does,
    and there every process compiled what it imported again (torchao's SyntaxWarning, a compile-time warning,
    appeared in each training, test and serving process of one machine). compileall writes the files whatever
    that variable says, and Python reads them whatever it says. A file that does not compile (a package's
    deliberately broken test data) is left for Python to report at import, as without this step."""
    code = "import site,sys; print('\\n'.join(p for p in site.getsitepackages() if p.startswith(sys.prefix)))"
    proc = _run([_py(venv), "-c", code], env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    dirs = [d for d in proc.stdout.split() if Path(d).is_dir()] + [str(s) for s in sources if Path(s).is_dir()]
    if proc.returncode != 0 or not dirs:
        log(f"    warning: could not list {venv}'s site-packages: its modules compile at first import")
        return False
    t0 = time.monotonic()
    done = _run([_py(venv), "-m", "compileall", "-q", "-j", "0", *dirs])
    failed = sum(1 for ln in done.stdout.splitlines() if ln.startswith("*** Error compiling"))
    log(
        f"==> byte-compiled {venv}'s packages in {time.monotonic() - t0:.0f} s (later imports read the .pyc files)"
        + (f"; {failed} file(s) did not compile (left as they are)" if failed else "")
    )
    return True


def check_imports(venv: Path, modules: list[str], log=print) -> int:
    """Import each module in the engine venv (outside any checkout, without PYTHONPATH): one line per failure."""
    code = (
        "import importlib,sys,time\nt=time.monotonic(); bad=[]\n"
        "for m in sys.argv[1:]:\n"
        "    try: importlib.import_module(m)\n"
        "    except BaseException as e: bad.append('%s: %s: %s'%(m,type(e).__name__,(str(e).splitlines() or [''])[0][:300]))\n"
        "for b in bad: print('error: import', b)\n"
        "print('imported %d of %d modules in %.0f s'%(len(sys.argv)-1-len(bad), len(sys.argv)-1, time.monotonic()-t))\n"
        "sys.exit(1 if bad else 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = _run([_py(venv), "-c", code, *modules], cwd=tempfile.gettempdir(), env=env)
    for line in proc.stdout.strip().splitlines():
        log(f"    {line}")
    if proc.returncode != 0:
        for line in proc.stderr.strip().splitlines()[-10:]:
            log(f"    {line}")
    return proc.returncode
