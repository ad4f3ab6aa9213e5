"""``nemoflow preprocess``: a drop-in for Megatron-LM's ``tools/preprocess_data.py``.

Same flags, same output files (byte for byte), several times faster.
"""

from __future__ import annotations

import sys

from nemoflow.commands import add_command

EPILOG = """\
example (Mixtral tokenizer, as for Megatron's preprocess_data.py):
  nemoflow preprocess --input data.jsonl.zst --output-prefix out/data \\
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model \\
      --append-eod --workers 2

writes out/data_text_document.bin and .idx (one pair per --json-keys key).
--output-prefix may be a gs:// URI. Progress goes to stderr; a JSON summary to stdout."""


DESCRIPTION = (
    "Tokenize one JSON-lines file (.jsonl or .jsonl.zst) into Megatron indexed datasets "
    "{output_prefix}_{key}_document.bin/.idx, byte-identical to Megatron-LM's tools/preprocess_data.py "
    "for the same input, tokenizer and flags."
)


def register(sub) -> None:
    parser = add_command(
        sub,
        "preprocess",
        "tokenize a .jsonl[.zst] file into Megatron .bin/.idx (preprocess_data.py compatible)",
        DESCRIPTION,
        epilog=EPILOG,
    )
    parser.add_argument("--input", required=True, help="input .jsonl or .jsonl.zst (local path or gs:// URI)")
    parser.add_argument("--output-prefix", required=True, help="path (or gs:// URI) without suffix")
    from workloads.tokenize import add_megatron_arguments

    add_megatron_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    import logging

    from workloads.tokenize import StderrProgress, config_from_args, tokenize_file

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = config_from_args(args)
    stats = tokenize_file(
        args.input,
        args.output_prefix,
        config,
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        workers=args.workers,
        skip_malformed=args.skip_malformed,
        progress=StderrProgress(args.input),
        allow_empty=args.allow_empty,
        max_line_bytes=args.max_line_bytes,
    )
    skipped = f", skipped {stats.malformed_skipped} malformed record(s)" if stats.malformed_skipped else ""
    print(
        f"{stats.documents:,} documents, {stats.tokens:,} tokens, {stats.bytes_in / 1e6:,.1f} MB in "
        f"{stats.seconds:.1f} s ({stats.mb_per_s:,.1f} MB/s, {stats.backend}, {stats.dtype}){skipped}",
        file=sys.stderr,
    )
    for key, prefix in stats.outputs.items():
        print(f"  {key}: {prefix}.bin / .idx", file=sys.stderr)
    print(stats.model_dump_json())
    return 0
