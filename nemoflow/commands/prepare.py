"""``nemoflow prepare``: run the prepare-dataset flow (download, extract, concatenate, tokenize, blend)."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    parser = sub.add_parser(
        "prepare",
        help="prepare a dataset: raw shards in, Megatron .bin/.idx and NeMo blend weights out",
        description="Run the prepare-dataset flow. Without --sources it prepares the embedded demo corpus "
        "(the King James Bible in the SlimPajama layout). Re-running with nothing changed does no work; "
        "added shards are processed alone.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  nemoflow prepare
  nemoflow prepare --name slimpajama \\
      --sources 'https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/train/chunk{chunk}/example_train_{shard}.jsonl.zst' \\
      --chunks 1-10 --shards 0-99 --output gs://my-bucket/datasets/slimpajama
  nemoflow prepare --sources 'gs://my-bucket/raw/*.jsonl.zst' --tokenizer-type GPT2BPETokenizer \\
      --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt""",
    )
    parser.add_argument("--name", default="demo", help="dataset name (default: demo)")
    parser.add_argument("--sources", nargs="+", help="URIs, a glob, or a URL template with {chunk} and {shard}")
    parser.add_argument("--chunks", help="chunk range for {chunk}, e.g. 1-10")
    parser.add_argument("--shards", help="shard range for {shard}, e.g. 0-99")
    parser.add_argument("--output", help="dataset URI (default: $NEMOFLOW_WORK_DIR/datasets/NAME)")
    parser.add_argument("--shards-per-file", type=int, default=1200, help="shards per tokenized file (default 1200)")
    parser.add_argument("--tokenizer-type", default="GPTSentencePieceTokenizer", help="Megatron --tokenizer-type")
    parser.add_argument("--tokenizer-model", help="sentencepiece .model / HF tokenizer (default: Mixtral's)")
    parser.add_argument("--vocab-file", help="GPT-2 BPE vocab (GPT2BPETokenizer)")
    parser.add_argument("--merge-file", help="GPT-2 BPE merges (GPT2BPETokenizer)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize (default: text)")
    parser.add_argument("--no-append-eod", action="store_true", help="do not append an end-of-document token")
    parser.add_argument("--workers", type=int, default=2, help="tokenizer processes per file (default 2)")
    parser.add_argument("--skip-malformed", action="store_true", help="skip and count malformed JSON lines")
    parser.add_argument("--delete-compressed", action="store_true", help="delete .zst files after extraction")
    parser.add_argument(
        "--executor",
        "--backend",
        dest="executor",
        default=None,
        choices=["local", "slurm", "k8s"],
        help="where the tokenize job array runs (default: NEMOFLOW_EXECUTOR, local); options from "
        "NEMOFLOW_SLURM_* / NEMOFLOW_K8S_*",
    )
    parser.add_argument("--json", action="store_true", help="print the resulting DatasetRef as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from flows.prepare_dataset import PrepareConfig, prepare_dataset
    from tasks.refs import TokenizerRef

    sources = args.sources
    if sources is not None and len(sources) == 1:
        sources = sources[0]
    config = PrepareConfig(
        name=args.name,
        sources=sources,
        chunks=args.chunks,
        shards=args.shards,
        output=args.output,
        shards_per_file=args.shards_per_file,
        tokenizer=TokenizerRef(
            type=args.tokenizer_type, model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file
        ),
        json_keys=args.json_keys,
        append_eod=not args.no_append_eod,
        workers=args.workers,
        skip_malformed=args.skip_malformed,
        delete_compressed=args.delete_compressed,
    )
    dataset = prepare_dataset(config, args.executor)
    if args.json:
        print(json.dumps(dataset.model_dump(mode="json"), indent=2))
    else:
        print(f"dataset:   {dataset.manifest_uri}")
        print(f"documents: {dataset.documents}  tokens: {dataset.tokens}  files: {len(dataset.prefixes)}")
        from tasks.data import auto_blend_text

        print(f"data_prefix={auto_blend_text(dataset.blend)}")
    return 0
