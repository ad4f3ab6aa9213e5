"""Inputs that would make a useless dataset or an unbounded process: refused in one line naming the input.

An empty input (no file content, only blank lines, every record skipped as malformed, or
documents whose text is empty) would become a 0-token dataset that training cannot use (and
megatron-core's index builder loops forever on it); it is an error unless ``allow_empty``
(``--allow-empty``) says it is expected. A line longer than ``max_line_bytes``
(``--max-line-bytes``) is refused with its file, line number and the limit before the rest of
it is read: tokenizing one 50 MB line took 3 GB of memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tokenize.conftest import mixtral_flags, write_jsonl
from workloads.tokenize import InputError, TokenizerConfig, tokenize_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sp_config(mixtral_tokenizer_model):
    return TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model))


def outputs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".idx") or ".tmp-" in p.name)


@pytest.mark.parametrize(
    "content, skip, why",
    [
        (b"", False, "holds no documents"),
        (b"\n\n  \n", False, "holds no documents"),
        (b"{not json\n[1]\n", True, "all 2 record(s) were malformed"),
        (b'{"text": ""}\n{"text": ""}\n', False, "its 2 document(s) have no text under 'text'"),
    ],
    ids=["empty-file", "blank-lines", "all-malformed", "empty-texts"],
)
def test_empty_input_is_an_error_naming_it(tmp_path, sp_config, content, skip, why):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        tokenize_file(str(src), str(out / "x"), sp_config, skip_malformed=skip)
    message = str(info.value)
    assert message.startswith(f"{src}: ") and why in message and "--allow-empty" in message, message
    assert "\n" not in message
    assert outputs(out) == []  # nothing under the final names, no temporary files
    stats = tokenize_file(str(src), str(out / "x"), sp_config, skip_malformed=skip, allow_empty=True)
    assert stats.tokens == 0 and outputs(out) == ["x_text_document.bin", "x_text_document.idx"]


def test_one_empty_key_of_two_is_an_error(tmp_path, sp_config):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "In the beginning", "title": ""}] * 3)
    with pytest.raises(InputError, match=r"no text under 'title'"):
        tokenize_file(str(src), str(tmp_path / "x"), sp_config, json_keys=("text", "title"))
    assert outputs(tmp_path) == []


def test_preprocess_command_refuses_empty_input_unless_allowed(tmp_path, mixtral_tokenizer_model):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"")
    command = [
        str(Path(sys.executable).parent / "nemoflow"),
        "preprocess",
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "o"),
        *mixtral_flags(mixtral_tokenizer_model),
        "--append-eod",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"nemoflow preprocess: error: {src}: holds no documents (the file is empty or has only blank lines); "
        "nothing was written (pass --allow-empty to write an empty dataset)"
    ]
    assert not list(tmp_path.glob("o_*"))
    proc = subprocess.run(command + ["--allow-empty"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["documents"] == 0


def test_tokenize_stage_job_refuses_an_empty_part_naming_it(tmp_path, mixtral_tokenizer_model):
    """The data stage's array job (workloads.tokenize_array): exit 2, the part named, nothing written."""
    from workloads.tokenize_array import PlanItem, TokenizePlan, TokenizerSpec

    part = tmp_path / "part-00000.jsonl"
    part.write_bytes(b"\n")
    plan = TokenizePlan(
        items=[PlanItem(input=str(part), output_prefix=str(tmp_path / "tok" / "part-00000"), identity={}, bytes=1)],
        tokenizer=TokenizerSpec(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model)),
        json_keys=["text"],
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    command = [sys.executable, "-m", "workloads.tokenize_array", "--plan", str(plan_file), "--array-index", "0"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {part}: holds no documents" in proc.stderr
    assert not (tmp_path / "tok").exists() or outputs(tmp_path / "tok") == []
    plan_file.write_text(plan.model_copy(update={"allow_empty": True}).model_dump_json())
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 documents, 0 tokens" in proc.stdout


def test_line_over_the_limit_names_file_line_and_limit(tmp_path, sp_config, kjv_chapters):
    lines = [json.dumps({"text": t}) for t in kjv_chapters[:5]]
    lines.insert(3, json.dumps({"text": " ".join(kjv_chapters[:100])}))  # ~350 kB on line 4
    src = tmp_path / "long.jsonl"
    src.write_text("\n".join(lines) + "\n")
    size = len(lines[3].encode()) + 1
    with pytest.raises(InputError) as info:
        tokenize_file(str(src), str(tmp_path / "x"), sp_config, max_line_bytes=100_000)
    message = str(info.value)
    assert message.startswith(f"{src}:4: the line is longer than the limit of 100,000 bytes"), message
    assert "--max-line-bytes" in message and "\n" not in message
    assert outputs(tmp_path) == []
    stats = tokenize_file(str(src), str(tmp_path / "x"), sp_config, max_line_bytes=size)
    assert stats.documents == 6


def test_line_limit_holds_in_zst_and_without_a_final_newline(tmp_path, sp_config):
    big = {"text": "word " * 300_000}  # 1.5 MB
    src = write_jsonl(tmp_path / "in.jsonl.zst", [{"text": "short"}, big], compress=True)
    with pytest.raises(InputError, match=rf"^{src}:2: the line is longer than the limit of 1,000,000 bytes"):
        tokenize_file(str(src), str(tmp_path / "x"), sp_config, max_line_bytes=1_000_000)
    plain = tmp_path / "tail.jsonl"
    plain.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps(big))  # no newline at the end
    with pytest.raises(InputError, match=rf"^{plain}:2: the line is longer"):
        tokenize_file(str(plain), str(tmp_path / "y"), sp_config, max_line_bytes=1_000_000)


def test_default_limit_is_16_mib_and_stated_in_the_help(mixtral_tokenizer_model):
    from workloads.jsonl import MAX_LINE_BYTES

    assert MAX_LINE_BYTES == 16 << 20  # the README states this limit and its measured memory
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "nemoflow"), "preprocess", "--help"], capture_output=True, text=True
    )
    help_text = " ".join(proc.stdout.split())
    assert (
        "--max-line-bytes N refuse a line (one document) longer than N bytes (default 16,777,216; 0 = no limit)"
        in help_text
    )
    assert "--allow-empty write an empty dataset for an input without documents" in help_text


def test_tokenize_job_takes_the_limit_flags(tmp_path, mixtral_tokenizer_model):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "x" * 5000}) + "\n")
    command = [
        sys.executable,
        "-m",
        "workloads.tokenize",
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "o"),
        *mixtral_flags(mixtral_tokenizer_model),
        "--max-line-bytes",
        "4096",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and f"{src}:1: the line is longer than the limit of 4,096 bytes" in proc.stderr
    proc = subprocess.run(command[:-1] + ["8192"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
