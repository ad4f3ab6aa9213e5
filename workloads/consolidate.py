"""Export saved checkpoints as Hugging Face directories, outside the training loop.

    python -m workloads.consolidate RUN_DIR                       # the best and the last saved checkpoint
    python -m workloads.consolidate RUN_DIR/checkpoints/epoch_0_step_59 [...]   # these step directories
        [--tokenizer-model PATH] [--threads N]

During training every save is AutoModel's sharded, resumable checkpoint, written in the background
(torch.distributed.checkpoint from pinned host memory): the training loop waits only while the state
is copied off the GPU. The Hugging Face export the later stages load (validation, serving, the
registry, continued pretraining) is made here, in a separate process, for the checkpoints that need
it: the trainer starts this module when training ends (the best checkpoint by validation loss and the
last one), and a person can run it on any saved checkpoint (a run that was stopped for good, an
older step).

What it does per step directory, with the export code AutoModel's ``save_consolidated`` runs
(torch.distributed.checkpoint's ``consolidate_safetensors_files``; AutoModel's copy of it where the
checkpoint has a per-tensor dtype map):

1. merges the ranks' ``model/shard-*.safetensors`` into ``model/consolidated/model-*.safetensors``
   following the tensor-to-file map AutoModel recorded in ``model/.hf_metadata``;
2. copies the Hugging Face metadata (config.json, generation_config.json) beside them and names the
   architecture in config.json (vLLM and TensorRT-LLM read it);
3. adds ``tokenizer.model`` and the step's ``meta.json``;
4. writes ``MANIFEST.json`` (size and sha256 of every file) LAST, atomically.

A consolidated directory without a manifest is an interrupted export: it is removed and made
again. Exit codes: 0 done, 2 a step directory that is missing, unpublished or not AutoModel's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from infra import failpoints  # noqa: E402 - after the warnings filter
from workloads import checkpoint as ckpt  # noqa: E402 - see above

HF_METADATA = Path("model") / ".hf_metadata"
# AutoModel's names for its export maps (nemo_automodel.components.checkpoint._backports.hf_utils)
FQN_TO_FILE_INDEX = "fqn_to_file_index_mapping.json"
FQN_TO_DTYPE = "fqn_to_dtype_mapping.json"


class NotExportable(ValueError):
    """The directory is not a saved AutoModel checkpoint with Hugging Face metadata."""


def export(step_dir: str | os.PathLike, tokenizer_model: str | None = None, threads: int = 4) -> Path:
    """Make (or keep) the Hugging Face export of one saved checkpoint; returns its consolidated directory."""
    step_dir = Path(step_dir)
    consolidated = ckpt.consolidated_dir(step_dir)
    if (consolidated / ckpt.MANIFEST).exists():
        return consolidated
    metadata = step_dir / HF_METADATA
    if not step_dir.is_dir() or not ckpt.STEP_DIR_RE.match(step_dir.name):
        raise NotExportable(f"{step_dir} is not an AutoModel checkpoint directory (epoch_E_step_S)")
    if (step_dir / ckpt.INCOMPLETE).exists():
        raise NotExportable(f"{step_dir} was never published (its save did not finish): it cannot be exported")
    if not (metadata / FQN_TO_FILE_INDEX).exists():
        raise NotExportable(f"{step_dir} has no {HF_METADATA / FQN_TO_FILE_INDEX} (saved without safetensors?)")
    shutil.rmtree(consolidated, ignore_errors=True)  # an interrupted export: start again
    consolidated.mkdir(parents=True)
    mapping = json.loads((metadata / FQN_TO_FILE_INDEX).read_text())
    if (metadata / FQN_TO_DTYPE).exists():
        # AutoModel's copy of torch's function adds the per-tensor dtype map (checkpoints initialised from a
        # Hugging Face model that mixes dtypes); importing AutoModel costs seconds, so only when needed.
        from nemo_automodel.components.checkpoint._backports.consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        dtypes = json.loads((metadata / FQN_TO_DTYPE).read_text())
        consolidate_safetensors_files(
            input_dir=str(step_dir / "model"),
            output_dir=str(consolidated),
            fqn_to_index_mapping=mapping,
            num_threads=threads,
            fqn_to_dtype_mapping=dtypes,
        )
    else:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        consolidate_safetensors_files(
            input_dir=str(step_dir / "model"),
            output_dir=str(consolidated),
            fqn_to_index_mapping=mapping,
            num_threads=threads,
        )
    for item in metadata.iterdir():
        if item.name in (FQN_TO_FILE_INDEX, FQN_TO_DTYPE):
            continue  # AutoModel's internal maps, not part of a Hugging Face directory
        if item.is_dir():
            shutil.copytree(item, consolidated / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, consolidated / item.name)
    ckpt.name_architecture(consolidated)
    ckpt.write_meta(consolidated, ckpt.step_meta(step_dir), tokenizer_model)
    if failpoints.enabled("consolidate.crash_before_manifest"):
        os.kill(os.getpid(), signal.SIGKILL)
    if failpoints.enabled("consolidate.pause_before_manifest"):
        time.sleep(120)
    ckpt.write_manifest(consolidated)
    return consolidated


def export_run(run_dir: str | os.PathLike, tokenizer_model: str | None = None, threads: int = 4) -> list[Path]:
    """Export what a finished run needs: its best and its last saved checkpoint."""
    return [export(c.step_dir, tokenizer_model, threads) for c in ckpt.to_export(ckpt.saved_checkpoints(run_dir))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.consolidate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", help="a run directory (its best and last checkpoint) or step directories")
    parser.add_argument("--tokenizer-model", help="sentencepiece model to copy in (default: the run's config)")
    parser.add_argument("--threads", type=int, default=4, help="writer threads per export (default 4)")
    args = parser.parse_args(argv)
    try:
        for path in map(Path, args.paths):
            tokenizer = args.tokenizer_model or _run_tokenizer(path)
            if ckpt.checkpoints_dir(path).is_dir():
                targets = [c.step_dir for c in ckpt.to_export(ckpt.saved_checkpoints(path))]
                if not targets:
                    raise NotExportable(f"{path} holds no saved checkpoint")
            else:
                targets = [path]
            for step_dir in targets:
                started = time.perf_counter()
                done = export(step_dir, tokenizer, args.threads)
                size = sum(f.stat().st_size for f in done.iterdir() if f.is_file())
                print(f"exported {done} ({size / 2**30:.2f} GiB in {time.perf_counter() - started:.1f} s)", flush=True)
    except (NotExportable, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _run_tokenizer(path: Path) -> str | None:
    """The tokenizer model the run trained with (its train_config.json), for a run or a step directory."""
    for run_dir in (path, path.parent.parent):
        config = run_dir / "train_config.json"
        if config.exists():
            return json.loads(config.read_text()).get("tokenizer_model")
    return None


if __name__ == "__main__":
    sys.exit(main())
