"""The podman flags a container needs to start on this kind of host, found once per process.

Two host properties break podman's defaults (measured on the Debian 12 VMs nemoflow is
tested on, podman 4.3 as root):

- **Hybrid cgroups** (v1 controllers plus a v2 hierarchy at ``/sys/fs/cgroup/unified``
  that has controllers of its own): crun refuses with "cgroups in hybrid mode not
  supported"; runc runs the container (cgroupfs manager, cgroup v1).
- **No CAP_SYS_RESOURCE**: podman asks for ``RLIMIT_NOFILE`` 1048576 and ``RLIMIT_NPROC``
  4194304, above this process's hard limits, and the runtime's ``setrlimit`` fails with
  "Operation not permitted". The limits are passed explicitly instead: open files at the
  current hard limit, processes at ``min(hard limit, kernel.pid_max)`` (higher values were
  refused even below the hard limit).

On a host where neither applies the flags are harmless (runc is only chosen for hybrid
cgroups, and the limits equal what a process there may set).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess

PODMAN = os.environ.get("NEMOFLOW_PODMAN", "podman")
# podman's own defaults (containers.conf): never ask for more than these
_MAX_NOFILE = 1048576
_MAX_NPROC = 4194304


class PodmanMissing(RuntimeError):
    pass


def _hybrid_cgroups() -> bool:
    try:
        with open("/sys/fs/cgroup/unified/cgroup.controllers", encoding="ascii") as fh:
            return bool(fh.read().split())
    except OSError:
        return False


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max", encoding="ascii") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return _MAX_NPROC


@functools.cache
def global_args() -> tuple[str, ...]:
    """Flags before the podman subcommand (the OCI runtime)."""
    if _hybrid_cgroups() and shutil.which("runc"):
        return ("--runtime", "runc")
    return ()


@functools.cache
def limit_args() -> tuple[str, ...]:
    """``--ulimit`` flags for ``podman run`` / ``podman build`` that this host lets the runtime set."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = _MAX_NOFILE if nofile == resource.RLIM_INFINITY else min(nofile, _MAX_NOFILE)
    nproc = _MAX_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, _MAX_NPROC)
    nproc = min(nproc, _pid_max())
    return ("--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}")


def command(*args: str) -> list[str]:
    """``podman <global flags> args...``; raises :class:`PodmanMissing` naming the install command."""
    exe = shutil.which(PODMAN)
    if not exe:
        raise PodmanMissing(
            f"{PODMAN} not found; install it (Debian/Ubuntu: apt-get install podman runc buildah mmdebstrap)"
        )
    return [exe, *global_args(), *args]


def run_args(*args: str) -> list[str]:
    """``podman run`` with the runtime and limits this host needs, then ``args``."""
    return command("run", *limit_args(), *args)


def image_exists(ref: str) -> bool:
    return subprocess.run(command("image", "exists", ref), check=False).returncode == 0
