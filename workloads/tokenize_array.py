"""One task of the dataset-preparation job array: ``python -m workloads.tokenize_array --plan PLAN.json``.

The stage (tasks/data.py) writes a plan listing the parts still to tokenize and
submits ONE array job; each array task picks its item by ``NEMOFLOW_ARRAY_INDEX``
(set from ``SLURM_ARRAY_TASK_ID`` or ``JOB_COMPLETION_INDEX`` by the backend),
tokenizes it and writes the ``.stats.json`` sidecar the stage reads back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from infra import storage
from infra.jobs import ARRAY_INDEX_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="plan JSON written by the data stage (path or gs:// URI)")
    parser.add_argument("--array-index", type=int, default=None, help=f"item to run (default: ${ARRAY_INDEX_ENV})")
    args = parser.parse_args(argv)
    index = args.array_index if args.array_index is not None else int(os.environ.get(ARRAY_INDEX_ENV, "0"))
    plan = storage.read_json(args.plan)
    items = plan["items"]
    if not 0 <= index < len(items):
        print(f"array index {index} out of range: the plan {args.plan} has {len(items)} item(s)", file=sys.stderr)
        return 2

    from tasks.data import TokenizedPart, _stats_uri, read_index_counts
    from workloads.tokenize import TokenizerConfig, tokenize_file

    item = items[index]
    tok = plan["tokenizer"]
    print(f"[{index}] tokenizing {item['input']} -> {item['output_prefix']}_*", flush=True)
    started = time.monotonic()
    stats = tokenize_file(
        item["input"],
        item["output_prefix"],
        tokenizer=TokenizerConfig(
            type=tok["type"], model=tok.get("model"), vocab_file=tok.get("vocab_file"), merge_file=tok.get("merge_file")
        ),
        json_keys=tuple(plan["json_keys"]),
        append_eod=plan["append_eod"],
        workers=plan["workers"],
        skip_malformed=plan["skip_malformed"],
    )
    seconds = time.monotonic() - started
    for key in plan["json_keys"]:
        prefix = f"{item['output_prefix']}_{key}_document"
        documents, tokens = read_index_counts(prefix)
        part = TokenizedPart(
            input=item["input"],
            prefix=prefix,
            documents=documents,
            tokens=tokens,
            bytes_in=item["bytes"],
            bin_bytes=storage.size(prefix + ".bin"),
            seconds=seconds,
            skipped_malformed=getattr(stats, "malformed_skipped", 0),
        )
        storage.write_json(_stats_uri(prefix), {"identity": item["identity"], "part": part.model_dump()})
        print(f"[{index}] {prefix}: {documents} documents, {tokens} tokens in {seconds:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
