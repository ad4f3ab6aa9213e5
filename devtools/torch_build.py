"""Which torch build a machine needs, and one line when the installed one cannot use its GPU.

``scripts/setup.sh`` asks this module before it installs torch and again after:

    python3 devtools/torch_build.py choose --torch auto      # shell assignments: TORCH_VARIANT, TORCH_REASON, ...
    .venv/bin/python devtools/torch_build.py check           # "torch 2.13.0+cu130 (CUDA 13.0) sees 1 GPU: ..." or
                                                              # the mismatch line (exit 1)

It runs before the virtualenv exists, so it uses the standard library only.

A GPU is found through ``nvidia-smi`` (its header carries the driver version and the newest CUDA
the driver supports) or, where nvidia-smi is missing, through ``/proc/driver/nvidia`` (the kernel
module's version; the CUDA version then comes from the driver table below). The parsers are pure
functions of captured output (tests/install/).

The builds. PyPI's Linux wheel of torch 2.13.0 is the CUDA 13.0 build (its metadata requires
cuda-toolkit==13.0.3 and triton==3.7.1); download.pytorch.org/whl/<tag> serves the CPU build and
builds for older CUDA versions (``torch==2.13.0+cu126``). A CUDA 13 build needs a driver >= 580;
a CUDA 12.x build runs on any driver >= 525.60.13 (CUDA's minor-version compatibility), so an
older node takes the newest CUDA 12 build. The list of CUDA builds is what PyTorch published for
its recent releases (cu126, cu128, cu130); ``--torch cuNNN`` installs any other tag the index has.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The PyTorch index; NEMOFLOW_TORCH_INDEX replaces it (a mirror: <base>/cpu, <base>/cu126, ...).
TORCH_INDEX = "https://download.pytorch.org/whl"
# CUDA builds, newest first: (tag, CUDA version). PYPI_CUDA is the one PyPI's plain wheel is.
CUDA_BUILDS = [("cu130", (13, 0)), ("cu128", (12, 8)), ("cu126", (12, 6))]
PYPI_CUDA = "cu130"
# The oldest Linux driver each CUDA major version runs on (minor-version compatibility; CUDA's
# release notes, "CUDA Toolkit and Minimum Required Driver Version").
MIN_DRIVER = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}
# The newest CUDA each driver branch supports (the "toolkit driver version" table), for nodes
# where nvidia-smi is missing and only the kernel module's version is known.
DRIVER_CUDA = [
    ("580.65.06", (13, 0)),
    ("575.51.03", (12, 9)),
    ("570.26", (12, 8)),
    ("560.28.03", (12, 6)),
    ("555.42.02", (12, 5)),
    ("550.54.14", (12, 4)),
    ("545.23.06", (12, 3)),
    ("535.54.03", (12, 2)),
    ("530.30.02", (12, 1)),
    ("525.60.13", (12, 0)),
    ("520.61.05", (11, 8)),
    ("450.80.02", (11, 0)),
]


class DriverTooOld(RuntimeError):
    """No CUDA build of torch runs on this driver; the message names the driver and the way out."""


@dataclass(frozen=True)
class Node:
    """What this machine's NVIDIA driver says: the GPUs, the driver and the newest CUDA it supports."""

    gpus: list[str] = field(default_factory=list)
    driver: str | None = None
    cuda: tuple[int, int] | None = None
    source: str = "nvidia-smi"

    def describe(self) -> str:
        names = sorted(set(self.gpus))
        what = f"{len(self.gpus)} NVIDIA GPU{'s' if len(self.gpus) != 1 else ''}"
        if names:
            what += f" ({', '.join(names)})"
        return f"{what}, driver {self.driver or '?'}, CUDA {_v(self.cuda) if self.cuda else '?'} (via {self.source})"


@dataclass(frozen=True)
class Choice:
    variant: str  # "cpu" or a CUDA tag ("cu130")
    reason: str


def _v(t: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in t)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


# -- parsing what the driver says (pure) ------------------------------------------------------


def parse_smi(text: str) -> tuple[str | None, tuple[int, int] | None]:
    """Driver version and CUDA version from ``nvidia-smi``'s header (or ``nvidia-smi -q``).

    >>> parse_smi("| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |")
    ('535.104.05', (12, 2))
    """
    driver = re.search(r"Driver Version\s*:?\s*([0-9][0-9.]*)", text)
    cuda = re.search(r"CUDA Version\s*:?\s*([0-9]+)\.([0-9]+)", text)
    return (driver.group(1) if driver else None, (int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def parse_smi_list(text: str) -> list[str]:
    """GPU names from ``nvidia-smi -L`` ("GPU 0: NVIDIA H200 (UUID: GPU-...)"); MIG lines are skipped."""
    return [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?\s*$", text, re.M)]


def parse_proc_version(text: str) -> str | None:
    """The kernel module's version from ``/proc/driver/nvidia/version``."""
    m = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9]+\.[0-9.]+)", text)
    return m.group(1) if m else None


def cuda_for_driver(driver: str) -> tuple[int, int] | None:
    """The newest CUDA a driver version supports (None below CUDA 11)."""
    d = _version(driver)
    for minimum, cuda in DRIVER_CUDA:
        if d >= _version(minimum):
            return cuda
    return None


def probe(run=subprocess.run, proc_root: str = "/proc") -> Node | None:
    """This machine's GPUs, or None when it has no NVIDIA driver with a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            head = run([smi], capture_output=True, text=True, timeout=60)
            lst = run([smi, "-L"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            head = lst = None
        if head is not None and head.returncode == 0:
            driver, cuda = parse_smi(head.stdout)
            gpus = parse_smi_list(lst.stdout) if lst is not None and lst.returncode == 0 else []
            if gpus and driver:
                return Node(gpus, driver, cuda or cuda_for_driver(driver), "nvidia-smi")
    try:
        text = Path(proc_root, "driver/nvidia/version").read_text()
    except OSError:
        return None
    gpus = sorted(glob.glob(os.path.join(proc_root, "driver/nvidia/gpus/*")))
    driver = parse_proc_version(text)
    if not gpus or not driver:
        return None
    names = []
    for g in gpus:
        try:
            m = re.search(r"^Model:\s*(.+)$", Path(g, "information").read_text(), re.M)
        except OSError:
            m = None
        names.append(m.group(1).strip() if m else "GPU")
    return Node(names, driver, cuda_for_driver(driver), "/proc/driver/nvidia")


# -- choosing a build (pure) ------------------------------------------------------------------


def build_for(node: Node) -> tuple[str, str]:
    """The newest CUDA build of torch that runs on this node's driver, and why."""
    if node.cuda is None:
        raise DriverTooOld(f"this node's NVIDIA driver {node.driver} is too old for any CUDA build of torch")
    for tag, cuda in CUDA_BUILDS:
        if cuda <= node.cuda:
            return tag, f"the newest build for CUDA <= {_v(node.cuda)}"
    # Older than every build of its major version: minor-version compatibility still runs them.
    same_major = [(tag, cuda) for tag, cuda in CUDA_BUILDS if cuda[0] == node.cuda[0]]
    if same_major and _version(node.driver or "0") >= _version(MIN_DRIVER[node.cuda[0]]):
        tag, cuda = same_major[-1]
        return tag, f"CUDA {_v(cuda)} runs on CUDA {_v(node.cuda)}'s driver by minor-version compatibility"
    oldest = CUDA_BUILDS[-1]
    need = MIN_DRIVER[oldest[1][0]]
    raise DriverTooOld(
        f"this node's NVIDIA driver {node.driver} supports CUDA {_v(node.cuda)}; the oldest CUDA build of torch "
        f"({oldest[0]}) needs driver >= {need}: upgrade the driver, or install the CPU build (scripts/setup.sh --torch cpu)"
    )


def choose(request: str, node: Node | None) -> Choice:
    """The torch build for ``--torch REQUEST`` (auto, cpu, cuda or a tag such as cu126) on this node."""
    request = (request or "auto").strip().lower()
    if request == "cpu":
        return Choice("cpu", "asked for (--torch cpu)")
    if re.fullmatch(r"cu\d{3}", request):
        return Choice(request, f"asked for (--torch {request})")
    if request == "cuda":
        if node is None:
            return Choice(PYPI_CUDA, f"asked for (--torch cuda); no GPU here to match, so PyPI's build ({PYPI_CUDA})")
        tag, why = build_for(node)
        return Choice(tag, f"asked for (--torch cuda); {node.describe()}: {why}")
    if request != "auto":
        raise ValueError(f"--torch {request!r}: expected auto, cpu, cuda or a CUDA tag such as cu126")
    if node is None:
        return Choice("cpu", "no NVIDIA GPU found (no nvidia-smi, no /proc/driver/nvidia)")
    tag, why = build_for(node)
    return Choice(tag, f"found {node.describe()}: {why}")


def torch_requirement(variant: str, version: str, system: str = "Linux") -> str:
    """The exact requirement for this build (``===``: ``torch===2.13.0`` never matches ``2.13.0+cpu``)."""
    if variant == PYPI_CUDA or (variant == "cpu" and system != "Linux"):
        return f"torch==={version}"  # PyPI's own wheel (on macOS and Windows, the CPU build)
    return f"torch==={version}+{variant}"


def torch_index(variant: str, system: str = "Linux") -> str | None:
    """Where the build comes from: None for PyPI (and the configured pip indexes), else the PyTorch index."""
    if variant == PYPI_CUDA or (variant == "cpu" and system != "Linux"):
        return None
    return f"{os.environ.get('NEMOFLOW_TORCH_INDEX', TORCH_INDEX).rstrip('/')}/{variant}"


# -- after the install: can this torch use this node's GPU? (pure) -----------------------------


def build_of(torch_version: str, torch_cuda: str | None) -> str:
    """``2.13.0+cu130`` -> ``cu130``; a build without a local label reports by torch.version.cuda."""
    local = torch_version.partition("+")[2]
    if local:
        return local
    if torch_cuda:
        return "cu" + "".join(torch_cuda.split(".")[:2])
    return "cpu"


FIX = "install the {variant} build with `scripts/setup.sh --torch {variant}`"


def mismatch(
    torch_version: str, torch_cuda: str | None, cuda_available: bool, node: Node | None, fix: str = FIX
) -> str | None:
    """One line naming why this torch cannot use this node's GPU and the command that fixes it, or None.

    ``fix`` is the remedy with ``{variant}`` where the right build goes (FIX, the default, for
    an install by scripts/setup.sh).
    """
    if node is None or cuda_available:
        return None
    if not torch_cuda:
        return f"torch {torch_version} is the CPU build but this machine has {node.describe()}: {fix.format(variant='cuda')}"
    built = _version(torch_cuda)[:2]
    need = MIN_DRIVER.get(built[0])
    driver = _version(node.driver or "0")
    too_old = (need is not None and driver < _version(need)) or (node.cuda is not None and node.cuda[0] < built[0])
    if too_old:
        try:
            how = fix.format(variant=build_for(node)[0])
        except DriverTooOld:
            how = f"upgrade the driver to >= {need or '?'}, or {fix.format(variant='cpu')}"
        return (
            f"torch {torch_version} is built for CUDA {torch_cuda}, which needs NVIDIA driver >= "
            f"{need or '?'}; this node's driver {node.driver} supports CUDA "
            f"{_v(node.cuda) if node.cuda else '?'}: {how}"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"torch {torch_version} (CUDA {torch_cuda}) sees no GPU although this machine has {node.describe()}: "
        f"check CUDA_VISIBLE_DEVICES ({'unset' if visible is None else repr(visible)}) and that /dev/nvidia* "
        f"is visible to this process"
    )


# -- command line ---------------------------------------------------------------------------


def _cmd_choose(args) -> int:
    import platform

    try:
        choice = choose(args.torch, probe())
    except (DriverTooOld, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    system = platform.system()
    index = torch_index(choice.variant, system)
    out = {
        "TORCH_VARIANT": choice.variant,
        "TORCH_REASON": choice.reason,
        "TORCH_REQUIREMENT": torch_requirement(choice.variant, args.torch_version, system),
        "TORCH_INDEX": index or "",
    }
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")
    return 0


def _cmd_check(args) -> int:
    try:
        import torch
    except ImportError as e:
        print(f"error: torch does not import in {sys.executable}: {e}", file=sys.stderr)
        return 1
    node = probe()
    available = bool(torch.cuda.is_available())
    line = mismatch(torch.__version__, torch.version.cuda, available, node, args.fix)
    if line:
        print(f"error: {line}", file=sys.stderr)
        return 1
    where = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    if available:
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        print(f"torch {torch.__version__} ({where}) sees {n} GPU{'s' if n != 1 else ''}: {', '.join(names)}")
    else:
        print(f"torch {torch.__version__} ({where}); no NVIDIA GPU on this machine")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="devtools/torch_build.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("choose", help="print the build to install as shell assignments")
    c.add_argument("--torch", default=os.environ.get("NEMOFLOW_TORCH", "auto"), help="auto, cpu, cuda or cuNNN")
    c.add_argument("--torch-version", required=True, help="the pinned torch version (constraints.txt)")
    k = sub.add_parser("check", help="exit 1 with one line when the installed torch cannot use this GPU")
    k.add_argument("--fix", default=FIX, help="the remedy, {variant} filled in (default: %(default)s)")
    args = p.parse_args(argv)
    return _cmd_choose(args) if args.cmd == "choose" else _cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
