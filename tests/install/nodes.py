"""A stand-in for a GPU node's Python: a venv whose site-packages links to some of this environment's packages.

An H200 node has a Python with torch and ~200 other packages and no network. Here the same shape
costs no copying: a venv made from this interpreter's base Python, with symlinks to the
distributions it should have (torch, and the names of deployments/nodes/h200-freeze.txt that this
environment has), at this environment's versions.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def freeze_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canon(re.split(r"[=<>@ ]", line, maxsplit=1)[0]))
    return names


def closure(names: set[str]) -> set[str]:
    """The names and everything they require in this environment (a node's environment is consistent)."""
    from packaging.requirements import Requirement

    dists = {canon(d.metadata["Name"] or ""): d for d in md.distributions()}
    todo, out = [n for n in names if n in dists], set()
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and canon(req.name) in dists:
                todo.append(canon(req.name))
    return out


def make_node(root: Path, names: set[str]) -> Path:
    """A venv at ``root`` that has the distributions ``names`` of this environment; returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    names = closure(names)
    linked = set()
    for dist in md.distributions():
        name = canon(dist.metadata["Name"] or "")
        if name not in names or name in linked:
            continue
        linked.add(name)
        origin = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            src, dst = origin / top, site / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
    missing = names - linked
    if "torch" in missing:
        raise RuntimeError("this environment has no torch to give the node")
    return python
