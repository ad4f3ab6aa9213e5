"""Job: compare two checkpoints on exactly the same held-out samples (the CPT refresh's decision).

    python -m workloads.compare --candidate DIR --promoted DIR --data-prefix '[1.0, "/d/p_text_document"]' \
        --tokenizer-model tokenizer.model --seq-length 256 --split 98,1,1 --seed 1234 --num-batches 8 \
        --output comparison.json

Writes ``{"candidate_loss": ..., "promoted_loss": ...}`` to ``--output`` (atomically) and prints it.
Both losses come from :func:`workloads.validate_checkpoint.evaluate_loss` with the same split, seed
and batches, so they are comparable across refreshes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from infra.permissions import secure_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workloads.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--candidate", required=True, help="the new checkpoint directory")
    parser.add_argument("--promoted", required=True, help="the promoted model's checkpoint directory")
    parser.add_argument("--data-prefix", required=True, help="NeMo blend as JSON: [w1, prefix1, ...]")
    parser.add_argument("--tokenizer-model", default=None, help="sentencepiece .model of the dataset")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--split", default="98,1,1", help="train,validation,test (the validation part is used)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-batches", type=int, default=8)
    parser.add_argument("--output", required=True, help="where to write the JSON result")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from workloads.validate_checkpoint import evaluate_loss

    common = dict(
        tokenizer_model=args.tokenizer_model,
        seq_length=args.seq_length,
        split=args.split,
        seed=args.seed,
        num_batches=args.num_batches,
    )
    blend = json.loads(args.data_prefix)
    result = {
        "candidate_loss": evaluate_loss(args.candidate, blend, **common),
        "promoted_loss": evaluate_loss(args.promoted, blend, **common),
    }
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".tmp-", delete=False) as fh:
        json.dump(result, fh)
    secure_file(fh.name)  # mkstemp made it 0600: the configured mode (infra/permissions.py)
    os.replace(fh.name, args.output)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
