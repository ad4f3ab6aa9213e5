"""The Python environment as an "image": what jobs run in when no container is used.

The local backend, and Slurm clusters whose nodes share nemoflow's environment
(``image.source: python-env``), run workloads with an interpreter instead of a
container. Its identity (interpreter + installed distributions) is recorded as
the image's checksum, so every artifact still says what produced it.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import metadata

from infra.jobs import ImageRef

PYTHON_ENV = "python-env"


def _distributions() -> list[str]:
    return sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]})


def identity() -> str:
    """The interpreter, its version and every installed distribution, hashed (cheap: no subprocess)."""
    parts = [sys.executable, sys.version, *_distributions()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def freeze() -> list[str]:
    """``pip freeze --all``, sorted: what a person can reproduce to check the recorded checksum."""
    import subprocess

    try:
        frozen = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True, timeout=120
        ).stdout
    except (subprocess.SubprocessError, OSError):
        frozen = "\n".join(_distributions())  # venvs made without pip (uv): the distributions say the same
    return sorted(line for line in frozen.splitlines() if line.strip())


def python_env_ref() -> ImageRef:
    """The environment as an ImageRef: the interpreter, and sha256 of ``pip freeze --all | sort``."""
    lines = freeze()
    return ImageRef(
        kind=PYTHON_ENV,
        uri=sys.executable,
        checksum="sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest(),
        source=f"Python {'.'.join(map(str, sys.version_info[:3]))}, {len(lines)} packages (pip freeze)",
    )
