"""Bad input, bad tokenizer, bad output: clear errors naming file (and line), no final files left."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.support import fault_ledger
from tests.support.tmpfs import tmpfs
from tests.tokenize.conftest import write_jsonl
from workloads.tokenize import InputError, OutputError, TokenizerConfig, TokenizerError, tokenize_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sp_config(mixtral_tokenizer_model):
    return TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model))


def assert_no_outputs(directory: Path) -> None:
    left = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".idx"))
    assert left == [], f"files left under final names: {left}"
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")], "temporary files left behind"


def _lines(kjv_chapters, n=30) -> list[bytes]:
    return [json.dumps({"text": t}).encode() for t in kjv_chapters[:n]]


def test_malformed_json_names_file_and_line_or_is_skipped(tmp_path, kjv_chapters, sp_config):
    lines = _lines(kjv_chapters)
    lines[16] = b'{"text": "unterminated'
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InputError, match=rf"{src}:17: malformed JSON"):
        tokenize_file(str(src), str(out / "x"), sp_config, batch_bytes=16 << 10)
    assert_no_outputs(out)

    stats = tokenize_file(str(src), str(out / "x"), sp_config, skip_malformed=True)
    assert stats.malformed_skipped == 1 and stats.documents == len(lines) - 1
    assert f"{src}:17" in stats.malformed_examples[0]


def test_missing_key_names_file_line_and_key(tmp_path, kjv_chapters, sp_config):
    lines = _lines(kjv_chapters)
    lines[3] = json.dumps({"content": "no text key here"}).encode()
    src = tmp_path / "nokey.jsonl"
    src.write_bytes(b"\n".join(lines))
    with pytest.raises(InputError, match=rf"{src}:4: missing JSON key 'text'"):
        tokenize_file(str(src), str(tmp_path / "x"), sp_config)
    assert_no_outputs(tmp_path)
    bad_type = tmp_path / "int.jsonl"
    bad_type.write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(InputError, match=rf"{bad_type}:2: key 'text' holds int"):
        tokenize_file(str(bad_type), str(tmp_path / "y"), sp_config)
    assert_no_outputs(tmp_path)


def test_non_utf8_names_file_and_line(tmp_path, kjv_chapters, sp_config):
    """Megatron reads the file as strict UTF-8 text and stops; so do we, with the line."""
    lines = _lines(kjv_chapters)
    lines[7] = b'{"text": "caf\xe9 latin-1"}'
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b"\n".join(lines))
    with pytest.raises(InputError, match=rf"{src}:8: not valid UTF-8"):
        tokenize_file(str(src), str(tmp_path / "x"), sp_config)
    assert_no_outputs(tmp_path)
    stats = tokenize_file(str(src), str(tmp_path / "x"), sp_config, skip_malformed=True)
    assert stats.malformed_skipped == 1


def test_truncated_zst_names_file(tmp_path, kjv_chapters, sp_config):
    src = write_jsonl(tmp_path / "data.jsonl.zst", [{"text": t} for t in kjv_chapters[:200]], compress=True)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) * 2 // 3])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InputError, match=rf"{src}: truncated zstd"):
        tokenize_file(str(src), str(out / "x"), sp_config)
    assert_no_outputs(out)


def test_unknown_type_and_missing_tokenizer_file(tmp_path, kjv_chapters):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(TokenizerError, match="unknown tokenizer type 'WordPieceFoo'.*GPTSentencePieceTokenizer"):
        tokenize_file(str(src), str(tmp_path / "x"), TokenizerConfig(type="WordPieceFoo", model="m"))
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {missing} does not exist"):
        tokenize_file(
            str(src), str(tmp_path / "x"), TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(missing))
        )
    with pytest.raises(TokenizerError, match="GPT2BPETokenizer needs --merge-file"):
        tokenize_file(str(src), str(tmp_path / "x"), TokenizerConfig(type="GPT2BPETokenizer", vocab_file=str(src)))
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {tmp_path}/absent.json does not exist"):
        tokenize_file(
            str(src), str(tmp_path / "x"), TokenizerConfig(type="HuggingFaceTokenizer", model=f"{tmp_path}/absent.json")
        )
    not_a_model = tmp_path / "garbage.model"
    not_a_model.write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerError, match=f"cannot load sentencepiece model {not_a_model}"):
        tokenize_file(
            str(src), str(tmp_path / "x"), TokenizerConfig(type="SentencePieceTokenizer", model=str(not_a_model))
        )
    assert_no_outputs(tmp_path)


def test_missing_input_and_unwritable_output(tmp_path, sp_config):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/absent.jsonl"):
        tokenize_file(str(tmp_path / "absent.jsonl"), str(tmp_path / "x"), sp_config)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputError, match=f"{blocker}/sub"):
        tokenize_file(str(src), str(blocker / "sub" / "out"), sp_config)
    # root ignores permission bits, so a read-only file system stands in for "not writable"
    with pytest.raises(OutputError, match="/proc/nemoflow-test"):
        tokenize_file(str(src), "/proc/nemoflow-test/out", sp_config)


@pytest.mark.faults
def test_disk_full_leaves_no_final_files_and_keeps_earlier_outputs(tmp_path, kjv_chapters, sp_config):
    """A real full disk (a 256 KiB tmpfs: ENOSPC) mid-way through the .bin: one error naming the output, no
    file under a final name, and the dataset already finished on that disk unchanged."""
    row = fault_ledger.open_row("disk full (tmpfs) mid-way through tokenize")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in kjv_chapters[:400]])
    earlier = write_jsonl(tmp_path / "earlier.jsonl", [{"text": t} for t in kjv_chapters[:10]])
    with tmpfs(tmp_path / "disk", "size=256k") as out:
        tokenize_file(str(earlier), str(out / "earlier"), sp_config)
        before = fault_ledger.checksums(out)
        assert sorted(before) == ["earlier_text_document.bin", "earlier_text_document.idx"]
        with pytest.raises(
            OutputError, match=f"cannot write {out}/corpus_text_document.bin/.idx: No space left"
        ) as err:
            tokenize_file(str(src), str(out / "corpus"), sp_config, batch_bytes=64 << 10)
        row.injected += getattr(err.value.__cause__, "errno", None) == errno.ENOSPC
        row.compare(before, fault_ledger.checksums(out))
        assert fault_ledger.checksums(out) == before  # no final file of the failed run, no temporary left


def test_lone_surrogate_escape_names_file_and_line(tmp_path, sp_config):
    src = tmp_path / "surrogate.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "half a pair \\ud800 here"}\n')
    with pytest.raises(InputError, match=rf"{src}:2: a string holds a lone surrogate"):
        tokenize_file(str(src), str(tmp_path / "x"), sp_config)
    assert_no_outputs(tmp_path)


def test_line_endings_and_blank_lines_do_not_change_the_output(tmp_path, kjv_chapters, sp_config):
    """CRLF, lone CR and blank lines split records as Megatron's text-mode reading does."""
    records = [json.dumps({"text": t}).encode() for t in kjv_chapters[:20]]
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"\n".join(records) + b"\n")
    messy = tmp_path / "messy.jsonl"
    messy.write_bytes(b"\r\n".join(records[:10]) + b"\r\n\r\n\n" + b"\r".join(records[10:]) + b"\n\n")
    a = tokenize_file(str(clean), str(tmp_path / "a"), sp_config)
    b = tokenize_file(str(messy), str(tmp_path / "b"), sp_config)
    assert a.documents == b.documents == 20
    for ext in (".bin", ".idx"):
        assert Path(a.outputs["text"] + ext).read_bytes() == Path(b.outputs["text"] + ext).read_bytes()
