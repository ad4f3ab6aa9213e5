"""Bad inputs through the flows, as a user gives them: one clear error naming the input, nothing half-made.

(The tokenizer's own checks are in tests/tokenize/test_limits.py; these go through prepare-dataset's
tokenize stage, its job array and Prefect.)
"""

from __future__ import annotations

import json

import pytest

from flows.prepare_dataset import PrepareConfig, prepare_dataset
from infra import storage


@pytest.mark.prefect
@pytest.mark.slow
def test_empty_source_fails_the_tokenize_stage_naming_it_unless_allowed(prefect_server, work_dir, tmp_path):
    good = tmp_path / "good.jsonl"
    empty = tmp_path / "empty.jsonl"
    good.write_text("".join(json.dumps({"text": f"verse {i} of the good file"}) + "\n" for i in range(20)))
    empty.write_text("\n")
    config = PrepareConfig(name="with-empty", sources=[str(good), str(empty)], shards_per_file=1)
    state = prepare_dataset(config, return_state=True)
    assert state.is_failed(), state.message
    with pytest.raises(Exception, match=r"\(joining \S*/extracted/empty\.jsonl\): holds no documents .*--allow-empty"):
        state.result()
    tokenized = storage.join(config.dataset_uri(), "tokenized")
    finished = [p for p in storage.listdir(tokenized) if p.endswith(".idx")]
    assert len(finished) == 1, finished  # the good part only; nothing under the empty part's final names

    state = prepare_dataset(config.model_copy(update={"allow_empty": True}), return_state=True)
    assert state.is_completed(), state.message
    dataset = state.result()
    assert dataset.documents == 20 and len(dataset.prefixes) == 2


@pytest.mark.prefect
@pytest.mark.slow
def test_line_over_the_limit_fails_the_tokenize_stage_naming_shard_line_and_limit(prefect_server, work_dir, tmp_path):
    """max_line_bytes reaches the tokenize job through PrepareConfig; the error names the source shard's line."""
    src = tmp_path / "long.jsonl"
    lines = [json.dumps({"text": f"verse {i}"}) for i in range(10)]
    lines[6] = json.dumps({"text": "word " * 400})  # ~2 kB on line 7
    src.write_text("\n".join(lines) + "\n")
    config = PrepareConfig(name="long-line", sources=[str(src)], max_line_bytes=1000)
    state = prepare_dataset(config, return_state=True)
    assert state.is_failed(), state.message
    with pytest.raises(
        Exception, match=r"\S*/extracted/long\.jsonl:7: the line is longer than the limit of 1,000 bytes"
    ):
        state.result()
    state = prepare_dataset(config.model_copy(update={"max_line_bytes": 4096}), return_state=True)
    assert state.is_completed(), state.message
    assert state.result().documents == 10
