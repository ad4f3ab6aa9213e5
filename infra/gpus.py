"""The GPUs of this machine, as the driver and as torch see them: checked before a local job asks for any.

    gpus = probe()                     # nvidia-smi, then torch in a subprocess (cached for the process)
    prefetch()                         # the same in the background, for a later probe() (the local backend)
    check_request(2, gpus)             # raises GpuRequestError with one line naming the problem and the fix

Three ways a request for GPUs goes wrong before anything runs, each with its own message: the machine has
no NVIDIA GPU (or CUDA_VISIBLE_DEVICES hides them); torch cannot use the GPUs the driver lists (a CPU build
of torch, or a CUDA build newer than the driver supports); fewer GPUs than asked for. The local backend
checks every job and service that asks for GPUs (infra/backends/local.py), and ``nemoflow demo`` checks
before it starts anything; Slurm and Kubernetes check against their partition or node capacity instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass

INSTALL_HINT = "scripts/setup.sh --torch cuda (docs/install.md: 'A GPU machine')"


class GpuRequestError(ValueError):
    """A job asks for GPUs this machine cannot give it; the message names the problem and the fix."""


@dataclass(frozen=True)
class LocalGpus:
    names: tuple[str, ...]  # the GPUs nvidia-smi lists (the driver's view)
    driver_version: str | None
    driver_cuda: str | None  # the newest CUDA the driver supports ("CUDA Version" in nvidia-smi's header)
    torch_version: str | None
    torch_cuda: str | None  # the CUDA torch was built for; None for a CPU build
    torch_count: int  # GPUs torch can use here (0 when it cannot use any)
    torch_error: str | None = None  # why torch cannot use them, as torch says
    visible: str | None = None  # CUDA_VISIBLE_DEVICES, when set

    @property
    def usable(self) -> int:
        return self.torch_count


def parse_query(text: str) -> tuple[list[str], str | None]:
    """GPU names and the driver version from ``nvidia-smi --query-gpu=name,driver_version --format=csv,noheader``.

    >>> parse_query("NVIDIA H200, 580.159.03\\nNVIDIA H200, 580.159.03\\n")
    (['NVIDIA H200', 'NVIDIA H200'], '580.159.03')
    >>> parse_query("")
    ([], None)
    """
    names, driver = [], None
    for line in text.splitlines():
        if "," in line:
            name, _, version = line.rpartition(",")
            names.append(name.strip())
            driver = version.strip() or driver
    return names, driver


def parse_cuda_version(header: str) -> str | None:
    """The CUDA version the driver supports, from ``nvidia-smi``'s table header.

    >>> parse_cuda_version("| NVIDIA-SMI 580.159.03   Driver Version: 580.159.03   CUDA Version: 13.0     |")
    '13.0'
    >>> parse_cuda_version("No devices were found") is None
    True
    """
    match = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)?)", header)
    return match.group(1) if match else None


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:2])


_TORCH_PROBE = (
    "import json, torch\n"
    "out = {'version': torch.__version__, 'cuda': torch.version.cuda, 'count': 0, 'error': None}\n"
    "try:\n"
    "    out['count'] = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "    if out['cuda'] and not out['count']:\n"
    "        torch.cuda.init()\n"
    "except Exception as exc:\n"
    "    out['error'] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__\n"
    "print(json.dumps(out))\n"
)


_PROBING = threading.Lock()  # one probe at a time: a prefetch in flight is waited for, not run twice
_PREFETCHED: set[str] = set()


def probe(python: str = sys.executable) -> LocalGpus:
    """This machine's GPUs (nvidia-smi) and what ``python``'s torch makes of them (a subprocess: a torch that
    cannot initialise CUDA must not take this process with it). Cached for the process."""
    with _PROBING:
        return _probe(python)


def _cache_clear() -> None:
    _probe.cache_clear()
    _PREFETCHED.clear()


probe.cache_clear = _cache_clear  # type: ignore[attr-defined]


def prefetch(python: str = sys.executable) -> None:
    """Probe in the background, once per process, where there is a GPU to probe: the first job that asks for GPUs
    then finds the answer instead of waiting for torch's import and CUDA's start in the subprocess. On the H200
    node that wait was the GPU demo's pretrain stage's "queue and launch" (6.0 s at e5b86ee, against 0.1 s for the
    validate stage after it, which found the probe cached); the local backend starts it when it is made, so it
    runs beside the flow's first stages (staging the image, preparing the data)."""
    if python in _PREFETCHED or not shutil.which("nvidia-smi"):
        return
    _PREFETCHED.add(python)
    threading.Thread(target=probe, args=(python,), name="gpu-probe", daemon=True).start()


@functools.cache
def _probe(python: str) -> LocalGpus:
    names: list[str] = []
    driver = cuda = None
    if shutil.which("nvidia-smi"):
        query = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
        names, driver = parse_query(query)
        cuda = parse_cuda_version(_run(["nvidia-smi"]))
    torch = {"version": None, "cuda": None, "count": 0, "error": None}
    if names:
        out = _run([python, "-c", _TORCH_PROBE], timeout=120)
        try:
            torch = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            torch["error"] = "torch could not be imported"
    return LocalGpus(
        names=tuple(names),
        driver_version=driver,
        driver_cuda=cuda,
        torch_version=torch["version"],
        torch_cuda=torch["cuda"],
        torch_count=int(torch["count"] or 0),
        torch_error=torch["error"],
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def _run(command: list[str], timeout: float = 30) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def check_request(requested: int, gpus: LocalGpus, what: str = "the job") -> None:
    """Raise :class:`GpuRequestError` unless this machine can give ``requested`` GPUs to ``what``."""
    if requested <= 0:
        return
    asked = f"{what} asks for {requested} GPU{'s' if requested > 1 else ''}"
    if not gpus.names:
        raise GpuRequestError(
            f"{asked} but this machine has no NVIDIA GPU (nvidia-smi lists none): set gpus_per_node: 0 to run on "
            "the CPU, or use a slurm or k8s executor that reaches GPU nodes"
        )
    listed = f"{len(gpus.names)} x {gpus.names[0]}" + (f", driver {gpus.driver_version}" if gpus.driver_version else "")
    if gpus.visible is not None and gpus.visible.strip() in ("", "-1"):
        raise GpuRequestError(
            f"{asked} but CUDA_VISIBLE_DEVICES={gpus.visible!r} hides this machine's GPUs ({listed}): unset it "
            "or name the GPUs to use"
        )
    if gpus.torch_version and not gpus.torch_cuda:
        raise GpuRequestError(
            f"{asked} but torch {gpus.torch_version} is a CPU build and cannot use this machine's GPUs "
            f"({listed}): install the CUDA build with {INSTALL_HINT}"
        )
    if gpus.torch_count == 0:
        if gpus.driver_cuda and gpus.torch_cuda and _version(gpus.torch_cuda) > _version(gpus.driver_cuda):
            raise GpuRequestError(
                f"{asked} but torch {gpus.torch_version} is built for CUDA {gpus.torch_cuda} and this machine's "
                f"driver {gpus.driver_version} supports CUDA up to {gpus.driver_cuda} ({listed}): install a torch "
                f"built for CUDA {gpus.driver_cuda} or older ({INSTALL_HINT}), or update the NVIDIA driver"
            )
        why = f" ({gpus.torch_error})" if gpus.torch_error else ""
        raise GpuRequestError(
            f"{asked} but torch {gpus.torch_version or '(not importable)'} cannot use this machine's GPUs "
            f"({listed}){why}: check the driver (nvidia-smi) and the torch install ({INSTALL_HINT})"
        )
    if requested > gpus.torch_count:
        raise GpuRequestError(
            f"{asked} but this machine has {gpus.torch_count} usable ({listed}): set gpus_per_node to "
            f"{gpus.torch_count} or fewer"
        )
