"""Training stage: pretrain or continue pretraining on a prepared dataset.

    from tasks.train import pretrain
    ckpt = pretrain(TrainConfig(max_steps=300, ...), dataset, image, executor="slurm")

The task checks the configuration (parallelism arithmetic, data files) before
it spends compute, then runs ``python -m workloads.train`` as a job where the
executor says (under torchrun when it spans several processes). The run directory is derived from the inputs, so a retry (or
a pre-empted job, exit 76) starts the trainer on the same directory and it
resumes from ``checkpoints/latest``. The result is the best checkpoint by
validation loss, and a loss-curve artifact is published to the Prefect UI.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra import storage
from infra.executors import Executor
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from infra.settings import get_settings
from tasks.common import cache_policy, logger, run_job, transient_only
from tasks.refs import CheckpointRef, DatasetRef
from workloads.train_config import TrainConfig, check_parallelism, parse_blend

TRAIN_MODULES = (
    "workloads.train",
    "workloads.automodel_shim",
    "workloads.train_config",
    "workloads.checkpoint",
    "workloads.data_loader",
    "workloads.staging",
    "tasks.train",
)


def run_dir_for(config: TrainConfig, dataset: DatasetRef | None = None) -> str:
    """The run directory: config.run_dir, else one named by the config and data (stable across retries),
    under the work dir: a path or ``gs://`` (the trainer then uploads its checkpoints there)."""
    if config.run_dir:
        return config.run_dir
    identity = config.model_dump_json(exclude={"run_dir"}) + (dataset.manifest_uri if dataset else "")
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
    storage.write_text(path, config.model_dump_json(indent=1))
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
        resources=Resources(
            nodes=config.num_nodes,
            ntasks_per_node=1,
            gpus_per_node=config.gpus_per_node,
            cpus_per_task=config.cpus_per_task,
            mem=config.mem,
            time=config.time,
        ),
        paths=[run_dir] if local else [],
        read_only=data_dirs(config),
        # W&B only with a key; HF_TOKEN for models and tokenizers named by their hub id
        secret_env=[name for name in ("WANDB_API_KEY", "HF_TOKEN") if name in get_settings().secret_env()],
        # several processes: torchrun on every node (the backend gives the rendezvous)
        nproc_per_node=config.procs_per_node if config.world_size > 1 else None,
        log_dir=os.path.join(run_dir, "logs") if local else None,
    )


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
    lines += ["", f"run directory: `{run_dir}` (metrics.jsonl has every logged step)"]
    return "\n".join(lines)


def _artifact_key(run_dir: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return "loss-curve-" + hashlib.sha256(run_dir.encode()).hexdigest()[:10]


@task(
    name="pretrain",
    task_run_name="pretrain {config.arch}",
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only(),  # a crash or a lost node resumes; not bad config or OOM
    cache_policy=cache_policy(*TRAIN_MODULES),
    persist_result=True,
)
def pretrain(
    config: TrainConfig, dataset: DatasetRef, image: ImageRef | None = None, executor: Executor | Any = None
) -> CheckpointRef:
    """Train on ``dataset``; returns the best checkpoint by validation loss (the latest without one)."""
    from workloads import checkpoint as ckpt

    log = logger()
    config = with_dataset(config, dataset)
    from workloads.memory_plan import check_memory, executor_gpu_memory_gib

    plan = check_parallelism(config)
    check_memory(config, executor_gpu_memory_gib(executor))
    log.info(
        "training %s for %d steps: world %d, data parallel %d, gradient accumulation %d; run_dir %s",
        config.arch,
        plan.total_steps,
        plan.world_size,
        plan.data_parallel_size,
        plan.gradient_accumulation_steps,
        config.run_dir,
    )
    write_config(config)
    run_job(build_train_job(config, image), executor)
    from tasks.tracking import publish_wandb_run

    publish_wandb_run(config.run_dir)  # a W&B link (or the offline run's path) in the Prefect UI

    complete = ckpt.stored_checkpoints(config.run_dir)
    best, latest = ckpt.best_of(complete), (complete[-1] if complete else None)
    if best is None or latest is None:
        raise RuntimeError(f"the trainer finished but {config.run_dir}/checkpoints holds no complete checkpoint")
    result = CheckpointRef(
        uri=best.uri,
        step=best.step,
        val_loss=best.val_loss,
        run_dir=config.run_dir,
        image=image,
        dataset_manifest=dataset.manifest_uri,
    )
    log.info("latest checkpoint %s; best %s (val_loss %s)", latest.uri, best.uri, best.val_loss)
    metrics = read_metrics(config.run_dir)
    key = _artifact_key(config.run_dir)
    create_markdown_artifact(
        key=key, markdown=loss_curve_markdown(metrics, result, config.run_dir), description="training loss curve"
    )
    rows = loss_curve_rows(metrics)
    if rows:
        create_table_artifact(key=key + "-table", table=rows, description="loss, val_loss, lr, tokens/s by step")
    return result
