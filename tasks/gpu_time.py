"""Where each GPU-second of a run goes: the ``gpu-time`` artifact of an end-to-end or CPT-refresh run.

    checkpoint = ...; gpu_time.run_timed(spec, executor, beside=run_dir)   # a stage's job, timed
    with gpu_time.clocked(resources) as clock: ...                          # a stage without a job of its own
    gpu_time.publish(serving=config.serve.engine.resources)                 # the flow, at the end

Each stage that holds accelerators (training, validation, the server's start, the smoke test's generation)
measures the wall seconds of its job or service from this side (submitted -> done) and reads how the job
itself spent them: the job writes its phases (infra/phases.py: process start and imports, model build and
compile, data loading, training steps, checkpoint saves and export, validation) to the file named by
``$NEMOFLOW_PHASES_FILE``, which :func:`run_timed` sets; a server reports its start in ``/health`` (the
built-in engine's model load; the proxy in front of vLLM or Triton: its own start, the engine's start, the
warm-up generation). What lies outside the job's process is measured too: the queue and the launch (submitted ->
the process's start) and the exit (its last phase -> the backend saying done). A job that reports no
phases (a command engine's own script) shows its seconds as not itemised.

Held = accelerators x wall seconds: the job's GPUs (``gpus_per_node x nodes``), or on a run without GPUs its
CPU cores (``cpus_per_task x ntasks_per_node x nodes``), so the CPU suite checks the same artifact. Goodput
= seconds in training steps over the seconds the run held, both in accelerator-seconds. A stage that did
not run (Cached) held nothing in this run and is not listed. The server keeps running after the run; it is
counted from its start to the end of the smoke test, not after.

Each timed stage writes one record, ``<work_dir>/flow-runs/<root flow run>/gpu-time/<n>.json``, while the
flow runs (a retried stage writes one per attempt: a failed attempt held its GPUs too); :func:`publish`
reads them, makes the table (``gpu-time``) and markdown (``gpu-time-summary``) artifacts and writes
``gpu-time.json`` beside the records.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from typing import Any

from infra import phases, storage
from infra.jobs import JobResult, JobSpec, Resources
from infra.settings import get_settings
from tasks.common import logger, run_job

ARTIFACT_KEY = "gpu-time"
# How far a job's wall clock may be behind this one (NTP keeps a cluster's clocks within milliseconds).
CLOCK_SLACK_S = 1.0


def _root_run_id() -> str | None:
    from prefect.runtime import flow_run

    run_id = flow_run.root_flow_run_id or flow_run.id
    return str(run_id) if run_id else None


def records_dir(flow_run_id: str) -> str:
    return storage.join(get_settings().work_dir, "flow-runs", flow_run_id, "gpu-time")


def accelerators(resources: Resources | None) -> dict[str, int] | None:
    """The GPUs and CPU cores a job of these resources holds (None: not known here, e.g. the smoke test's)."""
    if resources is None:
        return None
    return {
        "gpus": resources.gpus_per_node * resources.nodes,
        "cpus": resources.cpus_per_task * resources.ntasks_per_node * resources.nodes,
    }


class StageClock:
    """The wall seconds of one stage's job or service, and what it was spent on (see the module docstring)."""

    def __init__(self, resources: Resources | None, tail: str = phases.EXIT):
        self.resources = resources
        self.tail = tail
        self.started_unix = time.time()
        self._started = time.monotonic()
        self.seconds: float | None = None
        self.job: dict | None = None  # the job's own phases (infra.phases report), when it gave them
        self.parts: dict[str, float] = {}  # phases this side timed itself (the smoke test's generation)

    @contextmanager
    def part(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.monotonic() - started

    def stop(self) -> None:
        if self.seconds is None:
            self.seconds = time.monotonic() - self._started

    def itemised(self) -> dict[str, float]:
        """Seconds per phase: before the process, the process's own phases, after it; or this side's parts."""
        self.stop()
        if self.job is not None and self.job["process_start_unix"] < self.started_unix - CLOCK_SLACK_S:
            self.job = None  # a process older than the stage (a server already running): not this stage's phases
        if self.job is not None:
            launch = _slack(self.job["process_start_unix"] - self.started_unix)
            after = _slack(self.started_unix + self.seconds - self.job["end_unix"])
            return {phases.LAUNCH: launch, **self.job["seconds"], self.tail: after}
        if self.parts:
            rest = self.seconds - sum(self.parts.values())
            return {**self.parts, **({phases.OTHER: rest} if rest >= 0.01 else {})}
        return {phases.UNITEMISED: self.seconds}

    def record(self) -> dict[str, Any]:
        from prefect.runtime import task_run

        itemised = self.itemised()
        return {
            "stage": task_run.task_name or "stage",
            "task_run": task_run.name,
            "started_unix": self.started_unix,
            "seconds": round(self.seconds, 3),
            "held_by": accelerators(self.resources),
            "phases": {name: round(value, 3) for name, value in itemised.items()},
        }


def _slack(seconds: float) -> float:
    """0 for a gap a hair below 0: /proc counts a process's start in clock ticks (10 ms), the clocks may differ
    by that much; a larger negative gap is left as it is (the artifact then shows the clocks disagree)."""
    return 0.0 if -CLOCK_SLACK_S < seconds < 0 else seconds


def _save(clock: StageClock) -> None:
    """Write the stage's record for the run's artifact; a failure here is logged, never the stage's failure."""
    run_id = _root_run_id()
    if not run_id:
        return
    try:
        name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}.json"
        storage.write_json(storage.join(records_dir(run_id), name), clock.record())
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger().warning("could not record this stage's GPU time: %s", exc)


@contextmanager
def clocked(resources: Resources | None, tail: str = phases.EXIT):
    """Time the block as one stage's holding of ``resources``; its record is written however the block ends."""
    clock = StageClock(resources, tail)
    try:
        yield clock
    finally:
        clock.stop()
        _save(clock)


def run_timed(spec: JobSpec, executor: Any, beside: str) -> JobResult:
    """:func:`tasks.common.run_job`, timed: the job writes its phases to a new file in ``beside`` (a directory
    it writes to anyway: a mounted path or object storage), which is read when it ends, failed or not."""
    path = storage.join(storage.normalize(beside), "phases", f"{uuid.uuid4().hex[:12]}.json")
    spec = spec.model_copy(update={"env": {**spec.env, phases.PHASES_FILE_ENV: path}})
    with clocked(spec.resources) as clock:
        try:
            return run_job(spec, executor)
        finally:
            clock.stop()
            clock.job = phases.read(path)


def service_phases(url: str) -> dict | None:
    """A started server's own phases, from its ``/health`` (the built-in engine gives them; others: None)."""
    import httpx

    try:
        body = httpx.get(url.rstrip("/") + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    found = body.get("phases") if isinstance(body, dict) else None
    return found if isinstance(found, dict) and isinstance(found.get("seconds"), dict) else None


# ---------------------------------------------------------------- the flow's artifact


def read_records(flow_run_id: str) -> list[dict]:
    directory = records_dir(flow_run_id)
    storage.url_to_fs(directory)[0].invalidate_cache()
    if not storage.exists(directory):
        return []
    paths = sorted(p for p in storage.listdir(directory) if p.endswith(".json"))
    return [storage.read_json(p) for p in paths]


def account(records: list[dict], serving: Resources | None = None) -> dict[str, Any]:
    """The run's accounting from its stages' records: rows per stage and phase, totals, goodput.

    ``serving``: the server's resources, which the smoke test holds while it generates (its record names
    none: the stage has no job of its own). The unit is GPU when any stage held a GPU, else CPU.
    """
    served = accelerators(serving)
    held_by = [r["held_by"] or served or {"gpus": 0, "cpus": 0} for r in records]
    unit = "GPU" if any(h["gpus"] for h in held_by) else "CPU"
    count = [h["gpus"] if unit == "GPU" else h["cpus"] for h in held_by]
    column = f"{unit}-s"
    held = sum(r["seconds"] * n for r, n in zip(records, count))
    steps = sum(r["phases"].get(phases.STEPS, 0.0) * n for r, n in zip(records, count))
    rows = []
    for record, n in zip(records, count):
        ordered = sorted(record["phases"].items(), key=lambda kv: _rank(kv[0]))
        for phase, seconds in ordered:
            rows.append(_row(record["stage"], phase, seconds, n, column, held))
        rows.append(_row(record["stage"], "all", record["seconds"], n, column, held, accelerators=n))
    return {
        "unit": unit,
        "column": column,
        "held": round(held, 3),
        "training_steps": round(steps, 3),
        "goodput": round(steps / held, 4) if held > 0 else None,
        "stages": [{**r, "accelerators": n} for r, n in zip(records, count)],
        "rows": rows,
    }


def _rank(phase: str) -> int:
    return phases.ORDER.index(phase) if phase in phases.ORDER else len(phases.ORDER)


def _row(stage: str, phase: str, seconds: float, n: int, column: str, held: float, **extra) -> dict:
    value = seconds * n
    return {
        "stage": stage,
        "phase": phase,
        "seconds": round(seconds, 2),
        column: round(value, 2),
        "share": round(value / held, 4) if held > 0 else None,
        **extra,
    }


def markdown(accounting: dict[str, Any], title: str) -> str:
    unit, column = accounting["unit"], accounting["column"]
    goodput = accounting["goodput"]
    lines = [f"# Where the {unit}-seconds of this {title} run went", ""]
    if not accounting["stages"]:
        return "\n".join(lines + ["No stage ran a job in this run (every stage Cached): nothing was held."])
    lines += [
        f"**Held: {accounting['held']:,.1f} {column}**; training steps {accounting['training_steps']:,.1f} {column}: "
        f"**goodput {goodput * 100:.1f} %**" + ("" if unit == "GPU" else " (a run without GPUs: CPU cores x seconds)"),
        "",
        f"| stage | phase | seconds | {column} | share of the run |",
        "|---|---|---:|---:|---:|",
    ]
    for row in accounting["rows"]:
        share = f"{row['share'] * 100:.1f} %" if row["share"] is not None else ""
        if row["phase"] == "all":
            lines.append(
                f"| **{row['stage']}** | **all** ({row['accelerators']} {unit}) | **{row['seconds']:.1f}** "
                f"| **{row[column]:.1f}** | **{share}** |"
            )
        else:
            lines.append(f"| {row['stage']} | {row['phase']} | {row['seconds']:.1f} | {row[column]:.1f} | {share} |")
    lines += [
        "",
        f"Held = {unit}s x wall seconds of each stage's job (submitted to done) or server (started to ready, "
        "then the smoke test's requests). Stages not listed ran no job in this run (Cached). "
        f"{phases.LAUNCH}: before the job's process started; {phases.EXIT}: after its last phase. "
        "A process's first training step (compile, warm-up) counts as model build.",
    ]
    return "\n".join(lines)


def publish(title: str, serving: Resources | None = None) -> dict[str, Any] | None:
    """The flow's ``gpu-time`` artifacts (a table and a markdown summary) from its stages' records; returns
    the accounting without its rows (for the flow's summary), None outside a flow run."""
    run_id = _root_run_id()
    if not run_id:
        return None
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    accounting = account(read_records(run_id), serving)
    summary_uri = storage.join(get_settings().work_dir, "flow-runs", run_id, "gpu-time.json")
    storage.write_text(summary_uri, json.dumps(accounting, indent=1))
    if accounting["rows"]:
        create_table_artifact(
            key=ARTIFACT_KEY,
            table=accounting["rows"],
            description=f"{accounting['unit']}-seconds held per stage and phase",
        )
    create_markdown_artifact(
        key=f"{ARTIFACT_KEY}-summary",
        markdown=markdown(accounting, title),
        description=f"where the {accounting['unit']}-seconds went; goodput",
    )
    return {k: v for k, v in accounting.items() if k not in ("rows", "stages")}
