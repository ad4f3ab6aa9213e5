"""The ``automodel`` training engine: NVIDIA NeMo AutoModel's recipes run by nemoflow's trainers, the default.

    train: {hidden_size: 1024, num_layers: 16, max_steps: 500, gpus_per_node: 8}    # engine: automodel

One engine, one option set per stage, each a value with the training engines' interface
(:mod:`tasks.train_engines.base`):

- :class:`AutoModel` pretraining (end-to-end): :class:`infra.configs.train.TrainConfig`, the NeMo-named
  fields ``python -m workloads.train`` reads; the parallelism arithmetic and the memory plan are checked
  before launch, the result is the best checkpoint by validation loss, with loss-curve artifacts;
- :class:`AutoModelCpt` a CPT refresh: the budget and schedule; the model's shape is the promoted
  checkpoint's, read from its config.json (:func:`cpt_train_config` makes the run's :class:`AutoModel`);
- :class:`AutoModelSft` fine-tuning (sft): :class:`infra.configs.sft.SftConfig` for ``python -m workloads.sft``.

The run directory is derived from the inputs, so a retry (or a pre-empted job, exit 76) starts the trainer
on the same directory and it resumes from its latest checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import ClassVar, Literal

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import Field, model_validator

from infra import storage
from infra.configs.sft import SftConfig
from infra.configs.train import TrainConfig, check_parallelism, parse_blend
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from infra.settings import get_settings
from tasks.refs import ChatDataRef, CheckpointRef, DatasetRef
from tasks.train_engines.base import RunJob, TrainEngine, TrainInputs, launcher_resources

TRAIN_MODULES = (
    "workloads.train",
    "workloads.automodel_shim",
    "infra.configs.train",
    "workloads.checkpoint",
    "workloads.data_loader",
    "workloads.staging",
    "workloads.checkpoint_writers",
    "workloads.moe_model",
    "tasks.train_engines.automodel",
)
SFT_MODULES = (
    "workloads.sft",
    "infra.configs.sft",
    "workloads.chat_data",
    "workloads.demo_data",
    "workloads.checkpoint",
    "workloads.automodel_shim",
    # the SFT trainer takes its recipe sections, metrics log and launch checks from the pretraining trainer
    "workloads.train",
    "workloads.data_loader",
    "workloads.staging",
    "workloads.checkpoint_writers",
    "workloads.moe_model",
    "tasks.train_engines.automodel",
)


# ------------------------------------------------------------------ pretraining
class AutoModel(TrainConfig, TrainEngine):
    """Pretraining (and each CPT refresh's run) on NeMo AutoModel: :class:`TrainConfig`'s options."""

    engine: Literal["automodel"] = "automodel"

    modules: ClassVar[tuple[str, ...]] = TRAIN_MODULES

    @property
    def resources(self) -> Resources:
        return train_resources(self)

    @property
    def label(self) -> str:
        return self.arch

    def prepared(self, inputs: TrainInputs) -> AutoModel:
        config = self.model_copy(update={"init_from": inputs.init_from}) if inputs.init_from else self
        return with_dataset(config, inputs.dataset)

    def check(self, executor=None) -> str:
        from infra.configs.memory_plan import check_memory, executor_gpu_memory_gib

        plan = check_parallelism(self)
        check_memory(self, executor_gpu_memory_gib(executor))
        where = f"; run_dir {self.run_dir}" if self.run_dir else ""
        return (
            f"training {self.arch} for {plan.total_steps} steps: world {plan.world_size}, data parallel "
            f"{plan.data_parallel_size}, gradient accumulation {plan.gradient_accumulation_steps}{where}"
        )

    def files(self) -> dict[str, str]:
        return {config_path(self): self.model_dump_json(indent=1, exclude={"engine"})}

    def job(self, inputs: TrainInputs) -> JobSpec:
        return build_train_job(self, inputs.image)

    def result(self, inputs: TrainInputs, run: RunJob) -> CheckpointRef:
        from workloads import checkpoint as ckpt

        complete = ckpt.stored_checkpoints(self.run_dir)
        best, latest = ckpt.best_of(complete), (complete[-1] if complete else None)
        if best is None or latest is None:
            raise RuntimeError(f"the trainer finished but {self.run_dir}/checkpoints holds no complete checkpoint")
        result = CheckpointRef(
            uri=best.uri,
            step=best.step,
            val_loss=best.val_loss,
            run_dir=self.run_dir,
            image=inputs.image,
            dataset_manifest=inputs.dataset.manifest_uri if inputs.dataset else None,
        )
        from tasks.common import logger

        logger().info("latest checkpoint %s; best %s (val_loss %s)", latest.uri, best.uri, best.val_loss)
        publish_loss_curve(self.run_dir, result)
        return result

    def expected_result(self, inputs: TrainInputs) -> CheckpointRef:
        from workloads import checkpoint as ckpt

        best = ckpt.best_checkpoint(self.run_dir) if storage.exists(self.run_dir) else None
        step = best.step if best else self.total_steps
        planned = ckpt.consolidated_dir(ckpt.checkpoints_dir(self.run_dir) / ckpt.step_dir_name(step))
        return CheckpointRef(
            uri=str(best.path) if best else str(planned),
            step=step,
            val_loss=best.val_loss if best else None,
            run_dir=self.run_dir,
            image=inputs.image,
            dataset_manifest=inputs.dataset.manifest_uri if inputs.dataset else None,
        )

    def served_config(self, inputs: TrainInputs) -> dict | None:
        """From scratch: the export's config.json as the model is built from it (workloads/train/recipe.py
        ``served_config``); None from a checkpoint (``init_from``: the parent's shape) or with a tokenizer not on
        this machine."""
        tokenizer = inputs.dataset.tokenizer.model if inputs.dataset else None
        if self.init_from or inputs.init_from or not tokenizer or not storage.is_local(tokenizer):
            return None
        import sentencepiece

        from workloads.train.recipe import served_config

        path = storage.local_path(tokenizer)
        vocab_size = self.vocab_size or sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
        return served_config(self, vocab_size, cuda=self.gpus_per_node > 0)

    def planned_steps(self) -> int:
        return self.total_steps

    def memory_plan(self, executor=None) -> str | None:
        if not self.gpus_per_node:
            return None
        from infra.configs.memory_plan import executor_gpu_memory_gib, plan_memory

        memory = self.gpu_memory_gib or executor_gpu_memory_gib(executor)
        plan = plan_memory(self, gpu_memory_gib=memory)
        where = "" if memory else " (GPU memory unknown: set train.gpu_memory_gib or a Slurm preset to check it)"
        return f"pretrain: {plan.summary()}{where}\n{plan.report()}\n"


def train_resources(config: TrainConfig) -> Resources:
    """The trainer job's resources: one launcher per node (torchrun starts the processes)."""
    return launcher_resources(config)


def run_dir_for(config: TrainConfig, dataset: DatasetRef | None = None) -> str:
    """The run directory: config.run_dir, else one named by the config and data (stable across retries),
    under the work dir: a path or ``gs://`` (the trainer then uploads its checkpoints there)."""
    if config.run_dir:
        return config.run_dir
    identity = config.model_dump_json(exclude={"run_dir", "engine"}) + (dataset.manifest_uri if dataset else "")
    name = f"{config.arch}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    return storage.join(get_settings().work_dir, "runs", name)


def with_dataset(config: TrainConfig, dataset: DatasetRef) -> TrainConfig:
    """The config with the dataset's blend and tokenizer filled in, and its run directory fixed."""
    if not dataset.tokenizer.model:
        raise ValueError("the dataset's tokenizer has no model file (a sentencepiece .model is needed)")
    config = config.model_copy(update={"data_prefix": dataset.blend, "tokenizer_model": dataset.tokenizer.model})
    return config.model_copy(update={"run_dir": storage.normalize(run_dir_for(config, dataset))})


def data_dirs(config: TrainConfig) -> list[str]:
    """The local directories a training or evaluation job reads: the blend's prefixes and the tokenizer
    (gs:// inputs are staged in by the job itself)."""
    prefixes = []
    for blend in (config.data_prefix, config.valid_data_prefix):
        if blend:
            prefixes += parse_blend(blend)[0]
    paths = [os.path.dirname(storage.local_path(p)) for p in prefixes if storage.is_local(p)]
    if config.tokenizer_model and storage.is_local(config.tokenizer_model):
        paths.append(os.path.dirname(storage.local_path(config.tokenizer_model)))
    if config.init_from and storage.is_local(config.init_from):
        paths.append(storage.local_path(config.init_from))
    return sorted(set(paths))


def config_path(config: TrainConfig) -> str:
    """Where the trainer reads its configuration: ``<run_dir>/train_config.request.json``."""
    if not config.run_dir:
        raise ValueError("config.run_dir must be set (with_dataset() fills it)")
    return storage.join(storage.normalize(config.run_dir), "train_config.request.json")


def write_config(config: TrainConfig) -> str:
    path = config_path(config)
    storage.makedirs(storage.parent(path))
    storage.write_text(path, config.model_dump_json(indent=1, exclude={"engine"}))
    return path


def build_train_job(config: TrainConfig, image: ImageRef | None = None) -> JobSpec:
    """The job that runs the trainer on ``config`` (which :func:`write_config` puts where the job reads it)."""
    run_dir = storage.normalize(config.run_dir or "")
    local = storage.is_local(run_dir)  # else the job writes a node-local copy and uploads it
    path = config_path(config)
    return workload_job(
        "train-" + hashlib.sha256(run_dir.encode()).hexdigest()[:10],
        "workloads.train",
        ["--config", path],
        image=image,
        resources=train_resources(config),
        paths=[run_dir] if local else [],
        read_only=data_dirs(config),
        # W&B only with a key; HF_TOKEN for models and tokenizers named by their hub id
        secret_env=[name for name in ("WANDB_API_KEY", "HF_TOKEN") if name in get_settings().secret_env()],
        # several processes: torchrun on every node (the backend gives the rendezvous)
        nproc_per_node=config.procs_per_node if config.world_size > 1 else None,
        log_dir=os.path.join(run_dir, "logs") if local else None,
        env=compile_cache_env(config),
    )


def compile_cache_env(config: TrainConfig) -> dict[str, str] | None:
    """torch.compile's caches (inductor's FX graphs, AOT autograd, its Triton kernels) on the work dir, which every
    node of the cluster shares, instead of each node's /tmp: the nightly refresh of the same model shape on
    another node loads the kernels the last run compiled instead of compiling again. Yours wins where
    ``TORCHINDUCTOR_CACHE_DIR`` is set; none on a gs:// work dir (the cache needs a file system)."""
    work_dir = storage.normalize(get_settings().work_dir)
    if not config.enable_compile or not storage.is_local(work_dir) or os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(work_dir, "cache", "torch-compile")}


def read_metrics(run_dir: str) -> list[dict]:
    path = storage.join(storage.normalize(run_dir), "metrics.jsonl")
    storage.url_to_fs(path)[0].invalidate_cache()  # the job wrote it: no listing cached before counts
    if not storage.exists(path):
        return []
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """Unicode sparkline of ``values`` resampled to ``width`` characters (renders anywhere)."""
    if not values:
        return ""
    if len(values) > width:
        values = [values[int(i * len(values) / width)] for i in range(width)]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * (len(SPARK) - 1) + 0.5))] for v in values)


def loss_chart_svg(metrics: list[dict], width: int = 480, height: int = 160) -> str:
    """A small SVG line chart: train loss (blue line), validation loss (orange dots) by step."""
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    points = train + val
    if len(points) < 2:
        return ""
    pad_l, pad_r, pad_t, pad_b = 44, 10, 10, 22
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    xs, ys = (x1 - x0) or 1, (y1 - y0) or 1

    def xy(step: float, loss: float) -> str:
        x = pad_l + (step - x0) / xs * (width - pad_l - pad_r)
        y = pad_t + (y1 - loss) / ys * (height - pad_t - pad_b)
        return f"{x:.1f},{y:.1f}"

    line = " ".join(xy(s, v) for s, v in train)
    dots = "".join(
        f'<circle cx="{xy(s, v).split(",")[0]}" cy="{xy(s, v).split(",")[1]}" r="3" fill="#e8710a"/>' for s, v in val
    )
    bottom = height - pad_b
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>'
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{bottom}" stroke="#999"/>'
        f'<line x1="{pad_l}" y1="{bottom}" x2="{width - pad_r}" y2="{bottom}" stroke="#999"/>'
        f'<text x="{pad_l - 4}" y="{pad_t + 8}" text-anchor="end">{y1:.2f}</text>'
        f'<text x="{pad_l - 4}" y="{bottom}" text-anchor="end">{y0:.2f}</text>'
        f'<text x="{pad_l}" y="{height - 6}">step {x0}</text>'
        f'<text x="{width - pad_r}" y="{height - 6}" text-anchor="end">step {x1}</text>'
        f'<polyline points="{line}" fill="none" stroke="#1a73e8" stroke-width="2"/>{dots}</svg>'
    )


def loss_curve_rows(metrics: list[dict], max_rows: int = 100) -> list[dict]:
    """One row per logged step (val_loss merged in), thinned to at most ``max_rows`` (last kept)."""
    by_step: dict[int, dict] = {}
    for record in metrics:
        row = by_step.setdefault(record["step"], {"step": record["step"]})
        for key in ("loss", "val_loss", "lr", "tokens_per_s", "mfu", "peak_mem_gib", "grad_norm"):
            if key in record:
                row[key] = record[key]
    rows = [by_step[s] for s in sorted(by_step)]
    if len(rows) > max_rows:
        stride = len(rows) / max_rows
        rows = [rows[int(i * stride)] for i in range(max_rows - 1)] + [rows[-1]]
    for row in rows:
        for key in ("loss", "val_loss", "grad_norm"):
            if key in row:
                row[key] = round(row[key], 4)
        if "lr" in row:
            row["lr"] = float(f"{row['lr']:.3g}")
        if "tokens_per_s" in row:
            row["tokens_per_s"] = round(row["tokens_per_s"])
        if "mfu" in row:
            row["mfu"] = round(row["mfu"], 4)
        if "peak_mem_gib" in row:
            row["peak_mem_gib"] = round(row["peak_mem_gib"], 2)
    return rows


def loss_curve_markdown(metrics: list[dict], best: CheckpointRef | None, run_dir: str) -> str:
    losses = [m["loss"] for m in metrics if "loss" in m]
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    lines = [f"# Training run `{os.path.basename(run_dir)}`", ""]
    if losses:
        lines += [
            f"train loss `{losses[0]:.3f}` {sparkline(losses)} `{losses[-1]:.3f}`  ",
        ]
    if vals:
        lines += [f"val loss `{vals[0]:.3f}` {sparkline(vals)} `{vals[-1]:.3f}`", ""]
    svg = loss_chart_svg(metrics)
    if svg:
        # A data URI: the chart travels inside the artifact, no file server or internet needed.
        encoded = base64.b64encode(svg.encode()).decode()
        lines += [f"![loss curve: train (blue), validation (orange)](data:image/svg+xml;base64,{encoded})", ""]
    if best is not None:
        lines += [f"best checkpoint: `{best.uri}` (step {best.step}, val_loss {best.val_loss})", ""]
    rows = loss_curve_rows(metrics, max_rows=20)
    gpu = any("mfu" in row or "peak_mem_gib" in row for row in rows)
    saves = [m for m in metrics if "checkpoint_save_s" in m]
    if rows:
        header = "| step | loss | val_loss | lr | tokens/s |" + (" MFU | peak GPU memory (GiB) |" if gpu else "")
        lines += [header, "|---:" * (7 if gpu else 5) + "|"]
        for row in rows:
            mfu = f"{row['mfu']:.1%}" if "mfu" in row else ""
            extra = f" {mfu} | {row.get('peak_mem_gib', '')} |" if gpu else ""
            lines.append(
                f"| {row['step']} | {row.get('loss', '')} | {row.get('val_loss', '')} | {row.get('lr', '')} "
                f"| {row.get('tokens_per_s', '')} |{extra}"
            )
    if saves:
        waits = {m["step"]: m["checkpoint_wait_s"] for m in metrics if "checkpoint_wait_s" in m}
        blocked = [m["checkpoint_save_s"] + waits.get(m["step"], 0.0) for m in saves]
        lines += [
            "",
            f"checkpoints: {len(saves)} saves, training blocked {sum(blocked):.2f} s in all "
            f"(median {sorted(blocked)[len(blocked) // 2]:.2f} s a save; the writes ran in the background)",
        ]
    skipped = [m for m in metrics if "checkpoint_skipped_while_writing" in m]
    if skipped:
        # ckpt_while_writing: skip (workloads/train/loop.py): saves due while the previous one was being written
        lines += [
            "",
            f"checkpoints: {len(skipped)} save{'s' if len(skipped) != 1 else ''} skipped while the previous one was "
            f"still being written (ckpt_while_writing: skip; steps {', '.join(str(m['step']) for m in skipped[:10])}"
            + (", ..." if len(skipped) > 10 else "")
            + ")",
        ]
    waiting = [m for m in metrics if "checkpoint_waiting_for" in m]
    if waiting:
        # ckpt_while_writing: replace (workloads/train/device_snapshot.py): saves taken during a write waited in GPU
        # memory; each was written when that write ended, or replaced by a newer one first
        replaced = [m for m in metrics if "checkpoint_replaced_by" in m]
        delays = [m["checkpoint_write_delayed_s"] for m in metrics if "checkpoint_write_delayed_s" in m]
        lines += [
            "",
            f"checkpoints: {len(waiting)} save{'s' if len(waiting) != 1 else ''} taken while the previous one was "
            f"being written (ckpt_while_writing: replace): {len(delays)} written when that write ended"
            + (f" (at most {max(delays):.1f} s later)" if delays else "")
            + f", {len(replaced)} replaced by a newer save before their write",
        ]
    failed = [m for m in metrics if "checkpoint_failed" in m]
    if failed:
        # A failed background save does not end the run (workloads/train/loop.py): the artifact says which were lost.
        listed = "; ".join(f"step {m['step']}: {m['checkpoint_failed']}" for m in failed[-5:])
        lines += [
            "",
            f"checkpoints: {len(failed)} failed save{'s' if len(failed) != 1 else ''} ({listed}); training "
            "continued from each, the previous checkpoint staying the newest",
        ]
    snapshots = [m for m in metrics if "snapshot_copy_s" in m]
    if snapshots:
        # ckpt_snapshots (workloads/train/snapshots.py): each save a copy to host memory, persisted by a writer process
        persisted = [m for m in metrics if "snapshot_persisted_s" in m]
        replaced = [m for m in metrics if "snapshot_replaced_by" in m]
        failed_snapshots = [m for m in metrics if "snapshot_failed" in m]
        copies = sorted(m["snapshot_copy_s"] for m in snapshots)
        lag = max((m["snapshot_lag_s"] for m in persisted), default=None)
        lines += [
            "",
            f"checkpoint snapshots: {len(snapshots)} taken (training blocked {sum(copies):.2f} s in all, median "
            f"{copies[len(copies) // 2]:.2f} s a snapshot), {len(persisted)} persisted"
            + (f" (at most {lag:.1f} s after the save)" if lag is not None else "")
            + f", {len(replaced)} replaced by a newer snapshot before their write"
            + (f", {len(failed_snapshots)} failed" if failed_snapshots else ""),
        ]
    lines += ["", f"run directory: `{run_dir}` (metrics.jsonl has every logged step)"]
    return "\n".join(lines)


def _artifact_key(run_dir: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return "loss-curve-" + hashlib.sha256(run_dir.encode()).hexdigest()[:10]


def publish_loss_curve(run_dir: str, best: CheckpointRef) -> None:
    """The run's loss curve (markdown with a chart) and its table, as artifacts of the stage."""
    metrics = read_metrics(run_dir)
    key = _artifact_key(run_dir)
    create_markdown_artifact(
        key=key, markdown=loss_curve_markdown(metrics, best, run_dir), description="training loss curve"
    )
    rows = loss_curve_rows(metrics)
    if rows:
        create_table_artifact(key=key + "-table", table=rows, description="loss, val_loss, lr, tokens/s by step")


# ------------------------------------------------------------------ a CPT refresh
class AutoModelCpt(TrainEngine):
    """The continued-pretraining run on NeMo AutoModel: token budget and a fresh warmup + decay schedule over
    it; the model's shape is the promoted checkpoint's (:meth:`continued` makes the run's :class:`AutoModel`)."""

    engine: Literal["automodel"] = "automodel"

    max_tokens: int | None = Field(None, ge=1, description="token budget; None = one pass over the new tokens")
    max_steps: int | None = Field(None, ge=1, description="instead of max_tokens")
    lr: float = Field(3e-4, gt=0, description="peak learning rate of the CPT schedule")
    min_lr: float = Field(3e-5, ge=0, description="learning rate at the end of the decay")
    warmup_steps: int = Field(5, ge=0, description="linear warmup (capped at half the run)")
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    reset_optimizer: bool = Field(True, description="fresh optimizer (True) or the promoted run's Adam state")
    global_batch_size: int = Field(8, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    val_check_interval: int = Field(20, ge=1)
    ckpt_every_n_steps: int = Field(20, ge=1)
    limit_val_batches: int = Field(4, ge=0)
    log_every_n_steps: int = Field(5, ge=1)
    seed: int = 1234

    modules: ClassVar[tuple[str, ...]] = AutoModel.modules

    @model_validator(mode="after")
    def _check(self) -> AutoModelCpt:
        if self.max_tokens and self.max_steps:
            raise ValueError("train: set at most one of max_tokens and max_steps")
        if self.min_lr > self.lr:
            raise ValueError(f"train: min_lr={self.min_lr} is above lr={self.lr}")
        return self

    def continued(self, promoted_checkpoint: str, new_tokens: int) -> AutoModel:
        return cpt_train_config(promoted_checkpoint, self, new_tokens)

    @property
    def resources(self) -> Resources:
        return train_resources(TrainConfig.model_construct())  # a refresh trains with the trainer's defaults


def architecture_of(checkpoint: str) -> dict:
    """TrainConfig model fields read from a checkpoint's config.json and meta.json (CPT keeps the shape)."""
    config = storage.read_json(storage.join(checkpoint, "config.json"))
    meta = (
        storage.read_json(storage.join(checkpoint, "meta.json"))
        if storage.exists(storage.join(checkpoint, "meta.json"))
        else {}
    )
    fields = {
        "arch": "mixtral" if config.get("model_type") == "mixtral" else "llama",
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads"),
        "ffn_hidden_size": config["intermediate_size"],
        "seq_length": meta.get("seq_length") or config.get("max_position_embeddings"),
    }
    if fields["arch"] == "mixtral":
        fields.update(
            num_moe_experts=config.get("num_local_experts"), moe_router_topk=config.get("num_experts_per_tok", 2)
        )
    return fields


def cpt_train_config(promoted_checkpoint: str, cpt: AutoModelCpt, new_tokens: int) -> AutoModel:
    """The TrainConfig of one refresh: the promoted model's shape, initialised from it, fresh schedule."""
    fields = architecture_of(promoted_checkpoint)
    budget = {"max_steps": cpt.max_steps} if cpt.max_steps else {"max_tokens": cpt.max_tokens or max(1, new_tokens)}
    probe = AutoModel(
        **fields, **budget, global_batch_size=cpt.global_batch_size, micro_batch_size=cpt.micro_batch_size
    )
    total = probe.total_steps
    return AutoModel(
        **fields,
        **budget,
        init_from=storage.local_path(promoted_checkpoint),
        reset_optimizer=cpt.reset_optimizer,
        lr=cpt.lr,
        min_lr=cpt.min_lr,
        lr_schedule=cpt.lr_schedule,
        # warmup then decay over THIS budget; a warmup longer than a short refresh would never decay
        warmup_steps=min(cpt.warmup_steps, total // 2),
        global_batch_size=cpt.global_batch_size,
        micro_batch_size=cpt.micro_batch_size,
        val_check_interval=min(cpt.val_check_interval, total),
        ckpt_every_n_steps=min(cpt.ckpt_every_n_steps, total),
        limit_val_batches=cpt.limit_val_batches,
        log_every_n_steps=cpt.log_every_n_steps,
        save_top_k=1,
        seed=cpt.seed,
    )


# ------------------------------------------------------------------ fine-tuning
class AutoModelSft(SftConfig, TrainEngine):
    """Fine-tuning on NeMo AutoModel's recipe: :class:`SftConfig`'s options."""

    engine: Literal["automodel"] = "automodel"

    modules: ClassVar[tuple[str, ...]] = SFT_MODULES

    @property
    def resources(self) -> Resources:
        return Resources(
            nodes=self.num_nodes,
            gpus_per_node=self.gpus_per_node,
            cpus_per_task=self.cpus_per_task,
            mem=self.mem,
            time=self.time,
        )

    def prepared(self, inputs: TrainInputs) -> AutoModelSft:
        return with_inputs(self, inputs.init_from, inputs.chat)

    def sft_check(self, defaults: SftConfig) -> SftConfig:
        # every option it was given: the check shares the run directory and reads the model as it was tuned
        given = self.model_dump(exclude_unset=True, exclude={"engine"})
        return SftConfig.model_validate({**defaults.model_dump(exclude_unset=True, exclude={"engine"}), **given})

    def check(self, executor=None) -> str:
        return (
            f"fine-tuning {self.init_from} for {self.max_steps} steps (batch {self.global_batch_size}); "
            f"run_dir {self.run_dir}"
        )

    def files(self) -> dict[str, str]:
        return {sft_config_path(self): self.model_dump_json(indent=1, exclude={"engine"})}  # an SftConfig

    def job(self, inputs: TrainInputs) -> JobSpec:
        return build_sft_job(self, inputs.image)

    def result(self, inputs: TrainInputs, run: RunJob) -> CheckpointRef:
        from workloads import checkpoint as ckpt

        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None:
            raise RuntimeError(
                f"the fine-tuning job finished but {self.run_dir}/checkpoints holds no complete checkpoint"
            )
        result = CheckpointRef(
            uri=str(latest.path), step=latest.step, val_loss=latest.val_loss, run_dir=self.run_dir, image=inputs.image
        )
        create_markdown_artifact(
            key="sft-loss-" + hashlib.sha256(self.run_dir.encode()).hexdigest()[:10],
            markdown=loss_curve_markdown(read_metrics(self.run_dir), result, self.run_dir).replace(
                "# Training run", "# Fine-tuning run", 1
            ),
            description="SFT loss curve",
        )
        return result

    def expected_result(self, inputs: TrainInputs) -> CheckpointRef:
        from workloads import checkpoint as ckpt

        latest = ckpt.latest_checkpoint(self.run_dir) if os.path.isdir(self.run_dir) else None
        planned = ckpt.consolidated_dir(ckpt.checkpoints_dir(self.run_dir) / ckpt.step_dir_name(self.max_steps))
        return CheckpointRef(
            uri=str(latest.path if latest else planned),
            step=latest.step if latest else self.max_steps,
            run_dir=self.run_dir,
            image=inputs.image,
        )

    def planned_steps(self) -> int:
        return self.max_steps


def with_inputs(config: SftConfig, base_checkpoint: str, data: ChatDataRef) -> SftConfig:
    """The config with the base model, the data and a run directory named by all of them."""
    update = {"init_from": storage.local_path(base_checkpoint), "train_data": data.train, "valid_data": data.held_out}
    config = config.model_copy(update=update)
    if not config.run_dir:
        identity = config.model_dump_json(exclude={"run_dir", "engine"})
        name = "sft-" + hashlib.sha256(identity.encode()).hexdigest()[:12]
        work_dir = get_settings().work_dir
        if not storage.is_local(work_dir):
            raise ValueError(
                f"work_dir {work_dir} is not a file system jobs can write checkpoints to; set SftConfig.run_dir"
            )
        config = config.model_copy(update={"run_dir": storage.local_path(storage.join(work_dir, "runs", name))})
    return config


def sft_config_path(config: SftConfig) -> str:
    return os.path.join(storage.local_path(config.run_dir or ""), "sft_config.request.json")


def write_sft_config(config: SftConfig) -> str:
    path = sft_config_path(config)
    storage.makedirs(os.path.dirname(path))
    storage.write_text(path, config.model_dump_json(indent=1, exclude={"engine"}))
    return path


def _read_only_dirs(config: SftConfig) -> list[str]:
    paths = {config.init_from or "", os.path.dirname(config.train_data or ""), os.path.dirname(config.valid_data or "")}
    if config.tokenizer_model:
        paths.add(os.path.dirname(config.tokenizer_model))
    return sorted(p for p in paths if p)


def build_sft_job(config: SftConfig, image: ImageRef | None = None, validate_to: str | None = None) -> JobSpec:
    """The fine-tuning job (or, with ``validate_to``, the check writing its report there)."""
    run_dir = storage.local_path(config.run_dir or "")
    tag = hashlib.sha256(run_dir.encode()).hexdigest()[:10]
    args = ["--config", sft_config_path(config)]
    if validate_to:
        args += ["--validate", validate_to, "--exit-zero"]
    distributed = config.world_size > 1 and not validate_to
    return workload_job(
        ("sft-check-" if validate_to else "sft-") + tag,
        "workloads.sft",
        args,
        image=image,
        resources=Resources(
            nodes=1 if validate_to else config.num_nodes,
            gpus_per_node=min(1, config.gpus_per_node) if validate_to else config.gpus_per_node,
            cpus_per_task=config.cpus_per_task,
            mem=config.mem,
            time=config.time,
        ),
        paths=[run_dir],
        read_only=_read_only_dirs(config),
        secret_env=[]
        if validate_to
        else [n for n in ("WANDB_API_KEY", "HF_TOKEN") if n in get_settings().secret_env()],
        nproc_per_node=config.procs_per_node if distributed else None,
        log_dir=os.path.join(run_dir, "logs"),
    )
