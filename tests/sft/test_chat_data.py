"""Chat data: rows of messages or prompt/response from any URI, normalized and split (real KJV text)."""

from __future__ import annotations

import http.server
import json
import threading
from functools import partial

import pytest

from workloads import chat_data


def test_both_row_layouts_become_messages_and_bad_rows_name_their_line():
    data = (
        json.dumps({"prompt": "Who?", "response": "Moses"})
        + "\n\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Where?"},
                    {"role": "assistant", "content": "Egypt"},
                ]
            }
        )
        + "\n"
    ).encode()
    rows = chat_data.parse_jsonl(data, "chat.jsonl")
    assert rows[0] == {"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Moses"}]}
    assert [m["role"] for m in rows[1]["messages"]] == ["system", "user", "assistant"]

    bad = b'{"prompt": "x", "response": "y"}\n{"question": "x"}\n'
    with pytest.raises(
        chat_data.ChatDataError,
        match=r"chat.jsonl line 2: expected 'messages' or 'prompt' \+ 'response' \(keys: question\)",
    ):
        chat_data.parse_jsonl(bad, "chat.jsonl")
    with pytest.raises(chat_data.ChatDataError, match="line 1: no assistant turn"):
        chat_data.parse_jsonl(b'{"messages": [{"role": "user", "content": "hi"}]}\n', "c.jsonl")
    with pytest.raises(chat_data.ChatDataError, match="line 1: not JSON"):
        chat_data.parse_jsonl(b"{oops\n", "c.jsonl")


def test_kjv_rows_are_real_verses_and_the_split_is_stable():
    rows = chat_data.kjv_chat_rows(200, seed=7)
    assert len(rows) == 200
    books = set(chat_data.kjv_books())
    assert len(books) == 66
    book_rows = [r for r in rows if r["messages"][0]["content"].startswith(chat_data.WHICH_BOOK_PREFIX)]
    assert len(book_rows) == 100 and all(r["messages"][1]["content"] in books for r in book_rows)
    verses = {v["text"] for v in chat_data.kjv_verses()}
    for row in rows:
        prompt, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        if prompt.startswith(chat_data.CONTINUE_PREFIX):
            start = prompt.split(": ", 1)[1]
            assert f"{start} {answer}" in verses
    train, held = chat_data.split_rows(rows, 0.1, seed=1)
    assert 5 <= len(held) <= 40 and len(train) + len(held) == 200
    # the same rows are held out whatever the order they come in
    again = chat_data.split_rows(list(reversed(rows)), 0.1, seed=1)[1]
    assert sorted(map(chat_data.row_key, again)) == sorted(map(chat_data.row_key, held))
    with pytest.raises(ValueError, match="use more examples"):
        chat_data.split_rows(rows[:1], 0.1)


def _serve(directory):
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.gcs
def test_prepare_chat_data_reads_local_gs_and_https_sources(work_dir, tmp_path, gcs_bucket):
    from infra import storage
    from tasks.sft import ChatDataConfig, prepare_chat_data

    rows = chat_data.kjv_chat_rows(60, seed=3)
    # prompt/response layout on disk: the stage normalizes it to messages
    flat = [{"prompt": r["messages"][0]["content"], "response": r["messages"][1]["content"]} for r in rows]
    local = tmp_path / "src" / "chat.jsonl"
    chat_data.write_jsonl(local, flat)
    storage.put_file(str(local), f"{gcs_bucket}/chat/chat.jsonl")
    server = _serve(local.parent)
    try:
        refs = [
            prepare_chat_data.fn(ChatDataConfig(source=source, held_out_fraction=0.2))
            for source in (
                str(local),
                f"{gcs_bucket}/chat/chat.jsonl",
                f"http://127.0.0.1:{server.server_port}/chat.jsonl",
            )
        ]
    finally:
        server.shutdown()
    # the same bytes from three places: the same split, the same files
    assert len({r.fingerprint for r in refs}) == 1
    ref = refs[0]
    assert ref.train_examples + ref.held_out_examples == 60 and ref.held_out_examples > 0
    written = chat_data.read_jsonl(ref.train) + chat_data.read_jsonl(ref.held_out)
    assert sorted(map(chat_data.row_key, written)) == sorted(map(chat_data.row_key, rows))
    assert ref.train.startswith(str(work_dir))
    with pytest.raises(FileNotFoundError, match="chat data .*missing.jsonl does not exist"):
        prepare_chat_data.fn(ChatDataConfig(source=str(tmp_path / "missing.jsonl")))
