"""One task of the dataset stage's tokenize job array: ``python -m workloads.tokenize_array --plan PLAN.json``.

The data stage (tasks/data/tokenizing.py) writes a :class:`TokenizePlan` listing the parts
still to tokenize and submits ONE array job (N local processes, a Slurm job
array, an Indexed Kubernetes Job); each array task picks its item by
``NEMOFLOW_ARRAY_INDEX``, concatenates the part's extracted shards into its
``.jsonl`` (``concatenate: true``; the flow process only orchestrates: at
SlimPajama scale a part is 1,200 shards, tens of GB), tokenizes it into Megatron
``.bin/.idx`` and writes the ``<prefix>.stats.json`` sidecar (its identity and
:class:`TokenizedPart`) that tells a later run the part is done.

A malformed input line is reported as the shard and line it came from (a part
concatenates several shards) on one line, and the task exits 2.
"""

from __future__ import annotations

import re
import sys
import time

from pydantic import BaseModel, Field

from infra import storage
from infra.jobs import ExitCode
from workloads.array_task import read_array_task
from workloads.jsonl import MAX_LINE_BYTES


class TokenizedPart(BaseModel):
    input: str
    prefix: str = Field(..., description="'{prefix}' of '{prefix}.bin/.idx'")
    documents: int
    tokens: int
    bytes_in: int
    bin_bytes: int
    seconds: float
    skipped_malformed: int = 0
    reused: bool = False


class TokenizerSpec(BaseModel):
    type: str
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None


class PlanItem(BaseModel):
    input: str = Field(..., description="the concatenated part (.jsonl)")
    inputs: list[str] = Field(default_factory=list, description="the extracted shards it joins, in order")
    output_prefix: str = Field(..., description="'{output_prefix}_{key}_document.bin/.idx' are written")
    identity: dict = Field(..., description="what makes the output valid (inputs, tokenizer, flags, code)")
    bytes: int = Field(..., description="size of the part's text (of the inputs, when the task concatenates them)")
    concatenate: bool = Field(False, description="join 'inputs' into 'input' first (newline-safe, atomic)")


class TokenizePlan(BaseModel):
    items: list[PlanItem]
    tokenizer: TokenizerSpec
    json_keys: list[str]
    append_eod: bool = True
    workers: int = 1
    skip_malformed: bool = False
    allow_empty: bool = False  # an input without documents is an error naming it, unless this
    max_line_bytes: int = MAX_LINE_BYTES  # a longer line (one document) is an error naming it; 0 = no limit


def stats_uri(prefix: str) -> str:
    return prefix + ".stats.json"


def read_index_counts(prefix: str) -> tuple[int, int]:
    """(documents, tokens) from a Megatron ``.idx`` header and lengths, without loading ``.bin``."""
    import numpy as np

    with storage.open_read(prefix + ".idx") as fh:
        header = fh.read(9 + 8 + 1 + 8 + 8)
        if header[:9] != b"MMIDIDX\x00\x00":
            raise ValueError(f"{prefix}.idx is not a Megatron index (bad magic)")
        sequences = int.from_bytes(header[18:26], "little")
        documents = int.from_bytes(header[26:34], "little") - 1
        lengths = np.frombuffer(fh.read(4 * sequences), dtype=np.int32)
    return documents, int(lengths.sum())


def finished_part(prefix: str, identity: dict) -> TokenizedPart | None:
    """A part tokenized earlier with the same identity, if its files are all there."""
    uri = stats_uri(prefix)
    if not storage.exists(uri):
        return None
    stats = storage.read_json(uri)
    if stats.get("identity") != identity:
        return None
    if not (storage.exists(prefix + ".bin") and storage.exists(prefix + ".idx")):
        return None
    if storage.size(prefix + ".bin") != stats["part"]["bin_bytes"]:
        return None
    return TokenizedPart(**{**stats["part"], "reused": True})


def _naming_shard_line(error: Exception, item: PlanItem) -> str:
    """ "part-00001.jsonl:7302: ..." would send a person hunting: name the shard and its own line."""
    match = re.match(r"^(.*?):(\d+): (.*)$", str(error), re.S)
    if not match or match.group(1) != item.input:
        prefix = f"{item.input}: "
        if item.inputs and str(error).startswith(prefix):  # about the whole part (e.g. empty): name its shards
            shards = ", ".join(item.inputs[:3]) + (f" and {len(item.inputs) - 3} more" if len(item.inputs) > 3 else "")
            return f"{item.input} (joining {shards}): {str(error)[len(prefix) :]}"
        return str(error)
    line = int(match.group(2))
    for shard in item.inputs:
        with storage.open_read(shard) as fh:
            count = sum(1 for _ in fh)
        if line <= count:
            return f"{shard}:{line}: {match.group(3)} (in {storage.basename(item.input)})"
        line -= count
    return str(error)


def tokenize_item(plan: TokenizePlan, item: PlanItem, log=print) -> list[TokenizedPart]:
    from workloads.tokenize import TokenizerConfig, tokenize_file

    bytes_in = item.bytes
    if item.concatenate:
        from workloads.shards import concatenate

        joined = concatenate(item.inputs, item.input)
        bytes_in = joined.bytes
        log(f"{storage.basename(item.input)}: {len(item.inputs)} shard(s), {joined.lines} lines, {joined.bytes} bytes")
    started = time.monotonic()
    stats = tokenize_file(
        item.input,
        item.output_prefix,
        tokenizer=TokenizerConfig(**plan.tokenizer.model_dump()),
        json_keys=tuple(plan.json_keys),
        append_eod=plan.append_eod,
        workers=plan.workers,
        skip_malformed=plan.skip_malformed,
        allow_empty=plan.allow_empty,
        max_line_bytes=plan.max_line_bytes,
    )
    seconds = time.monotonic() - started
    parts = []
    for key in plan.json_keys:
        prefix = f"{item.output_prefix}_{key}_document"
        documents, tokens = read_index_counts(prefix)
        part = TokenizedPart(
            input=item.input,
            prefix=prefix,
            documents=documents,
            tokens=tokens,
            bytes_in=bytes_in,
            bin_bytes=storage.size(prefix + ".bin"),
            seconds=seconds,
            skipped_malformed=getattr(stats, "malformed_skipped", 0),
        )
        storage.write_json(stats_uri(prefix), {"identity": item.identity, "part": part.model_dump()})
        log(
            f"{storage.basename(item.input)} -> {storage.basename(prefix)}: {documents} documents, {tokens} tokens, "
            f"{bytes_in / 1e6 / max(seconds, 1e-9):.1f} MB/s"
        )
        parts.append(part)
    return parts


def main(argv: list[str] | None = None) -> int:
    task = read_array_task(argv, __doc__, TokenizePlan, lambda plan: len(plan.items), "item")
    if task is None:
        return ExitCode.BAD_CONFIG
    plan, index = task
    item = plan.items[index]
    print(f"tokenizing {item.input} -> {item.output_prefix}_*", flush=True)
    from workloads.jsonl import InputError

    try:
        tokenize_item(plan, item, log=lambda line: print(line, flush=True))
    except InputError as exc:
        print(f"error: {_naming_shard_line(exc, item)}", file=sys.stderr, flush=True)
        return ExitCode.BAD_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
