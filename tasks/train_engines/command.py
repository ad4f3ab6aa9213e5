"""The ``command`` training engine: your own NeMo recipe (or any trainer) as a stage, under nemoflow's contract.

    train:                                   # in end-to-end's, cpt-refresh's or sft's config
      engine: command
      command: python pretrain.py --data-prefix "$NEMOFLOW_DATA_PREFIX" --ckpt-dir $NEMOFLOW_CHECKPOINT_DIR
      num_nodes: 2
      gpus_per_node: 8

The command runs in the staged image (``python -m workloads.command_run -- COMMAND``) where the
executor says, once per node, with these environment variables (and nothing else to read):

==========================  ==============================================================================
NEMOFLOW_DATA_PREFIX        the dataset blend in NeMo's ``data_prefix`` form, ``"w1 prefix1 w2 prefix2"``
NEMOFLOW_DATA_PREFIX_JSON   the same as a JSON list (``[w1, "prefix1", ...]``)
NEMOFLOW_TOKENIZER_TYPE     Megatron's tokenizer type (``GPTSentencePieceTokenizer``...)
NEMOFLOW_TOKENIZER_MODEL    the tokenizer file the data was tokenized with
NEMOFLOW_SEQ_LENGTH         ``seq_length`` of the config (when set)
NEMOFLOW_INIT_FROM          a checkpoint to start from (CPT: the promoted model; SFT: the base model)
NEMOFLOW_CHAT_TRAIN         SFT: the chat JSONL to train on (OpenAI ``messages`` rows)
NEMOFLOW_CHAT_HELD_OUT      SFT: the held-out chat JSONL
NEMOFLOW_RUN_DIR            the run's directory (stable across retries: resume from what is there)
NEMOFLOW_CHECKPOINT_DIR     where the command must write its checkpoints (``<run_dir>/checkpoints``)
NEMOFLOW_LOG_DIR            where it may write logs
WANDB_PROJECT, WANDB_NAME,  W&B settings (the key, WANDB_API_KEY, arrives as a secret when one is set;
WANDB_DIR, WANDB_MODE       WANDB_MODE=offline writes the run under WANDB_DIR)
NNODES, NPROC_PER_NODE,     the rank layout (workloads/command_run.py): ``torchrun --nnodes $NNODES
NODE_RANK, MASTER_ADDR,     --nproc-per-node $NPROC_PER_NODE --node-rank $NODE_RANK --master-addr
MASTER_PORT                 $MASTER_ADDR --master-port $MASTER_PORT train.py`` works on every backend
==========================  ==============================================================================

Afterwards the stage finds the newest checkpoint under NEMOFLOW_CHECKPOINT_DIR (:func:`newest_checkpoint`:
AutoModel's ``epoch_E_step_N``, Megatron / NeMo 2's ``iter_N`` and ``...step=N...``, Hugging Face
Trainer's ``checkpoint-N``; the highest step wins). A checkpoint already in the Hugging Face layout
(config.json + weights; AutoModel's ``model/consolidated``) is the result; any other is converted
by the configured ``converter`` (a command run as a job in the same image, with ``{checkpoint}``
and ``{output}`` substituted), e.g. NeMo 2's exporter::

    converter: {command: ["python", "-c", "from nemo.collections import llm; import sys;
                llm.export_ckpt(path=sys.argv[1], target='hf', output_path=sys.argv[2])",
                "{checkpoint}", "{output}"]}

No converter and no Hugging Face checkpoint: the stage fails naming the checkpoint and this option.

The checkpoint then gets what the next stages read where the command left it out (nothing is overwritten):
the dataset's ``tokenizer.model`` when it has no tokenizer of its own, a ``meta.json`` naming the blend,
sequence length, split and seed its validation uses (``seq_length``, else the model's
``max_position_embeddings``), and a ``MANIFEST.json`` of its files (checked by the validation).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import ClassVar, Literal

from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import storage
from infra.configs.sft import SftConfig
from infra.configs.train import parse_blend
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from infra.settings import get_settings
from tasks.refs import ChatDataRef, CheckpointRef, DatasetRef
from tasks.train_engines.base import RunJob, TrainEngine, TrainInputs, launcher_resources

HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Step numbers in the checkpoint directory names of the engines people use (first match wins).
STEP_PATTERNS = (
    re.compile(r"^epoch_\d+_step_(\d+)$"),  # NeMo AutoModel
    re.compile(r"^iter_(\d+)$"),  # Megatron-LM, Megatron-Bridge
    re.compile(r"(?:^|[-_])step=(\d+)"),  # NeMo 2 / Lightning: "...--step=99-consumed_samples=..."
    re.compile(r"^checkpoint-(\d+)$"),  # Hugging Face Trainer
    re.compile(r"^step_?(\d+)$"),
)


class ConverterConfig(BaseModel):
    """A command that turns the newest checkpoint into a Hugging Face directory."""

    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(..., min_length=1, description="argv; {checkpoint} and {output} are substituted")
    resources: Resources = Field(default_factory=lambda: Resources(cpus_per_task=2, time="02:00:00"))

    @field_validator("command")
    @classmethod
    def _placeholders(cls, value: list[str]) -> list[str]:
        joined = " ".join(value)
        if "{output}" not in joined:
            raise ValueError("converter command must write to {output} (the Hugging Face directory nemoflow reads)")
        return value


class Command(TrainEngine):
    """Train with your own command instead of nemoflow's trainer (``engine: command``)."""

    engine: Literal["command"] = "command"
    command: list[str] | str = Field(
        ..., description="argv (a list), or one shell string (bash -c, $VARIABLES expand); runs once per node"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra (non-secret) environment")
    secret_env: list[str] = Field(
        default_factory=list, description="more secret names to pass (WANDB_API_KEY and HF_TOKEN are passed when set)"
    )
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    nproc_per_node: int | None = Field(None, ge=1, description="NPROC_PER_NODE for the command (default: GPUs, or 1)")
    cpus_per_task: int = Field(2, ge=1)
    mem: str | None = None
    time: str | None = None
    seq_length: int | None = Field(None, description="passed as NEMOFLOW_SEQ_LENGTH")
    run_dir: str | None = Field(None, description="default: <work_dir>/runs/cmd-<hash of the config and data>")
    wandb_project: str = "nemoflow"
    converter: ConverterConfig | None = Field(None, description="to Hugging Face, when the checkpoint is not already")

    modules: ClassVar[tuple[str, ...]] = ("workloads.command_run", "tasks.train_engines.command")

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def resources(self) -> Resources:
        return launcher_resources(self)

    @property
    def shown(self) -> str:
        return self.command if isinstance(self.command, str) else shlex.join(self.command)

    def prepared(self, inputs: TrainInputs) -> Command:
        return self.model_copy(update={"run_dir": run_dir_for(self, inputs)})

    def sft_check(self, defaults: SftConfig) -> SftConfig:
        # The check is nemoflow's (workloads.sft) on the Hugging Face checkpoint the command left: what the user
        # set of these applies to it too (its run directory, sequence length and node).
        shared = ("run_dir", "seq_length", "num_nodes", "gpus_per_node", "cpus_per_task", "mem", "time")
        chosen = {name: getattr(self, name) for name in shared if name in self.model_fields_set}
        return SftConfig.model_validate({**defaults.model_dump(exclude_unset=True, exclude={"engine"}), **chosen})

    def check(self, executor=None) -> str:
        return f"training with command {self.shown} in {self.run_dir} ({self.num_nodes} node(s))"

    def files(self) -> dict[str, str]:
        # the run directory holds what ran (the command's checkpoints, logs and W&B files go below it)
        return {os.path.join(self.run_dir, "command.request.json"): self.model_dump_json(indent=1)}

    def job(self, inputs: TrainInputs) -> JobSpec:
        return build_command_job(self, inputs.dataset, self.run_dir, inputs.image, inputs.init_from, inputs.chat)

    def result(self, inputs: TrainInputs, run: RunJob) -> CheckpointRef:
        """The newest checkpoint, converted when it is not Hugging Face, with what the next stages read."""
        found, step = newest_checkpoint(os.path.join(self.run_dir, "checkpoints"))
        hf = hf_directory(found)
        converted = False
        if hf is None:
            if self.converter is None:
                raise NoCheckpoint(
                    f"the newest checkpoint {found} is not in the Hugging Face layout (config.json + weights); set "
                    "converter: {command: [..., '{checkpoint}', '{output}']} (e.g. NeMo 2's llm.export_ckpt) to "
                    "convert it"
                )
            output = os.path.join(self.run_dir, "hf", found.name)
            run(build_convert_job(self.converter, found, output, inputs.image))
            hf = hf_directory(Path(output))
            if hf is None:
                raise NoCheckpoint(
                    f"the converter finished but {output} holds no Hugging Face model (config.json + weights)"
                )
            converted = True
        adopt(hf, self, inputs, step)
        create_markdown_artifact(
            key="command-train-" + hashlib.sha256(self.run_dir.encode()).hexdigest()[:10],
            markdown="\n".join(
                [
                    "# Training with your command",
                    "",
                    f"command: `{self.shown}`",
                    f"newest checkpoint: `{found}` (step {step})",
                    f"Hugging Face model: `{hf}`" + (" (converted)" if converted else ""),
                    f"run directory: `{self.run_dir}`",
                ]
            ),
            description="command engine result",
        )
        return CheckpointRef(
            uri=str(hf),
            step=step or 0,
            run_dir=self.run_dir,
            image=inputs.image,
            dataset_manifest=inputs.dataset.manifest_uri if inputs.dataset else None,
        )

    def expected_result(self, inputs: TrainInputs) -> CheckpointRef:
        try:
            found, step = newest_checkpoint(os.path.join(self.run_dir, "checkpoints"))
            uri = str(hf_directory(found) or os.path.join(self.run_dir, "hf", found.name))
        except NoCheckpoint:  # not run yet: where its checkpoints will be
            uri, step = os.path.join(self.run_dir, "checkpoints"), 0
        return CheckpointRef(
            uri=uri,
            step=step or 0,
            run_dir=self.run_dir,
            image=inputs.image,
            dataset_manifest=inputs.dataset.manifest_uri if inputs.dataset else None,
        )


class NoCheckpoint(RuntimeError):
    pass


# ------------------------------------------------------------------ the contract
def data_prefix_string(blend: list) -> str:
    """NeMo's command-line form of a blend: ``"0.3 /data/a_text_document 0.7 /data/b_text_document"``.

    >>> data_prefix_string([0.3, "/d/a", 0.7, "/d/b"])
    '0.3 /d/a 0.7 /d/b'
    >>> data_prefix_string(["/d/a"])
    '/d/a'
    """
    prefixes, weights = parse_blend(blend)
    if weights is None:
        return " ".join(prefixes)
    return " ".join(f"{w:g} {p}" for w, p in zip(weights, prefixes))


def run_dir_for(config: Command, inputs: TrainInputs) -> str:
    if config.run_dir:
        return storage.local_path(config.run_dir)
    identity = (
        config.model_dump_json(exclude={"run_dir", "converter"})
        + (inputs.dataset.manifest_uri if inputs.dataset else "")
        + (inputs.init_from or "")
        + (inputs.chat.fingerprint if inputs.chat else "")
    )
    work_dir = get_settings().work_dir
    if not storage.is_local(work_dir):
        raise ValueError(
            f"work_dir {work_dir} is not a file system jobs can write to; set run_dir to a shared volume path"
        )
    return storage.local_path(
        storage.join(work_dir, "runs", "cmd-" + hashlib.sha256(identity.encode()).hexdigest()[:12])
    )


def contract_env(
    config: Command,
    dataset: DatasetRef | None,
    run_dir: str,
    init_from: str | None,
    chat: ChatDataRef | None = None,
) -> dict[str, str]:
    """The environment variables of the contract (see the module docstring), without the rank layout."""
    env = {
        "NEMOFLOW_RUN_DIR": run_dir,
        "NEMOFLOW_CHECKPOINT_DIR": os.path.join(run_dir, "checkpoints"),
        "NEMOFLOW_LOG_DIR": os.path.join(run_dir, "logs"),
        "NEMOFLOW_NNODES": str(config.num_nodes),
        "NEMOFLOW_NPROC_PER_NODE": str(config.procs_per_node),
        "WANDB_PROJECT": config.wandb_project,
        "WANDB_NAME": os.path.basename(run_dir),
        "WANDB_DIR": run_dir,
    }
    if dataset is not None:
        env["NEMOFLOW_DATA_PREFIX"] = data_prefix_string(dataset.blend)
        env["NEMOFLOW_DATA_PREFIX_JSON"] = json.dumps(dataset.blend)
        env["NEMOFLOW_TOKENIZER_TYPE"] = dataset.tokenizer.type
        if dataset.tokenizer.model:
            env["NEMOFLOW_TOKENIZER_MODEL"] = dataset.tokenizer.model
    if init_from:
        env["NEMOFLOW_INIT_FROM"] = storage.local_path(init_from)
        if dataset is None and os.path.isfile(os.path.join(storage.local_path(init_from), "tokenizer.model")):
            env["NEMOFLOW_TOKENIZER_MODEL"] = os.path.join(storage.local_path(init_from), "tokenizer.model")
    if chat is not None:
        env["NEMOFLOW_CHAT_TRAIN"] = chat.train
        env["NEMOFLOW_CHAT_HELD_OUT"] = chat.held_out
    if config.seq_length:
        env["NEMOFLOW_SEQ_LENGTH"] = str(config.seq_length)
    if os.environ.get("WANDB_MODE"):
        env["WANDB_MODE"] = os.environ["WANDB_MODE"]
    env.update(config.env)
    return env


def build_command_job(
    config: Command,
    dataset: DatasetRef | None,
    run_dir: str,
    image: ImageRef | None = None,
    init_from: str | None = None,
    chat: ChatDataRef | None = None,
) -> JobSpec:
    argv = ["--shell", "--", config.command] if isinstance(config.command, str) else ["--", *config.command]
    read_only = []
    if dataset is not None:
        read_only += [os.path.dirname(storage.local_path(p)) for p in parse_blend(dataset.blend)[0]]
        if dataset.tokenizer.model and "://" not in dataset.tokenizer.model and os.path.isabs(dataset.tokenizer.model):
            read_only.append(os.path.dirname(dataset.tokenizer.model))
    if init_from:
        read_only.append(storage.local_path(init_from))
    if chat is not None:
        read_only += [os.path.dirname(chat.train), os.path.dirname(chat.held_out)]
    secrets = [n for n in ("WANDB_API_KEY", "HF_TOKEN") if n in get_settings().secret_env()]
    return workload_job(
        "cmd-" + hashlib.sha256(run_dir.encode()).hexdigest()[:10],
        "workloads.command_run",
        argv,
        image=image,
        env=contract_env(config, dataset, run_dir, init_from, chat),
        resources=config.resources,
        paths=[run_dir],
        read_only=sorted(set(read_only)),
        secret_env=sorted({*secrets, *config.secret_env}),
        # several nodes: the backend starts the launcher once per node (torchrun, one process each), which
        # hands the node rank and the rendezvous host to the command (workloads/command_run.py)
        nproc_per_node=1 if config.num_nodes > 1 else None,
        log_dir=os.path.join(run_dir, "logs"),
    )


# ------------------------------------------------------------------ after the command
def step_of(name: str) -> int | None:
    """The training step a checkpoint directory's name says, for the layouts of :data:`STEP_PATTERNS`.

    >>> [step_of(n) for n in ["epoch_0_step_49", "iter_0001000", "model--step=99-consumed_samples=800.0", "x"]]
    [49, 1000, 99, None]
    """
    for pattern in STEP_PATTERNS:
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


def hf_directory(path: Path) -> Path | None:
    """``path`` (or AutoModel's ``model/consolidated`` below it) when it is a Hugging Face model directory."""
    for candidate in (path, path / "model" / "consolidated", path / "hf"):
        if (candidate / "config.json").is_file() and any((candidate / w).exists() for w in HF_WEIGHTS):
            return candidate
    return None


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> tuple[Path, int | None]:
    """The newest checkpoint directory under ``checkpoint_dir``: highest step, else the latest modified."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise NoCheckpoint(f"the command wrote no checkpoint directory {root} (NEMOFLOW_CHECKPOINT_DIR)")
    candidates = []
    for path in root.rglob("*"):
        if not path.is_dir() or storage.TMP_MARK in path.name or path.name.endswith(("-unfinished", ".tmp")):
            continue
        step = step_of(path.name)
        if step is not None and not any(step_of(p.name) is not None for p in path.relative_to(root).parents if p.name):
            candidates.append((step, path.stat().st_mtime, path))
    if candidates:
        step, _, path = max(candidates, key=lambda c: (c[0], c[1]))
        return path, step
    if hf_directory(root):
        return root, None
    raise NoCheckpoint(
        f"no checkpoint under {root}: expected directories named like epoch_0_step_N (AutoModel), iter_N (Megatron), "
        "...step=N... (NeMo 2), checkpoint-N (Hugging Face), or a Hugging Face model directory"
    )


def build_convert_job(converter: ConverterConfig, checkpoint: Path, output: str, image: ImageRef | None) -> JobSpec:
    argv = [part.replace("{checkpoint}", str(checkpoint)).replace("{output}", output) for part in converter.command]
    return workload_job(
        "convert-" + hashlib.sha256(output.encode()).hexdigest()[:10],
        "workloads.command_run",
        ["--", *argv],
        image=image,
        resources=converter.resources,
        paths=[os.path.dirname(output)],
        read_only=[str(checkpoint)],
        log_dir=os.path.join(os.path.dirname(output), "logs"),
    )


def adopt(hf: Path, config: Command, inputs: TrainInputs, step: int | None) -> None:
    """Give the command's Hugging Face checkpoint what validation, serving and the registry read, where it lacks
    it (nothing it wrote is replaced; see the module docstring)."""
    from workloads import checkpoint as ckpt

    tokenizer = inputs.dataset.tokenizer.model if inputs.dataset else None
    if tokenizer is None and inputs.init_from:
        tokenizer = os.path.join(storage.local_path(inputs.init_from), ckpt.TOKENIZER)
    has_tokenizer = any((hf / name).is_file() for name in (ckpt.TOKENIZER, "tokenizer.json"))
    if (
        not has_tokenizer
        and tokenizer
        and storage.is_local(tokenizer)
        and os.path.isfile(storage.local_path(tokenizer))
    ):
        storage.get_file(storage.local_path(tokenizer), str(hf / ckpt.TOKENIZER))
    if not (hf / ckpt.META).is_file():
        model = json.loads((hf / "config.json").read_text())
        meta = {
            "step": step,
            "engine": config.engine,
            "command": config.shown,
            "seq_length": config.seq_length or model.get("max_position_embeddings"),
            "split": "98,1,1",  # the validator's defaults: the command's own split is not known here
            "seed": 1234,
        }
        if inputs.dataset is not None:
            meta.update(data_prefix=inputs.dataset.blend, tokenizer_model=inputs.dataset.tokenizer.model)
        if inputs.init_from:
            meta["init_from"] = inputs.init_from
        ckpt.write_text_atomic(hf / ckpt.META, json.dumps(meta, indent=1, sort_keys=True))
    if not (hf / ckpt.MANIFEST).is_file():
        ckpt.write_manifest(hf)
