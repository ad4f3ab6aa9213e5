"""Tokenize a JSON-lines file into Megatron indexed datasets, byte-identical to Megatron-LM.

    python -m workloads.tokenize --input data.jsonl.zst --output-prefix out/data \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod

writes ``out/data_text_document.bin`` and ``.idx``: the same bytes Megatron-LM's
``tools/preprocess_data.py`` writes for the same input, tokenizer and flags
(format: workloads/indexed_dataset.py; tokenizers: workloads/tokenizers.py).

From Python (the data stage)::

    from workloads.tokenize import TokenizerConfig, tokenize_file
    stats = tokenize_file("data.jsonl.zst", "gs://bucket/tok/data",
                          tokenizer=TokenizerConfig(type="GPTSentencePieceTokenizer", model="tokenizer.model"),
                          json_keys=("text",), append_eod=True, workers=2)

In a Slurm array task or a Kubernetes indexed job, pass the whole list
(``--input-list FILE`` or ``--input`` repeated) and each task takes entry
``--array-index`` (default: ``$NEMOFLOW_ARRAY_INDEX``); ``{stem}`` in
``--output-prefix`` becomes the input's file name without ``.jsonl[.zst]``.

How it is fast: the input is read in blocks of a few MiB, parsed with orjson
on a reader thread while the previous batch is tokenized by a Rust tokenizer
(gigatoken, verified against the reference; see tokenizers.py) on ``workers``
threads, and tokens go straight to the ``.bin`` as one array per batch. Memory
stays flat: two batches in flight plus 12 bytes per sequence for the index.

Where this differs from Megatron-LM on inputs it cannot process: blank lines
are skipped (Megatron stops with a JSONDecodeError); malformed JSON, a missing
key, a value that is not a string (or list of strings) and bytes that are not
UTF-8 stop the run with ``file:line`` in the message (Megatron reads the file
as UTF-8 text and fails without a line number), or, with ``skip_malformed``,
the whole record is skipped for every key and counted. An input that gives no
tokens for a key (an empty file, only blank lines, every record skipped, or
every text empty) is an error naming it unless ``allow_empty`` (Megatron
writes an empty dataset, which training cannot use: megatron-core loops
forever building its index). A line over ``max_line_bytes`` (16 MiB by
default) is an error naming file, line and limit (see workloads/jsonl.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel

from infra.configs.tokenizer import TOKENIZER_TYPES, TokenizerConfig
from workloads.indexed_dataset import DType, IndexedDatasetWriter, bin_path, idx_path
from workloads.jsonl import MAX_LINE_BYTES, InputError, iter_line_batches, parse_line
from workloads.tokenizers import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "InputError",
    "OutputError",
    "TokenizeStats",
    "TokenizerConfig",
    "TokenizerError",
    "load_tokenizer",
    "output_paths",
    "tokenize_file",
]

log = logging.getLogger("nemoflow.tokenize")

BATCH_BYTES = 4 << 20
MAX_REPORTED_MALFORMED = 20
# The continuous fast-path check re-encodes one document per batch with the reference; a document
# longer than this is not picked (sentencepiece takes ~50 bytes of memory per byte of text).
CHECK_MAX_CHARS = 1 << 20


class OutputError(ValueError):
    """The output cannot be written; the message names the path."""


class TokenizeStats(BaseModel):
    input: str
    outputs: dict[str, str]  # json key -> output prefix ({prefix}_{key}_document)
    documents: int
    tokens: int  # over all keys, EOD included
    bytes_in: int  # uncompressed JSON-lines bytes read
    seconds: float  # reading, tokenizing and writing (after the tokenizer is loaded)
    malformed_skipped: int = 0
    malformed_examples: list[str] = []
    vocab_size: int
    dtype: str
    backend: str  # the tokenizer implementation that produced the ids
    tokenizer_fingerprint: str = ""

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / self.seconds if self.seconds else 0.0


def output_paths(output_prefix: str, json_keys: Sequence[str]) -> dict[str, str]:
    """Megatron's naming: ``{prefix}_{key}_document`` (then ``.bin`` / ``.idx``)."""
    return {key: f"{output_prefix}_{key}_document" for key in json_keys}


# ---------------------------------------------------------------- parsing


@dataclass
class ParsedBatch:
    # texts[k]: every text to tokenize for key k (one per document, or one per sentence)
    texts: list[list[str]]
    # sentences[k][i]: how many of texts[k] belong to document i (None: exactly one each)
    sentences: list[list[int] | None]
    documents: int = 0
    raw_bytes: int = 0
    read_bytes: int = 0
    malformed: list[str] = field(default_factory=list)


def _extract(obj: dict, key: str, path: str, line_no: int) -> str | list[str]:
    try:
        value = obj[key]
    except KeyError:
        raise InputError(f"{path}:{line_no}: missing JSON key {key!r} (keys: {', '.join(list(obj)[:8])})") from None
    if isinstance(value, str):
        return value
    # Megatron treats a list as pre-split sentences, one sequence each.
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise InputError(f"{path}:{line_no}: key {key!r} holds {type(value).__name__}, expected a string")


def _parse_batches(
    path: str, json_keys: Sequence[str], skip_malformed: bool, batch_bytes: int, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[ParsedBatch]:
    nkeys = len(json_keys)
    for lines in iter_line_batches(path, batch_bytes, max_line_bytes):
        batch = ParsedBatch(texts=[[] for _ in json_keys], sentences=[None] * nkeys)
        batch.raw_bytes, batch.read_bytes = lines.raw_bytes, lines.read_bytes
        for line, line_no in zip(lines.lines, lines.line_numbers):
            try:
                obj = parse_line(line, path, line_no)
                values = [_extract(obj, key, path, line_no) for key in json_keys]
            except InputError as exc:
                if not skip_malformed:
                    raise
                batch.malformed.append(str(exc))
                continue
            for k, value in enumerate(values):
                if isinstance(value, str):
                    batch.texts[k].append(value)
                    if batch.sentences[k] is not None:
                        batch.sentences[k].append(1)
                else:
                    if batch.sentences[k] is None:
                        batch.sentences[k] = [1] * batch.documents
                    batch.texts[k].extend(value)
                    batch.sentences[k].append(len(value))
            batch.documents += 1
        yield batch


def _threaded(source: Iterator[ParsedBatch], depth: int = 2) -> Iterator[ParsedBatch]:
    """Run ``source`` on a thread, ``depth`` batches ahead (bounded memory)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            put(exc)

    thread = threading.Thread(target=produce, name="jsonl-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()
        thread.join(timeout=5)


# ---------------------------------------------------------------- encoding


class _FastPathDisagrees(Exception):
    pass


def _encode(tok: Tokenizer, texts: list[str], rng: random.Random, check: bool) -> tuple[np.ndarray, np.ndarray]:
    flat, lengths = tok.encode_batch(texts)
    reference = tok.reference
    if reference is None or not texts:
        return flat, lengths
    special = [i for i, t in enumerate(texts) if tok.needs_reference(t)]
    if special:
        ends = np.cumsum(lengths)
        pieces = [flat[ends[i] - lengths[i] : ends[i]] for i in range(len(texts))]
        for i in special:
            pieces[i] = np.asarray(reference.encode(texts[i]), dtype=flat.dtype)
        lengths = np.fromiter((p.size for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.concatenate(pieces) if pieces else flat
    if check:
        # A cheap, continuous guard: one document per batch against the reference (a short one).
        i = rng.randrange(len(texts))
        if len(texts[i]) > CHECK_MAX_CHARS:
            short = [j for j, t in enumerate(texts) if len(t) <= CHECK_MAX_CHARS]
            if not short:
                return flat, lengths
            i = short[i % len(short)]
        end = int(np.sum(lengths[: i + 1]))
        got = flat[end - int(lengths[i]) : end].tolist()
        if got != reference.encode(texts[i]):
            raise _FastPathDisagrees(texts[i][:80])
    return flat, lengths


def _assemble(
    flat: np.ndarray, lengths: np.ndarray, sentences: list[int] | None, documents: int, eod: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's document layout: (tokens, sequence lengths, sequences per document).

    Empty sequences are dropped; with ``eod`` the EOD id follows the last
    non-empty sequence of every document that has tokens (and counts in that
    sequence's length); a document without tokens gets neither.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if sentences is None:
        sent_doc = np.arange(documents, dtype=np.int64)
    else:
        sent_doc = np.repeat(np.arange(documents, dtype=np.int64), np.asarray(sentences, dtype=np.int64))
    nonempty = np.flatnonzero(lengths > 0)
    seq_lengths = lengths[nonempty]
    doc_of_seq = sent_doc[nonempty]
    seqs_per_doc = np.bincount(doc_of_seq, minlength=documents)
    if eod is not None and nonempty.size:
        last = np.ones(nonempty.size, dtype=bool)
        last[:-1] = doc_of_seq[1:] != doc_of_seq[:-1]
        insert_at = np.cumsum(lengths)[nonempty[last]]
        flat = np.insert(flat, insert_at, np.asarray(eod, dtype=flat.dtype))
        seq_lengths = seq_lengths + last
    return flat, seq_lengths, seqs_per_doc


# ---------------------------------------------------------------- the file


def tokenize_file(
    input_path: str,
    output_prefix: str,
    tokenizer: TokenizerConfig | Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 2,
    skip_malformed: bool = False,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
    allow_empty: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> TokenizeStats:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx`` for each key.

    ``output_prefix`` may be a local path or a ``gs://`` URI (written locally,
    then uploaded, ``.bin`` before ``.idx``). ``progress`` is called after each
    batch with the input bytes consumed so far (compressed bytes for ``.zst``,
    comparable with the file size). Nothing appears under the final names
    unless every key was written completely. An input without tokens for a key is an
    ``InputError`` unless ``allow_empty``; a line over ``max_line_bytes`` (0: no limit) too.
    """
    from infra import storage

    json_keys = tuple(json_keys)
    if not json_keys:
        raise ValueError("json_keys is empty: name at least one JSON key to tokenize")
    if len(set(json_keys)) != len(json_keys):
        raise ValueError(f"json_keys repeats a key: {json_keys}")
    if storage.is_local(input_path) and not os.path.exists(storage.local_path(input_path)):
        raise FileNotFoundError(f"input file not found: {input_path}")
    if isinstance(tokenizer, TokenizerConfig):
        fingerprint = tokenizer.fingerprint()
        tok = load_tokenizer(tokenizer, workers=workers)
    else:
        fingerprint, tok = "", tokenizer
    if append_eod and tok.eod is None:
        raise TokenizerError(f"{tok.name}: the tokenizer has no end-of-text token, so --append-eod cannot be honoured")

    remote = not storage.is_local(output_prefix)
    final = output_paths(output_prefix, json_keys)
    workdir = tempfile.mkdtemp(prefix="nemoflow-tokenize-") if remote else None
    try:
        local_prefix = (
            os.path.join(workdir, storage.basename(output_prefix)) if remote else storage.local_path(output_prefix)
        )
        _check_output_dir(os.path.dirname(local_prefix) or ".", output_prefix)
        try:
            limits = Limits(allow_empty, max_line_bytes)
            stats = _run(
                input_path, local_prefix, tok, json_keys, append_eod, skip_malformed, progress, batch_bytes, limits
            )
        except _FastPathDisagrees as exc:
            log.warning(
                "gigatoken disagreed with %s on %r...; redoing %s with %s",
                tok.reference.backend,
                str(exc),
                input_path,
                tok.reference.backend,
            )
            stats = _run(
                input_path,
                local_prefix,
                tok.reference,
                json_keys,
                append_eod,
                skip_malformed,
                progress,
                batch_bytes,
                limits,
            )
        if remote:
            for key in json_keys:
                local = output_paths(local_prefix, [key])[key]
                storage.put_file(bin_path(local), bin_path(final[key]))
            for key in json_keys:
                local = output_paths(local_prefix, [key])[key]
                storage.put_file(idx_path(local), idx_path(final[key]))
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    stats.input = input_path
    stats.outputs = final
    stats.tokenizer_fingerprint = fingerprint
    return stats


def _check_output_dir(directory: str, output_prefix: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create output directory {directory} (for {output_prefix}): {exc.strerror or exc}"
        ) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"output directory {directory} is not writable (for {output_prefix})")


@contextlib.contextmanager
def _writing(prefix: str) -> Iterator[None]:
    """Turn an OS error while writing (disk full, quota, read-only) into one naming the output."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"cannot write {prefix}.bin/.idx: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class Limits:
    allow_empty: bool = False
    max_line_bytes: int = MAX_LINE_BYTES


def _check_not_empty(
    input_path: str, json_keys: Sequence[str], writers: list[IndexedDatasetWriter], documents: int, malformed: int
) -> None:
    """An input that gives a key no tokens makes a dataset training cannot use: say why, naming it."""
    if documents == 0 and malformed:
        why = f"all {malformed} record(s) were malformed and skipped"
    elif documents == 0:
        why = "holds no documents (the file is empty or has only blank lines)"
    else:
        empty = [key for key, w in zip(json_keys, writers) if w.tokens == 0]
        if not empty:
            return
        keys = ", ".join(repr(k) for k in empty)
        why = f"its {documents} document(s) have no text under {keys}"
    raise InputError(f"{input_path}: {why}; nothing was written (pass --allow-empty to write an empty dataset)")


def _run(
    input_path: str,
    local_prefix: str,
    tok: Tokenizer,
    json_keys: tuple[str, ...],
    append_eod: bool,
    skip_malformed: bool,
    progress: Callable[[int], None] | None,
    batch_bytes: int,
    limits: Limits = Limits(),
) -> TokenizeStats:
    start = time.perf_counter()
    dtype = DType.for_vocab_size(tok.vocab_size)
    eod = tok.eod if append_eod else None
    prefixes = output_paths(local_prefix, json_keys)
    writers: list[IndexedDatasetWriter] = []
    rng = random.Random(0)
    documents = raw_bytes = 0
    malformed: list[str] = []
    malformed_count = 0
    try:
        for key in json_keys:
            with _writing(prefixes[key]):
                writers.append(IndexedDatasetWriter(prefixes[key], dtype))
        batches = _parse_batches(input_path, json_keys, skip_malformed, batch_bytes, limits.max_line_bytes)
        for batch in _threaded(batches):
            for k, writer in enumerate(writers):
                flat, lengths = _encode(tok, batch.texts[k], rng, check=True)
                tokens, seq_lengths, seqs_per_doc = _assemble(flat, lengths, batch.sentences[k], batch.documents, eod)
                with _writing(writer.prefix):
                    writer.add_documents(tokens, seq_lengths, seqs_per_doc)
            documents += batch.documents
            raw_bytes += batch.raw_bytes
            malformed_count += len(batch.malformed)
            malformed.extend(batch.malformed[: max(0, MAX_REPORTED_MALFORMED - len(malformed))])
            if progress is not None:
                progress(batch.read_bytes)
        if not limits.allow_empty:
            _check_not_empty(input_path, json_keys, writers, documents, malformed_count)
        for writer in writers:
            with _writing(writer.prefix):
                writer.prepare()
        for writer in writers:
            with _writing(writer.prefix):
                writer.commit()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    if malformed_count:
        log.warning("%s: skipped %d malformed record(s); first: %s", input_path, malformed_count, malformed[0])
    return TokenizeStats(
        input=input_path,
        outputs=prefixes,
        documents=documents,
        tokens=sum(w.tokens for w in writers),
        bytes_in=raw_bytes,
        seconds=time.perf_counter() - start,
        malformed_skipped=malformed_count,
        malformed_examples=malformed,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        backend=tok.backend,
    )


# ---------------------------------------------------------------- command line


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of Megatron-LM's tools/preprocess_data.py that apply here."""
    group = parser.add_argument_group("input data")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize (default: text)")
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="not supported (Megatron's NLTK sentence splitting); pass pre-split sentences as a JSON list instead",
    )
    group.add_argument("--keep-newlines", action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--lang", default="english", help=argparse.SUPPRESS)
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type",
        required=True,
        choices=TOKENIZER_TYPES,
        metavar="TYPE",
        help=f"one of: {', '.join(TOKENIZER_TYPES)}",
    )
    group.add_argument(
        "--tokenizer-model",
        help="sentencepiece .model, or for HuggingFaceTokenizer a tokenizer.json, directory or hub id",
    )
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: gpt2-vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: gpt2-merges.txt")
    group.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document token to every non-empty document"
    )
    group.add_argument(
        "--no-fast",
        action="store_true",
        help="do not use the gigatoken fast path (ids are identical either way; this is only slower)",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers", type=int, default=2, help="tokenizer threads (default 2; Megatron: worker processes)"
    )
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted with --keep-sequential-samples (same files as 1 partition); "
        "without it Megatron interleaves documents, which is refused",
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="accepted for compatibility; progress is printed every 2 s"
    )
    group.add_argument(
        "--keep-sequential-samples", action="store_true", help="accepted: documents always keep their input order"
    )
    group.add_argument(
        "--skip-malformed",
        action="store_true",
        help="skip (and count) records that are not valid JSON / UTF-8 or lack a key, instead of stopping",
    )
    group.add_argument(
        "--allow-empty",
        action="store_true",
        help="write an empty dataset for an input without documents (or text) instead of stopping with an error",
    )
    group.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        metavar="N",
        help=f"refuse a line (one document) longer than N bytes (default {MAX_LINE_BYTES:,}; 0 = no limit): "
        "memory grows with the longest line",
    )


def config_from_args(args: argparse.Namespace) -> TokenizerConfig:
    if args.split_sentences:
        raise ValueError(
            "--split-sentences is not supported: split sentences beforehand and store each document "
            "as a JSON list of sentences (each becomes one sequence, as in Megatron's sentence mode output)"
        )
    if args.partitions > 1 and not args.keep_sequential_samples:
        raise ValueError(
            f"--partitions {args.partitions} without --keep-sequential-samples makes Megatron deal documents "
            "round-robin to partitions (a different order); use --partitions 1, or add --keep-sequential-samples "
            "(same files as one partition). Parallelism comes from --workers here."
        )
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    return TokenizerConfig(
        type=args.tokenizer_type,
        model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        fast=not args.no_fast,
    )


class StderrProgress:
    """Progress lines on stderr, at most one per ``interval`` seconds."""

    def __init__(self, path: str, interval: float = 2.0) -> None:
        from infra import storage

        self.path = path
        self.interval = interval
        self.start = time.perf_counter()
        self.last = 0.0
        try:
            self.total = storage.size(path)
        except Exception:  # noqa: BLE001 - the total only decorates the line
            self.total = 0

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.start
        pct = f" {100 * done / self.total:5.1f}%" if self.total else ""
        print(
            f"{self.path}:{pct} {done / 1e6:,.1f} MB read, {done / 1e6 / elapsed:,.1f} MB/s",
            file=sys.stderr,
            flush=True,
        )


def select_inputs(inputs: list[str], input_list: str | None, array_index: int | None) -> list[tuple[int, str]]:
    """The (position, input) pairs this task handles."""
    items = list(inputs or [])
    if input_list:
        with open(input_list, encoding="utf-8") as fh:
            items += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    if not items:
        raise ValueError("no input: pass --input FILE (repeatable) or --input-list FILE")
    if array_index is None:
        return list(enumerate(items))
    if not 0 <= array_index < len(items):
        raise ValueError(f"array index {array_index} is out of range: the input list has {len(items)} file(s)")
    return [(array_index, items[array_index])]


def input_stem(path: str) -> str:
    name = os.path.basename(path.rstrip("/"))
    for suffix in (".zst", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.tokenize",
        description="Tokenize JSON-lines files into Megatron indexed datasets (job entry point; "
        "`nemoflow preprocess` is the same for one file).",
    )
    parser.add_argument("--input", action="append", default=[], help="input .jsonl or .jsonl.zst (repeatable)")
    parser.add_argument("--input-list", help="file with one input path or URI per line")
    parser.add_argument(
        "--array-index",
        type=int,
        default=None,
        help="process only this entry of the input list (default: $NEMOFLOW_ARRAY_INDEX, else all)",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="output prefix; {stem} = input name without .jsonl[.zst], {index} = its position",
    )
    add_megatron_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    try:
        index = args.array_index
        if index is None and os.environ.get("NEMOFLOW_ARRAY_INDEX", "").strip():
            index = int(os.environ["NEMOFLOW_ARRAY_INDEX"])
        selected = select_inputs(args.input, args.input_list, index)
        if len(selected) > 1 and "{stem}" not in args.output_prefix and "{index}" not in args.output_prefix:
            raise ValueError("several inputs need {stem} or {index} in --output-prefix, or the outputs would collide")
        config = config_from_args(args)
        for position, path in selected:
            prefix = args.output_prefix.format(stem=input_stem(path), index=position)
            stats = tokenize_file(
                path,
                prefix,
                config,
                json_keys=args.json_keys,
                append_eod=args.append_eod,
                workers=args.workers,
                skip_malformed=args.skip_malformed,
                progress=StderrProgress(path),
                allow_empty=args.allow_empty,
                max_line_bytes=args.max_line_bytes,
            )
            print(stats.model_dump_json(), flush=True)
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
