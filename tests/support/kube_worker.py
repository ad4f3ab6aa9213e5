"""prefect-kubernetes' own worker process, pointed at the API stand-in (tests/support/kube.py) by a kubeconfig.

What a user runs (``prefect worker start --pool POOL --type kubernetes``), as a subprocess in a session
of its own, with ``KUBECONFIG`` naming the stand-in's plain-HTTP URL. The worker creates each flow-run
Job itself (``generateName``), and its observer (kopf, in a thread of the worker) watches pods and Jobs
labelled ``prefect.io/flow-run-id`` to mark a run Crashed when its Job fails or is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO, VENV_BIN, poll


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for an API server at a plain-HTTP ``url`` without credentials (the stand-in's)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
                "users": [{"name": "test", "user": {}}],
                "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "test"}}],
                "current-context": "stand-in",
            }
        )
    )
    return path


@contextlib.contextmanager
def kubernetes_worker(pool: str, api_url: str, kubeconfig: Path, log: Path, **env: str) -> Iterator[subprocess.Popen]:
    """The worker process for ``pool``; stopped (and its output kept in ``log``) on exit."""
    environment = dict(
        os.environ,
        PREFECT_API_URL=api_url,
        KUBECONFIG=str(kubeconfig),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        **env,
    )
    environment.pop("KUBERNETES_SERVICE_HOST", None)  # the kubeconfig is the way in, not a service account
    out = log.open("w")
    worker = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "kubernetes"],
        cwd=REPO,
        env=environment,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield worker
    finally:
        # prefect-kubernetes' worker ignores its first SIGTERM (it drains): SIGINT, then TERM, then KILL
        for sig, wait_s in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if worker.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=wait_s)
        out.close()


def log_tail(log: Path, lines: int = 60) -> str:
    """The worker's last lines (for a failure message)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no worker log)"


def wait_until(check, timeout_s: float, every_s: float = 0.5):
    """``check()``'s first truthy value, or None after ``timeout_s``."""
    return poll(check, timeout_s, every_s)
