"""Check that a checkpoint is complete, sound and has learned something, before anyone serves it.

    python -m workloads.validate_checkpoint RUN_DIR/checkpoints/epoch_0_step_49/model/consolidated --threshold 7.5

The checkpoint is the consolidated directory the trainer writes (workloads/checkpoint.py).

Checks, in order (a check whose input failed is reported as failed, "skipped"):
  files_complete      every file MANIFEST.json lists is there with its size
  checksums           every file's sha256 matches MANIFEST.json
  weights_load        AutoModelForCausalLM.from_pretrained loads the directory
  finite_weights      no NaN or Inf in any tensor
  val_loss_threshold  loss on the held-out set (validation split of the blend) < --threshold
  better_than_untrained  that loss < the loss of the same architecture freshly initialised with the
                      trainer's seed (the model learned more than a random one knows)

The checkpoint, the held-out blend and the tokenizer may be ``gs://`` URIs: they are staged to local
disk first (workloads/staging.py; the checkpoint by its MANIFEST.json), and the checks run on the copy,
so a file missing or damaged in the bucket fails ``files_complete`` or ``checksums``.

The held-out set is the validation split of the checkpoint's own blend, split
and seed (from meta.json) unless given: a fixed number of batches, the same
samples every time, so two checkpoints (a candidate and the promoted one) are
compared on identical data with :func:`evaluate_loss`.

Prints the JSON report; exit code 0 when every check passed, 1 when one failed
(0 with --exit-zero), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from infra import phases  # noqa: E402 - after the warnings filter
from workloads import checkpoint as ckpt  # noqa: E402 - after the warnings filter (megatron import)
from workloads import staging  # noqa: E402 - see above

DEFAULT_NUM_BATCHES = 8


def _held_out(checkpoint_dir: Path, data_prefix, tokenizer_model, seq_length, split, seed, valid_data_prefix):
    meta = ckpt.read_meta(checkpoint_dir)
    if data_prefix is None:
        data_prefix = meta.get("data_prefix")
        valid_data_prefix = valid_data_prefix or meta.get("valid_data_prefix")
    if data_prefix is None:
        raise ValueError(f"{checkpoint_dir}/meta.json names no data_prefix: pass the held-out data explicitly")
    tokenizer_model = tokenizer_model or str(checkpoint_dir / "tokenizer.model")
    seq_length = seq_length or meta.get("seq_length")
    if not seq_length:
        raise ValueError(f"{checkpoint_dir}/meta.json names no seq_length: pass seq_length")
    return (
        data_prefix,
        tokenizer_model,
        int(seq_length),
        split or meta.get("split", "98,1,1"),
        int(seed if seed is not None else meta.get("seed", 1234)),
        valid_data_prefix,
    )


@phases.timed(phases.DATA)  # the held-out dataset; evaluate() is validation
def _loss_on(model, data_prefix, tokenizer_model, seq_length, split, seed, valid_data_prefix, num_batches, batch_size):
    import torch

    from workloads.data_loader import build_datasets

    with tempfile.TemporaryDirectory(prefix="nemoflow-val-index-") as cache_dir:
        # gs:// prefixes and tokenizer: staged to local disk (Megatron maps the files)
        datasets = build_datasets(
            staging.local_blend(data_prefix),
            staging.stage_in(tokenizer_model),
            seq_length,
            seed,
            train_samples=0,
            valid_samples=num_batches * batch_size,
            cache_dir=cache_dir,
            split=split,
            valid_data_prefix=staging.local_blend(valid_data_prefix),
        )
        device = next(model.parameters()).device
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else _NoAutocast
        return evaluate(model, datasets.valid, num_batches, batch_size, device, autocast)


def lm_loss(model, tokens, labels, loss_mask):
    """Mean next-token cross-entropy over unmasked positions (the trainer's objective, without MoE aux loss)."""
    import torch.nn.functional as F

    out = model(input_ids=tokens, use_cache=False)  # one forward: a KV cache would only hold memory
    per_token = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (per_token * loss_mask.flatten()).sum() / loss_mask.sum().clamp(min=1)


@phases.timed(phases.VALIDATION)
def evaluate(model, dataset, batches: int, batch_size: int, device, autocast) -> float:
    """Mean loss over the first ``batches`` batches of ``dataset``: the same samples every time."""
    import torch

    from workloads.data_loader import get_batch

    was_training = model.training
    model.eval()
    losses = []
    with torch.no_grad():
        for b in range(batches):
            tokens, labels, mask = (t.to(device) for t in get_batch(dataset, b * batch_size, batch_size))
            with autocast():
                losses.append(lm_loss(model, tokens, labels, mask).item())
    model.train(was_training)
    return sum(losses) / len(losses)


class _NoAutocast:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@phases.timed(phases.BUILD)
def load_model(checkpoint_dir: str | os.PathLike):
    """The checkpoint's model (transformers from_pretrained), on CUDA when there is one."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


@phases.timed(phases.BUILD)
def untrained_model(checkpoint_dir: str | os.PathLike, seed: int):
    """The same architecture freshly initialised the way the trainer does it (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint_dir))
    torch.manual_seed(seed)
    # initialised where it is evaluated: on a GPU, random init of the GPU demo's 0.25B parameters on the host
    # took seconds (3.4 s on 2 cores) and then a 1 GB copy; there it is milliseconds (seeded all the same)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def evaluate_loss(
    checkpoint_dir: str | os.PathLike,
    data_prefix: list | None = None,
    *,
    tokenizer_model: str | None = None,
    seq_length: int | None = None,
    split: str | None = None,
    seed: int | None = None,
    valid_data_prefix: list | None = None,
    num_batches: int = DEFAULT_NUM_BATCHES,
    micro_batch_size: int = 4,
) -> float:
    """Mean loss of a checkpoint on a fixed held-out set (the validation split of ``data_prefix``).

    Two checkpoints evaluated with the same arguments see exactly the same
    samples: the continued-pretraining refresh compares a candidate with the
    promoted model this way. Unset arguments come from the checkpoint's meta.json.
    """
    checkpoint_dir = Path(staging.local_checkpoint(str(checkpoint_dir)))
    held_out = _held_out(checkpoint_dir, data_prefix, tokenizer_model, seq_length, split, seed, valid_data_prefix)
    return _loss_on(load_model(checkpoint_dir), *held_out, num_batches, micro_batch_size)


def _check(name: str, passed: bool, detail: str) -> dict:
    return {"name": name, "passed": bool(passed), "detail": detail}


def validate(
    checkpoint_dir: str | os.PathLike,
    threshold: float,
    data_prefix: list | None = None,
    *,
    tokenizer_model: str | None = None,
    seq_length: int | None = None,
    split: str | None = None,
    seed: int | None = None,
    valid_data_prefix: list | None = None,
    num_batches: int = DEFAULT_NUM_BATCHES,
    micro_batch_size: int = 4,
) -> dict:
    """Run every check; returns the report (``passed`` is True only when all checks passed)."""
    import torch
    import transformers  # noqa: F401 - imported here to count as start-up, not as the model load

    phases.switch(phases.VALIDATION)  # the checks; model loads, data and evaluation are timed as their phases

    given = str(checkpoint_dir) if staging.is_remote(str(checkpoint_dir)) else str(Path(checkpoint_dir))
    # a gs:// checkpoint: every file its manifest lists that is there (a missing one fails files_complete)
    checkpoint_dir = Path(staging.local_checkpoint(given, strict=False))
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {given} does not exist")
    checks: list[dict] = []
    manifest_path = checkpoint_dir / ckpt.MANIFEST
    files: dict = {}
    if manifest_path.exists():
        try:
            files = json.loads(manifest_path.read_text()).get("files", {})
        except ValueError:
            files = {}
    problems = ckpt.verify_manifest(checkpoint_dir)
    incomplete = [p for p in problems if "sha256" not in p]
    corrupt = [p for p in problems if "sha256" in p]
    checks.append(
        _check(
            "files_complete", not incomplete, "; ".join(incomplete) or f"{len(files)} files present with their sizes"
        )
    )
    checks.append(
        _check(
            "checksums",
            not problems,
            "; ".join(corrupt) or ("not verified: files incomplete" if incomplete else "sha256 of every file matches"),
        )
    )

    report: dict = {
        "checkpoint": given,
        "threshold": threshold,
        "val_loss": None,
        "untrained_loss": None,
        "files": sorted(files),
        "sizes": {name: entry["size"] for name, entry in files.items()},
        "total_bytes": sum(entry["size"] for entry in files.values()),
        "checks": checks,
    }
    model = None
    try:
        model = load_model(checkpoint_dir)
        params = sum(p.numel() for p in model.parameters())
        checks.append(_check("weights_load", True, f"{type(model).__name__}, {params:,} parameters"))
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        checks.append(_check("weights_load", False, f"{type(exc).__name__}: {exc}"[:500]))

    if model is None:
        checks.append(_check("finite_weights", False, "skipped: weights did not load"))
    else:
        bad = [
            f"{name} ({int((~torch.isfinite(t)).sum())} non-finite)"
            for name, t in model.state_dict().items()
            if t.is_floating_point() and not torch.isfinite(t).all()
        ]
        checks.append(_check("finite_weights", not bad, "NaN/Inf in " + ", ".join(bad[:10]) if bad else "all finite"))

    if model is None:
        checks.append(_check("val_loss_threshold", False, "skipped: weights did not load"))
        checks.append(_check("better_than_untrained", False, "skipped: weights did not load"))
    else:
        held_out = _held_out(checkpoint_dir, data_prefix, tokenizer_model, seq_length, split, seed, valid_data_prefix)
        try:
            val_loss = _loss_on(model, *held_out, num_batches, micro_batch_size)
            del model
            untrained = _loss_on(untrained_model(checkpoint_dir, held_out[4]), *held_out, num_batches, micro_batch_size)
        except (OSError, ValueError, RuntimeError) as exc:
            # Missing held-out data or tokenizer: a failed check naming it, not a crash without a report.
            detail = f"could not evaluate the held-out loss: {type(exc).__name__}: {exc}"[:500]
            checks.append(_check("val_loss_threshold", False, detail))
            checks.append(_check("better_than_untrained", False, "skipped: " + detail))
            report["failed"] = [c["name"] for c in checks if not c["passed"]]
            report["passed"] = False
            return report
        report.update(
            val_loss=val_loss,
            untrained_loss=untrained,
            num_batches=num_batches,
            micro_batch_size=micro_batch_size,
            data_prefix=held_out[0],
            seed=held_out[4],
        )
        finite = math.isfinite(val_loss)
        checks.append(
            _check(
                "val_loss_threshold",
                finite and val_loss < threshold,
                f"val_loss {val_loss:.4f} {'<' if finite and val_loss < threshold else '>='} threshold {threshold}",
            )
        )
        checks.append(
            _check(
                "better_than_untrained",
                finite and val_loss < untrained,
                f"val_loss {val_loss:.4f} vs untrained {untrained:.4f} (same architecture, seed {held_out[4]})",
            )
        )
    report["failed"] = [c["name"] for c in checks if not c["passed"]]
    report["passed"] = not report["failed"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.validate_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (RUN_DIR/checkpoints/epoch_0_step_N/model/consolidated)"
    )
    parser.add_argument("--threshold", type=float, required=True, help="the held-out loss must be below this")
    parser.add_argument(
        "--data-prefix",
        help='held-out blend as JSON, e.g. \'[0.5, "/d/a", 0.5, "/d/b"]\' '
        "(default: the checkpoint's training blend, validation split)",
    )
    parser.add_argument("--valid-data-prefix", help="a separate validation blend as JSON")
    parser.add_argument("--tokenizer-model", help="default: the checkpoint's tokenizer.model")
    parser.add_argument("--num-batches", type=int, default=DEFAULT_NUM_BATCHES)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, help="default: the training seed from meta.json")
    parser.add_argument("--output", help="also write the report to this JSON file (atomically)")
    parser.add_argument("--exit-zero", action="store_true", help="exit 0 even when a check failed")
    args = parser.parse_args(argv)
    try:
        report = validate(
            args.checkpoint,
            args.threshold,
            json.loads(args.data_prefix) if args.data_prefix else None,
            tokenizer_model=args.tokenizer_model,
            seed=args.seed,
            valid_data_prefix=json.loads(args.valid_data_prefix) if args.valid_data_prefix else None,
            num_batches=args.num_batches,
            micro_batch_size=args.micro_batch_size,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        phases.write()  # the job's phase seconds for the stage's gpu-time artifact ($NEMOFLOW_PHASES_FILE)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    text = json.dumps(report, indent=1)
    if args.output:
        from infra import storage

        storage.write_text(args.output, text)
    print(text)
    return 0 if report["passed"] or args.exit_zero else 1


if __name__ == "__main__":
    from infra.processes import exit_now

    exit_now(main())  # without the interpreter's teardown (CUDA, compiled kernels): see exit_now
