"""``nemoflow fetch`` against the fault server (the subcommand module alone, like the CLI loads it)."""

from __future__ import annotations

import argparse

import pytest

from nemoflow.commands import fetch as fetch_command
from tests.support import fault_ledger
from tests.support.fault_server import Fault


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nemoflow")
    fetch_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["fetch", *argv])
    return args.func(args)


def test_list_shows_names_and_urls(server, capsys):
    template = server.url("/train/chunk{chunk}/example_train_{shard}.jsonl.zst")
    assert run_cli(["--list", "--probe", template, "--chunks", "1-2", "--shards", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == [
        "chunk1/example_train_1.jsonl.zst",
        "chunk2/example_train_1.jsonl.zst",
    ]
    assert all(int(line.split()[0]) > 100_000 for line in lines)
    assert server.count() == 0  # --list never downloads


@pytest.mark.faults
def test_download_and_extract_then_nothing_to_do(server, corpus, tmp_path, capsys):
    row = fault_ledger.open_row("http 503: nemoflow fetch CLI")
    row.injected_from(server.injected_count)
    template = server.url("/train/chunk{chunk}/example_train_{shard}.jsonl.zst")
    server.add_faults("/train/chunk2/example_train_0.jsonl.zst", Fault(status=503, retry_after="0"))
    argv = [template, "--chunks", "1-2", "--shards", "0", "--dest", str(tmp_path / "raw"), "--extract"]
    assert run_cli(argv) == 0
    for c in (1, 2):
        raw = tmp_path / "raw" / f"chunk{c}" / "example_train_0.jsonl.zst"
        assert raw.read_bytes() == (corpus / f"train/chunk{c}/example_train_0.jsonl.zst").read_bytes()
        assert (tmp_path / "raw" / f"chunk{c}" / "example_train_0.jsonl").stat().st_size > raw.stat().st_size
    assert server.count() == 3
    assert run_cli(argv) == 0
    assert server.count() == 3
    assert "present" in capsys.readouterr().out


def test_failures_are_reported_and_exit_nonzero(server, tmp_path, capsys):
    missing = server.url("/train/chunk7/example_train_0.jsonl.zst")
    assert run_cli([missing, server.url("/train/chunk1/example_train_0.jsonl.zst"), "--dest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"not found: {missing}" in err and "1 of 2 file(s) failed" in err
    assert (tmp_path / "chunk1" / "example_train_0.jsonl.zst").exists()
