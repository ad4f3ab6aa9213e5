"""Fixtures for the download area: a SlimPajama-layout corpus, the fault server, host mapping."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.fault_server import FaultServer

SHARD = "/train/chunk1/example_train_0.jsonl.zst"


@pytest.fixture(scope="session")
def corpus_template(tmp_path_factory) -> Path:
    """KJV chapters as 2 chunks x 2 shards of real zstd (~0.3 MB each), written once."""
    from workloads.demo_data import write_slimpajama_layout

    root = tmp_path_factory.mktemp("slimpajama")
    write_slimpajama_layout(root, chunks=2, shards_per_chunk=2)
    return root


@pytest.fixture
def corpus(corpus_template, tmp_path) -> Path:
    """A private copy, so a test may replace files without affecting others."""
    root = tmp_path / "served"
    shutil.copytree(corpus_template, root)
    return root


@pytest.fixture
def server(corpus):
    with FaultServer(corpus) as srv:
        yield srv


@pytest.fixture
def map_hosts(monkeypatch):
    """Resolve chosen host names to 127.0.0.1 at urllib3's connect call (DNS only; HTTP stays real).

    ``map_hosts("huggingface.co", "cdn.example.org")``; the Host header and the URL keep the name.
    """
    import urllib3.util.connection as connection

    names: set[str] = set()
    real = connection.create_connection

    def create_connection(address, *args, **kwargs):
        host, port = address
        return real(("127.0.0.1" if host in names else host, port), *args, **kwargs)

    monkeypatch.setattr(connection, "create_connection", create_connection)
    return lambda *hosts: names.update(hosts)


@pytest.fixture
def hf_token(monkeypatch):
    """A fake HF token in the environment (and in the settings cache); returns its value."""
    from infra.settings import reload_settings

    value = "hf_TESTtokenDoNotLeak0123456789"
    monkeypatch.setenv("HF_TOKEN", value)
    reload_settings()
    yield value
    monkeypatch.delenv("HF_TOKEN")
    reload_settings()
