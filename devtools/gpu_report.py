"""The numbers of `nemoflow demo` runs on a GPU node, for the README: stage times, training speed, the answer.

    python -m devtools.gpu_report WORK_DIR OUT        # devtools/gpu_node.sh demo calls it after its two runs

Reads what the runs left: each run's summary (``WORK_DIR/flow-runs/<id>.json``), its stage-times artifact
from the Prefect API the demo recorded in the active profile, and the trained run's ``metrics.jsonl``
(tokens/s, MFU and peak GPU memory of every logged step). Writes ``OUT/gpu-demo.json`` and a markdown
table ``OUT/gpu-demo.md``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def stage_rows(flow_run_id: str) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["end-to-end-stage-times"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
    if not found:
        return []
    data = found[0].data
    return json.loads(data) if isinstance(data, str) else data


def training(checkpoint: str, skip: int = 2) -> dict:
    """Median tokens/s and MFU of the logged steps after the first ``skip`` (compilation), peak memory."""
    run_dir = Path(checkpoint).parents[3]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in metrics if "loss" in m][skip:]
    saves = [m["checkpoint_save_s"] for m in metrics if "checkpoint_save_s" in m]
    return {
        "run_dir": str(run_dir),
        "steps": max((m["step"] for m in metrics if "loss" in m), default=0),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps) if steps else None,
        "mfu": statistics.median(m["mfu"] for m in steps if "mfu" in m) if any("mfu" in m for m in steps) else None,
        "peak_mem_gib": max((m.get("peak_mem_gib", 0.0) for m in steps), default=None),
        "first_loss": next((m["loss"] for m in metrics if "loss" in m), None),
        "last_loss": [m["loss"] for m in metrics if "loss" in m][-1] if steps else None,
        "saves_blocked_s": saves,
    }


def _json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    work_dir, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    summaries = sorted((work_dir / "flow-runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    runs = []
    for path in summaries:
        summary = json.loads(path.read_text())
        runs.append(
            {
                "flow_run_id": summary["flow_run_id"],
                "stages": stage_rows(summary["flow_run_id"]),
                "val_loss": summary["val_loss"],
                "untrained_loss": summary["untrained_loss"],
                "answer": summary["answer"],
                "latency_s": summary["latency_s"],
                "checkpoint": summary["checkpoint"],
                # where the run's GPU-seconds went (tasks/gpu_time.py wrote it; a cached run held nothing)
                "gpu_time": _json_or_none(work_dir / "flow-runs" / summary["flow_run_id"] / "gpu-time.json"),
            }
        )
    report = {"runs": runs, "training": training(runs[0]["checkpoint"]) if runs else None}
    (out / "gpu-demo.json").write_text(json.dumps(report, indent=1))
    lines = ["| stage | first run | second run |", "|---|---:|---:|"]
    first = {r["stage"]: r for r in runs[0]["stages"]} if runs else {}
    second = {r["stage"]: r for r in runs[1]["stages"]} if len(runs) > 1 else {}
    for stage, row in first.items():
        again = second.get(stage)
        lines.append(
            f"| {stage} | {row['seconds']} s ({row['state']}) | "
            + (f"{again['seconds']} s ({again['state']}) |" if again else "|")
        )
    if report["training"]:
        t = report["training"]
        mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "n/a"
        lines += [
            "",
            f"training: {t['steps']} steps, {t['tokens_per_s']:.0f} tokens/s, MFU {mfu}, "
            f"peak {t['peak_mem_gib']:.1f} GiB, loss {t['first_loss']:.2f} -> {t['last_loss']:.2f}; "
            f"val loss {runs[0]['val_loss']:.3f} (untrained {runs[0]['untrained_loss']:.3f})",
            f"smoke answer ({runs[0]['latency_s']:.2f} s): {runs[0]['answer'][:200]!r}",
        ]
    (out / "gpu-demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
