"""The model registry on real storage: atomic commits, generation guard, rollback, lineage, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from infra import registry as reg
from infra import storage
from tests.conftest import REPO, VENV_BIN
from tests.support import fault_ledger
from tests.support.fault_server import Fault


def _record(model_id: str, parent: str | None = None, loss: float = 5.0) -> reg.ModelRecord:
    return reg.ModelRecord(
        id=model_id,
        checkpoint=f"/ckpt/{model_id}",
        parent=parent,
        data=[reg.SourceRecord(name=f"{model_id}.jsonl.zst", url=f"/in/{model_id}.jsonl.zst", sha256="ab" * 32)],
        metrics={"held_out_loss": loss, "val_loss": loss + 0.1},
    )


@pytest.fixture
def registry(tmp_path) -> reg.ModelRegistry:
    r = reg.ModelRegistry(str(tmp_path / "registry"))
    r.register(_record("m-a"), promote=True, sources=_record("m-a").data)
    r.register(_record("m-b", "m-a", 4.0), promote=True, sources=_record("m-b").data)
    return r


def test_promote_rollback_lineage_and_history(registry):
    state = registry.read()
    assert (state.generation, state.promoted, state.promotions) == (2, "m-b", ["m-a", "m-b"])
    assert [m.id for m in state.lineage("m-b")] == ["m-b", "m-a"]
    assert set(state.processed_sources) == {"/in/m-a.jsonl.zst", "/in/m-b.jsonl.zst"}
    state = registry.rollback()
    assert state.promoted == "m-a" and state.generation == 3
    with pytest.raises(reg.RegistryError, match="nothing to roll back"):
        registry.rollback()
    state = registry.promote("m-b")
    assert state.promoted == "m-b"
    assert [(h["generation"], h["action"]) for h in registry.history()] == [
        (1, "promote"),
        (2, "promote"),
        (3, "rollback"),
        (4, "promote"),
    ]
    with pytest.raises(reg.UnknownModel, match="no model 'm-zzz'.*known: m-a, m-b"):
        registry.promote("m-zzz")
    with pytest.raises(reg.UnknownModel, match="parent 'm-nope'"):
        registry.register(_record("m-c", "m-nope"))


@pytest.mark.faults
def test_failed_write_leaves_the_old_document(registry, monkeypatch):
    row = fault_ledger.open_row("registry commit failing (disk full)")
    before = storage.read_bytes(registry.document_uri)

    def broken_commit(tmp_uri, final_uri):
        row.injected += 1
        raise OSError("disk full (injected)")

    monkeypatch.setattr(storage, "commit", broken_commit)
    with pytest.raises(OSError, match="injected"):
        registry.rollback()
    monkeypatch.undo()
    assert storage.read_bytes(registry.document_uri) == before
    assert registry.read().promoted == "m-b"
    assert len(registry.history()) == 2  # the failed change is not in the history either
    # what the failed write produced lies only under a temporary name, which readers ignore
    assert all(
        n.startswith(storage.TMP_MARK) or n in ("registry.json", "history", ".lock") for n in os.listdir(registry.uri)
    ), os.listdir(registry.uri)


def test_stale_generation_is_refused(registry):
    base = registry.read().generation
    registry.rollback(expected_generation=base)
    with pytest.raises(reg.ConcurrentUpdate, match=f"generation {base + 1}, not {base}"):
        registry.promote("m-b", expected_generation=base)
    assert registry.read().promoted == "m-a"


def test_concurrent_writers_on_a_local_disk_never_lose_an_update(tmp_path):
    r = reg.ModelRegistry(str(tmp_path / "registry"))
    r.register(_record("m-0"), promote=True)
    errors = []

    def add(i: int) -> None:
        try:
            r.register(_record(f"m-{i}", "m-0"))
        except Exception as exc:  # noqa: BLE001 - collected, then asserted on
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = r.read()
    assert not errors
    assert len(state.models) == 9 and state.generation == 9


# One writer process: adds model argv[2] (child of m-0) to the registry at argv[1], as a refresh on another
# machine would; prints the generation it committed and how many races it lost before.
WRITER = """
import sys
from infra import registry as reg
registry = reg.ModelRegistry(sys.argv[1])
state = registry.register(reg.ModelRecord(id=sys.argv[2], checkpoint="/ckpt/" + sys.argv[2], parent="m-0"))
print("committed", state.generation, "conflicts", registry.conflicts)
"""


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.gcs
def test_concurrent_writers_on_gcs_never_lose_an_update(tmp_path):
    """8 writer processes read the same generation of registry.json on gs:// (their first reads are held
    until all 8 arrived), then all commit: every update must land, none overwritten, each in its own
    generation. Against fake-gcs-server, which enforces ifGenerationMatch as GCS does."""
    from tests.support.fake_gcs import fake_gcs_server
    from tests.support.fault_proxy import FaultProxy

    writers = 8
    row = fault_ledger.open_row(f"registry race on gs://: {writers} writers read one generation, then commit")
    with fake_gcs_server(tmp_path / "fake-gcs.log") as endpoint, FaultProxy(endpoint) as proxy:
        env = dict(os.environ, NEMOFLOW_GCS_ENDPOINT=endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NEMOFLOW_GCS_ENDPOINT", endpoint)
            from infra.settings import reload_settings

            reload_settings()
            storage.filesystem("gs://x").mkdir("registry-race")
            uri = "gs://registry-race/registry"
            reg.ModelRegistry(uri).register(_record("m-0"), promote=True)
        reload_settings()

        together = threading.Barrier(writers, timeout=120)
        document = r"^GET /(download/)?storage/v1/b/registry-race/o/registry%2Fregistry\.json"
        proxy.add_faults(document, *[Fault(before=together.wait) for _ in range(writers)])
        env["NEMOFLOW_GCS_ENDPOINT"] = proxy.url
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, uri, f"m-{i}"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(1, writers + 1)
        ]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        # One race (one fault), with its writers in the row's name: it happened when every writer's read was
        # held at the barrier, so all read one generation; its lost updates are the row's data lost (below).
        row.injected += proxy.injected_count(document) == writers
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NEMOFLOW_GCS_ENDPOINT", endpoint)
            reload_settings()
            state = reg.ModelRegistry(uri).read()
            history = [h["generation"] for h in reg.ModelRegistry(uri).history()]
        reload_settings()
    committed = {f"m-{i}" for i, (code, _, _) in enumerate(results, 1) if code == 0}
    row.compare({m: "registered" for m in committed}, {m: "registered" for m in state.models})
    failures = [err.strip().splitlines()[-1] for code, _, err in results if code != 0]
    assert not failures, failures
    assert set(state.models) == {"m-0", *committed} and len(committed) == writers
    assert state.generation == writers + 1
    assert history == list(range(1, writers + 2))
    assert sorted(int(out.split()[1]) for _, out, _ in results) == list(range(2, writers + 2))
    conflicts = sum(int(out.split()[3]) for _, out, _ in results)
    print(f"{writers} writers committed generations 2-{writers + 1} after {conflicts} lost races, re-applied")
    assert conflicts >= writers - 1  # they did race: all read generation 1, only one could commit it


@pytest.mark.gcs
def test_two_writers_race_on_gcs_one_wins_the_other_retries_or_fails_by_name(tmp_path):
    """Writer B reads registry.json, then writer A commits before B uploads: GCS refuses B's upload by its
    generation precondition (if_generation_match), so B re-reads and re-applies; B bound to the generation
    it read fails naming the registry, and A's model is never overwritten. Against fake-gcs-server."""
    from infra.settings import reload_settings
    from tests.support.fake_gcs import fake_gcs_server

    with fake_gcs_server(tmp_path / "fake-gcs.log") as endpoint, pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("NEMOFLOW_GCS_ENDPOINT", endpoint)
        reload_settings()
        try:
            storage.filesystem("gs://x").mkdir("registry-two")
            uri = "gs://registry-two/registry"
            reg.ModelRegistry(uri).register(_record("m-0"), promote=True)
            a, b = reg.ModelRegistry(uri), reg.ModelRegistry(uri)
            read_first = b._read_gcs
            raced = []

            def read_then_lose(self=b):
                got = read_first()
                if not raced:  # A commits between B's read and B's upload, once
                    raced.append(a.register(_record("m-a", "m-0")).generation)
                return got

            monkeypatch.setattr(b, "_read_gcs", read_then_lose)
            state = b.register(_record("m-b", "m-0"))
            assert raced == [2] and b.conflicts == 1 and state.generation == 3
            assert set(reg.ModelRegistry(uri).read().models) == {"m-0", "m-a", "m-b"}

            raced.clear()
            with pytest.raises(reg.ConcurrentUpdate, match=f"registry {uri} changed while committing generation 4"):
                b.register(_record("m-c", "m-0"), expected_generation=3)
            after = reg.ModelRegistry(uri).read()
            assert raced == [4] and after.generation == 4 and "m-c" not in after.models
        finally:
            monkeypatch.undo()  # the endpoint other tests set (the emulator's), if any, comes back
            reload_settings()


def test_registry_on_gcs(gcs_bucket):
    r = reg.ModelRegistry(f"{gcs_bucket}/registry")
    r.register(_record("m-a"), promote=True)
    r.register(_record("m-b", "m-a"), promote=True)
    assert reg.ModelRegistry(f"{gcs_bucket}/registry").rollback().promoted == "m-a"
    assert [h["generation"] for h in r.history()] == [1, 2, 3]


def _cli(*args: str, registry: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "nemoflow"), "models", "--registry", registry, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli(registry):
    out = _cli("list", registry=registry.uri)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert lines["m-b"].startswith("*") and not lines["m-a"].startswith("*")
    show = _cli("show", "--json", registry=registry.uri)
    assert json.loads(show.stdout)["lineage"] == ["m-b", "m-a"]
    text = _cli("show", "m-a", registry=registry.uri).stdout
    assert "/in/m-a.jsonl.zst" in text and "(promoted)" not in text
    assert _cli("rollback", registry=registry.uri).returncode == 0
    assert registry.read().promoted == "m-a"
    bad = _cli("promote", "m-nope", registry=registry.uri)
    assert bad.returncode == 2 and "no model 'm-nope'" in bad.stderr
    assert "m-b" in _cli("history", registry=registry.uri).stdout
    helptext = _cli("--help", registry=registry.uri).stdout
    assert "rollback" in helptext and "atomic" in helptext
