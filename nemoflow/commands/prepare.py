"""``nemoflow prepare``: run the prepare-dataset flow (download, extract, concatenate, tokenize, blend)."""

from __future__ import annotations

import json

from nemoflow.commands import add_command

DESCRIPTION = (
    "Run the prepare-dataset flow. Without --sources it prepares the embedded demo corpus "
    "(the King James Bible in the SlimPajama layout). Re-running with nothing changed does no work; "
    "added shards are processed alone."
)

EPILOG = """examples:
  nemoflow prepare
  nemoflow prepare --name slimpajama \\
      --sources 'https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/train/chunk{chunk}/example_train_{shard}.jsonl.zst' \\
      --chunks 1-10 --shards 0-99 --output gs://my-bucket/datasets/slimpajama
  nemoflow prepare --sources 'gs://my-bucket/raw/*.jsonl.zst' --tokenizer-type GPT2BPETokenizer \\
      --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

Defaults are PrepareConfig's (flows/prepare_dataset.py); an option not given keeps them."""


def config_options():
    """PrepareConfig's fields as options; the model holds every default and most help texts."""
    from flows.prepare_dataset import PrepareConfig
    from nemoflow.options import ModelOptions, Option

    return ModelOptions(
        PrepareConfig,
        # tokenizer.fingerprint is computed, never given.
        exclude={"tokenizer.fingerprint"},
        fields={
            # Today's spellings (Megatron's preprocess_data.py flags), and help where the model has no description.
            "tokenizer.vocab_file": Option("--vocab-file", help="GPT-2 BPE vocab (GPT2BPETokenizer)"),
            "tokenizer.merge_file": Option("--merge-file", help="GPT-2 BPE merges (GPT2BPETokenizer)"),
            "json_keys": Option(help="JSON keys to tokenize"),
            "append_eod": Option(help="append an end-of-document token to every document"),
        },
    )


def register(sub) -> None:
    parser = add_command(
        sub,
        "prepare",
        "prepare a dataset: raw shards in, Megatron .bin/.idx and NeMo blend weights out",
        DESCRIPTION,
        epilog=EPILOG,
    )
    parser.defer(lambda p: config_options().add_to(p))  # imports the flow: only when `prepare` runs
    parser.defer(_executor_option)
    parser.defer(lambda p: p.add_argument("--json", action="store_true", help="print the resulting DatasetRef as JSON"))
    parser.set_defaults(func=run)


def _executor_option(parser) -> None:
    from infra.executors import EXECUTORS

    # Where the tokenize job array runs is the flow's executor, not a PrepareConfig field.
    parser.add_argument(
        "--executor",
        "--backend",
        dest="executor",
        default=None,
        choices=list(EXECUTORS),
        help="where the tokenize job array runs (default: NEMOFLOW_EXECUTOR, local); its options come from "
        "NEMOFLOW_SLURM_* / NEMOFLOW_K8S_*",
    )


def run(args) -> int:
    from flows.prepare_dataset import prepare_dataset

    config = config_options().build(args)
    dataset = prepare_dataset(config, args.executor)
    if args.json:
        print(json.dumps(dataset.model_dump(mode="json"), indent=2))
    else:
        print(f"dataset:   {dataset.manifest_uri}")
        print(f"documents: {dataset.documents}  tokens: {dataset.tokens}  files: {len(dataset.prefixes)}")
        from tasks.data import auto_blend_text

        print(f"data_prefix={auto_blend_text(dataset.blend)}")
    return 0
