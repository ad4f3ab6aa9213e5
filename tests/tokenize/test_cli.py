"""`nemoflow preprocess`, the job entry point `python -m workloads.tokenize`, and gs:// output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tokenize.conftest import mixtral_flags, write_jsonl
from tests.tokenize.reference import assert_same_files, megatron_reference

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=REPO, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


@pytest.mark.slow  # the nemoflow CLI imports every subcommand: ~10-25 s on the shared 2 cores
def test_preprocess_command_matches_megatron_reference(tmp_path, kjv_chapters, mixtral_tokenizer_model):
    import sentencepiece as spm

    records = [{"text": t, "meta": {"n": i}} for i, t in enumerate(kjv_chapters[:150])] + [{"text": ""}]
    src = write_jsonl(tmp_path / "in.jsonl.zst", records, compress=True)
    proc = _run(
        [
            str(Path(sys.executable).parent / "nemoflow"),
            "preprocess",
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out" / "kjv"),
            *mixtral_flags(mixtral_tokenizer_model),
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "100",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["documents"] == len(records) and stats["outputs"]["text"] == str(
        tmp_path / "out" / "kjv_text_document"
    )
    assert "documents" in proc.stderr and "tokens" in proc.stderr  # the summary goes to stderr
    sp = spm.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    megatron_reference(tmp_path / "ref", records, ["text"], sp.encode_as_ids, 2, 32000, True)
    assert_same_files(stats["outputs"]["text"], str(tmp_path / "ref_text_document"))


def test_preprocess_command_errors(tmp_path, mixtral_tokenizer_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    nemoflow = str(Path(sys.executable).parent / "nemoflow")
    base = [
        nemoflow,
        "preprocess",
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-model",
        str(mixtral_tokenizer_model),
    ]
    proc = _run(base + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--split-sentences"])
    assert proc.returncode == 2 and "--split-sentences is not supported" in proc.stderr
    proc = _run(base + ["--tokenizer-type", "GPTSentencePieceTokenizer", "--partitions", "2"])
    assert proc.returncode == 2 and "--keep-sequential-samples" in proc.stderr
    proc = _run(base + ["--tokenizer-type", "BertWordPieceCase"])
    assert proc.returncode == 2 and "BertWordPieceCase" in proc.stderr
    proc = _run(
        [
            nemoflow,
            "preprocess",
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--output-prefix",
            str(tmp_path / "o"),
            *mixtral_flags(mixtral_tokenizer_model),
        ]
    )
    assert proc.returncode == 2 and f"{tmp_path}/missing.jsonl" in proc.stderr
    assert not list(tmp_path.glob("o_*"))


def test_job_entry_point_takes_its_array_index(tmp_path, kjv_chapters, mixtral_tokenizer_model):
    inputs = []
    for i in range(3):
        inputs.append(
            write_jsonl(tmp_path / f"shard_{i}.jsonl", [{"text": t} for t in kjv_chapters[i * 10 : i * 10 + 10]])
        )
    listing = tmp_path / "inputs.txt"
    listing.write_text("".join(f"{p}\n" for p in inputs))
    out = str(tmp_path / "tok" / "{stem}")
    # each array task's command: the whole list, its own index from the environment (or --array-index)
    job = [sys.executable, "-m", "workloads.tokenize", "--input-list", str(listing), "--output-prefix", out]
    job += mixtral_flags(mixtral_tokenizer_model)
    proc = _run([*job, "--append-eod"], env={"NEMOFLOW_ARRAY_INDEX": "1"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "shard_1_text_document.bin",
        "shard_1_text_document.idx",
    ]
    assert json.loads(proc.stdout)["documents"] == 10
    proc = _run([*job, "--array-index", "3"])
    assert proc.returncode == 2 and "array index 3 is out of range" in proc.stderr


@pytest.mark.gcs
def test_gs_output_prefix(tmp_path, gcs_bucket, kjv_chapters, mixtral_tokenizer_model):
    from infra import storage
    from workloads.tokenize import TokenizerConfig, tokenize_file

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in kjv_chapters[:40]])
    config = TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model))
    remote = tokenize_file(str(src), f"{gcs_bucket}/tok/kjv", config)
    local = tokenize_file(str(src), str(tmp_path / "kjv"), config)
    assert remote.outputs["text"] == f"{gcs_bucket}/tok/kjv_text_document"
    for ext in (".bin", ".idx"):
        assert storage.read_bytes(remote.outputs["text"] + ext) == Path(local.outputs["text"] + ext).read_bytes()
    assert not [u for u in storage.listdir(f"{gcs_bucket}/tok") if ".tmp-" in u]

    # and a gs:// input, streamed through fsspec
    storage.put_file(str(src), f"{gcs_bucket}/raw/in.jsonl")
    from_gcs = tokenize_file(f"{gcs_bucket}/raw/in.jsonl", str(tmp_path / "from_gcs"), config)
    assert from_gcs.documents == 40
    for ext in (".bin", ".idx"):
        assert Path(from_gcs.outputs["text"] + ext).read_bytes() == Path(local.outputs["text"] + ext).read_bytes()
