"""The GPU acceptance report: what `devtools/gpu_node.sh acceptance` measured on a GPU node, checked against targets.

    python -m devtools.acceptance collect PARTS OUT     # gpu_node.sh calls it after each part
    python -m devtools.acceptance docs REPORT.json      # regenerate docs/benchmarks.md's GPU section from a report
    python -m devtools.acceptance render REPORT.json    # print that section
    python -m devtools.acceptance merge OUT.json REPORT.json...  # one report from each lease's last report
    python -m devtools.acceptance plan RUN/bench.json   # the memory plan of a bench_train_gpu run (the train part)

Each part of the acceptance run (`demo`, `tests`, `train`, `moe`, `serve`) leaves its results under PARTS/<part>/ on
the node (files under /tmp survive between the calls of one lease, and one call may run 10 minutes, so the
parts are separate calls); `collect` reads whatever parts exist and writes OUT/acceptance.json and
OUT/acceptance.md: the commit, the machine, every number, and each check with its target and whether it
passed. Two kinds of checks:

- ``must``: the GPU path works (the demo completes, a second run is all Cached, validation passes, the
  smoke test answers, the `gpu` tests pass, each benchmark ran, the memory plan is within 10 % of the peak the
  train part measured). The acceptance passes when the parts demo, tests, train and serve ran and every must
  check of the parts that ran passed (`moe` when the lease has the time).
- ``target``: the speed and cost goals the docs state (docs/benchmarks.md); reported met or missed.

The committed report of a named commit (benchmarks/results/h200-<commit>.json) is what docs/benchmarks.md's GPU
section is generated from; tests/foundation/test_acceptance.py fails when the two disagree.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu-report:begin -->", "<!-- gpu-report:end -->"
PARTS = ("demo", "tests", "train", "moe", "serve")
# issue 31's acceptance; `serve` (vLLM's benchmark) is reported when it ran
REQUIRED = ("demo", "tests", "train", "serve")
# `moe` (the MoE benchmarks: issue 35's MFU targets; the MoE steps' correctness on the GPU is in `tests`) runs when
# the lease has the time: the five parts took about 2,000 s of device time at d1f5225, a lease has 1,800
BUILD = "model build and compile"  # infra/phases.py's name of the phase, in a trainer run's phase_s

# (name, kind, description, target, comparison) — the value each check reads is computed in `checks()`.
TARGETS = {
    "demo_cold_s": ("target", "GPU demo, first run, whole `nemoflow demo`", 120.0, "<="),
    "demo_pretrain_s": ("target", "GPU demo, pretrain stage", 40.0, "<="),
    "demo_mfu": ("target", "GPU demo training MFU (median of logged steps)", 0.35, ">="),
    "smoke_s": ("target", "GPU demo, the seed's smoke request", 2.0, "<="),
    "demo_early_load_s": (
        "target",
        "GPU demo, the validated checkpoint loaded into the server started beside training (serve.start_early)",
        10.0,
        "<=",
    ),
    "ckpt10_ratio": ("target", "1.1B, a save every 10 steps: share of the no-save rate", 0.90, ">="),
    "ckpt10_blocked_s": ("target", "1.1B, a save every 10 steps: median time a save blocks", 0.5, "<="),
    "moe_mb4_mfu": ("target", "moe-0.9b grouped, micro batch 4: MFU (active)", 0.30, ">="),
    "mixtral_2l_mb2_mfu": ("target", "Mixtral-8x7B 2-layer slice, micro batch 2: MFU (active)", 0.45, ">="),
    "mixtral_2l_mb4_mfu": ("target", "Mixtral-8x7B 2-layer slice, micro batch 4: MFU (active)", 0.45, ">="),
    "serve_ttft_p99_c16_ms": ("target", "vLLM behind the proxy, concurrency 16: TTFT p99 (ms)", 100.0, "<="),
    "proxy_cost_c16_pct": ("target", "the proxy's cost at concurrency 16: % of output tokens/s", 5.0, "<="),
    "proxy_ttft_cost_c16_pct": ("target", "the proxy's cost at concurrency 16: % added to TTFT p50", 5.0, "<="),
    "vllm_over_builtin_c16": (
        "target",
        "vLLM behind the proxy over the built-in engine, concurrency 16: output tokens/s (times)",
        50.0,
        ">=",
    ),
    # issue 31 item 4: a later run of the same shape (the nightly refresh) reuses the compiled kernels
    "vllm_restart_graphs_compiled": (
        "target",
        "vLLM's start on a new checkpoint directory of the same shape (the nightly refresh): graphs compiled "
        "again (0: all loaded from vLLM's compile cache)",
        0,
        "<=",
    ),
}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status(parts: Path, part: str) -> dict | None:
    """``PARTS/<part>/status.json``: {exit, wall_s} written by gpu_node.sh when the part ended."""
    return _load(parts / part / "status.json")


def machine() -> dict:
    """The node: GPUs and driver (nvidia-smi), Python and torch (this interpreter's)."""
    info: dict = {"python": sys.version.split()[0]}
    try:
        rows = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
        info["gpus"] = [r.split(",")[0].strip() for r in rows if r.strip()]
        info["driver"] = rows[0].split(",")[1].strip() if rows else None
    except (OSError, subprocess.SubprocessError):
        info["gpus"], info["driver"] = [], None
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    return info


def demo_part(parts: Path) -> dict | None:
    """The two `nemoflow demo` runs: gpu_report's gpu-demo.json, the whole-run times, the gpu-time artifact."""
    base = parts / "demo"
    report = _load(base / "gpu-demo.json")
    if report is None:
        return None
    times = [int(m) for m in re.findall(r"demo run \d+: (\d+) s", _read(base / "demo-times.txt"))]
    # which serving engine's environment the demo had (gpu_node.sh demo writes it; `auto` picks vLLM when there)
    serving = _read(base / "engine.txt").removeprefix("serving engine environment: ") or None
    plane = [control_plane(_read(base / f"demo-{n}.log")) for n in range(1, len(times) + 1)]
    early = started_early(_read(base / "endpoint.log"))
    return {**report, "whole_s": times, "serving": serving, "control_plane": plane, "started_early": early}


def started_early(endpoint_log: str) -> dict | None:
    """The checkpoint the demo's server, started beside training, loaded and how long the load took (the proxy's
    line, workloads/serve_engines/proxy.py); None when no server of the demo loaded one (it started as usual)."""
    found = re.search(r"loaded (\S+) into the (\w+) engine\sin ([\d.]+) s; serving it", endpoint_log)
    if not found:
        return None
    return {"checkpoint": found.group(1), "engine": found.group(2), "load_s": float(found.group(3))}


def control_plane(demo_output: str) -> str | None:
    """The control plane's seconds, step by step, from `nemoflow demo`'s last line (None where it does not
    itemise them: a demo before 75c8042)."""
    found = re.search(r"^total: .*\(control plane (\d+ s: [^;]*);", demo_output, re.M)
    return found.group(1) if found else None


def tests_part(base: Path) -> dict | None:
    """pytest's closing line of the `gpu` tests (tests-gpu.log; its own part: the demo twice and the tests
    together ran past one 10-minute call)."""
    text = _read(base / "tests-gpu.log")
    if not text:
        return None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text.splitlines()[-1])}
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
        "skipped": counts.get("skipped", 0),
        "last_line": text.splitlines()[-1],
    }


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def bench_part(parts: Path, part: str) -> dict:
    """Every bench_train_gpu JSON a part left (its name says the model and micro batch); for ``serve``, the
    serving benchmark's summary alone (vLLM's per-level result files beside it hold every request)."""
    if part == "serve":
        summary = _load(parts / part / "bench_serve_vllm.json")
        return {"bench_serve_vllm": summary} if summary is not None else {}
    return {p.stem: _load(p) for p in sorted((parts / part).glob("*.json")) if p.name != "status.json"}


def checks(report: dict) -> list[dict]:
    """Each check: name, kind, what, target, value, passed (None where its part did not run)."""
    demo = report.get("demo") or {}
    runs = demo.get("runs") or []
    training = demo.get("training") or {}
    first = {s["stage"]: s for s in runs[0]["stages"]} if runs else {}
    second = runs[1]["stages"] if len(runs) > 1 else []
    out: list[dict] = []

    def must(name: str, what: str, value, passed: bool | None) -> None:
        out.append({"name": name, "kind": "must", "what": what, "target": None, "value": value, "passed": passed})

    ran = "demo" in report["parts_ran"]
    must("demo_completed", "the GPU demo completed, twice", len(runs), len(runs) >= 2 if ran else None)
    must(
        "demo_cached",
        "the second run: every stage Cached",
        sorted({s["state"] for s in second}) or None,
        (bool(second) and all(s["state"] == "Cached" for s in second)) if ran else None,
    )
    val = (runs[0]["val_loss"], runs[0]["untrained_loss"]) if runs else None
    must("validation", "validation loss below the untrained model's", val, (val[0] < val[1]) if val else None)
    answer = runs[0]["answer"] if runs else None
    must("smoke_answer", "the smoke test answered", (answer or "")[:80], bool(answer) if ran else None)
    tests = report.get("tests")
    must(
        "gpu_tests",
        "the tests marked gpu",
        tests["last_line"] if tests else None,
        (tests["failed"] == 0 and tests["passed"] > 0)
        if tests
        else (False if "tests" in report["parts_ran"] else None),
    )
    for part in ("train", "moe", "serve"):
        results = report.get(part) or {}
        if part in report["parts_ran"]:
            errors = [k for k, v in results.items() if not v or _has_error(v)]
            must(f"{part}_ran", f"the {part} benchmarks ran", sorted(results), bool(results) and not errors)
    plan = ((report.get("train") or {}).get("memory-plan") or {}).get("estimate_gib")
    peak = (((report.get("train") or {}).get("ckpt10") or {}).get("nemoflow_no_saves") or {}).get("peak_mem_gib")
    must(
        "memory_plan",
        "the memory plan (infra/configs/memory_plan.py) of the train part's 1.1B run without saves: at most 10 % "
        "above the peak it measured (GiB: plan, peak)",
        (round(plan, 2), round(peak, 2)) if plan and peak else None,
        (peak <= plan <= 1.1 * peak) if plan and peak else None,
    )
    values = {
        "demo_cold_s": (demo.get("whole_s") or [None])[0],
        # the stage is named with its model ("pretrain llama"): the first run's stage whose name starts so
        "demo_pretrain_s": next((s["seconds"] for n, s in first.items() if n.split()[0] == "pretrain"), None),
        "demo_mfu": training.get("mfu"),
        "smoke_s": runs[0]["latency_s"] if runs else None,
        "demo_early_load_s": (demo.get("started_early") or {}).get("load_s"),
        **train_values(report.get("train") or {}),
        **moe_values(report.get("moe") or {}),
        **serve_values(report.get("serve") or {}),
    }
    for name, (kind, what, target, op) in TARGETS.items():
        value = values.get(name)
        passed = None if value is None else (value <= target if op == "<=" else value >= target)
        shown = _fmt(target, _unit(name))
        if name == "demo_early_load_s" and value is None and "started_early" in demo:
            value, passed = "not loaded: the server started as usual", False  # a demo that started early and fell back
        out.append(
            {"name": name, "kind": kind, "what": what, "target": f"{op} {shown}", "value": value, "passed": passed}
        )
    return out


def serve_values(serve: dict) -> dict:
    """The serving targets, from the levels the benchmark measured (a run its time limit cut short never
    wrote its summary fields, so they are computed here from the rows)."""
    r = serve.get("bench_serve_vllm") or {}
    levels = r.get("levels") or {}
    proxy16 = levels.get("proxy", {}).get("16", {})
    direct16 = levels.get("vllm", {}).get("16", {}).get("output_throughput")
    builtin16 = levels.get("builtin", {}).get("16", {}).get("output_throughput")
    served16 = proxy16.get("output_throughput")
    ttft16, direct_ttft16 = proxy16.get("p50_ttft_ms"), levels.get("vllm", {}).get("16", {}).get("p50_ttft_ms")
    cost = round(100 * (1 - served16 / direct16), 2) if served16 and direct16 else None
    ttft_cost = round(100 * (ttft16 / direct_ttft16 - 1), 2) if ttft16 and direct_ttft16 else None
    paired = (r.get("proxy_cost") or {}).get("16") or {}
    if paired.get("method") == "paired":  # both paths at once on one engine (the benchmark's summary, every round)
        cost, ttft_cost = paired.get("output_tok_s_pct"), paired.get("ttft_p50_pct")
    restart = r.get("vllm_restart") or {}
    return {
        # only where vLLM's log said either way (its lines: bench_serve_vllm.compile_cache)
        "vllm_restart_graphs_compiled": restart.get("graphs_compiled")
        if restart.get("compile_cache") in ("hit", "miss")
        else None,
        "serve_ttft_p99_c16_ms": proxy16.get("p99_ttft_ms"),
        "proxy_cost_c16_pct": cost,
        "proxy_ttft_cost_c16_pct": ttft_cost,
        "vllm_over_builtin_c16": round(served16 / builtin16, 1) if served16 and builtin16 else None,
    }


def _has_error(result: dict) -> bool:
    if "error" in result:
        return True
    levels = result.get("levels") or {}  # the serving benchmark: a level whose client failed
    if any("error" in row for rows in levels.values() for row in rows.values()):
        return True
    return any(isinstance(v, dict) and "error" in v for v in (result.get("nemoflow") or {}).values())


def train_values(train: dict) -> dict:
    ckpt = train.get("ckpt10") or {}
    nemo = ckpt.get("nemoflow") or {}
    return {"ckpt10_ratio": ckpt.get("effective_ratio"), "ckpt10_blocked_s": nemo.get("blocked_median_s")}


def moe_values(moe: dict) -> dict:
    def mfu(key: str) -> float | None:
        result = (moe.get(key) or {}).get("nemoflow") or {}
        grouped = result.get("grouped") if "grouped" in result else result
        return (grouped or {}).get("mfu")

    return {
        "moe_mb4_mfu": mfu("moe-0.9b-mb4"),
        "mixtral_2l_mb2_mfu": mfu("mixtral-8x7b-2l-mb2"),
        "mixtral_2l_mb4_mfu": mfu("mixtral-8x7b-2l-mb4"),
    }


def collect(parts: Path, commit: str) -> dict:
    ran = [p for p in PARTS if _status(parts, p) is not None]
    report = {
        "commit": commit,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "parts_ran": ran,
        "part_status": {p: _status(parts, p) for p in ran},
        "demo": demo_part(parts),
        "tests": tests_part(parts / "tests"),
        "train": bench_part(parts, "train"),
        "moe": bench_part(parts, "moe"),
        "serve": bench_part(parts, "serve"),
    }
    return judge(report)


def judge(report: dict) -> dict:
    """The report's checks and verdict, from the parts' data it holds (the node's collect, and again when a
    committed report is rendered: the same measurements judged by this code's targets)."""
    report["checks"] = checks(report)
    musts = [c for c in report["checks"] if c["kind"] == "must"]
    report["passed"] = (
        set(REQUIRED) <= set(report["parts_ran"])
        and all(c["passed"] for c in musts if c["passed"] is not None)
        and all(c["passed"] is not None for c in musts)
    )
    return report


def merge(reports: list[dict]) -> dict:
    """One report of a commit from the reports of several leases (the machine went back between two calls and
    the next part ran on a fresh one after the node install): each part's data from the newest report that ran
    it. Give each lease's last report (a lease's collect holds every part that lease ran). The reports must name
    one commit and one kind of machine; ``leases`` says which parts ran where."""
    if not reports:
        raise ValueError("merge needs at least one report")
    reports = sorted(reports, key=lambda r: r["date"])
    for key in ("commit", "machine"):
        values = {json.dumps(r[key], sort_keys=True) for r in reports}
        if len(values) > 1:
            raise ValueError(f"the reports differ in {key}: {', '.join(sorted(values))}")
    merged = {k: v for k, v in reports[-1].items() if k not in ("checks", "passed")}
    merged["parts_ran"] = [p for p in PARTS if any(p in r["parts_ran"] for r in reports)]
    merged["part_status"] = {}
    for part in merged["parts_ran"]:
        newest = [r for r in reports if part in r["parts_ran"]][-1]
        merged["part_status"][part] = newest["part_status"][part]
        merged[part] = newest.get(part)
    for part in PARTS:
        if part not in merged["parts_ran"]:
            merged[part] = None if part == "tests" else {}
    merged["leases"] = [{"date": r["date"], "parts_ran": r["parts_ran"]} for r in reports]
    return judge(merged)


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "not run"
    if unit == "%":
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.2f}{unit}" if abs(value) < 10 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def _leases(leases: list[dict]) -> str:
    """A merged report's sentence: which parts ran on which lease of the machine."""
    if len(leases) < 2:
        return ""
    each = "; ".join(f"{', '.join(lease['parts_ran'])} ({lease['date']})" for lease in leases)
    return f" Its parts ran on {len(leases)} leases of that machine, each after the node install: {each}."


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: a smoke answer's newline or ``|`` would cut its row."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|")


def _unit(name: str) -> str:
    return "%" if name.endswith(("_mfu", "_ratio", "_goodput")) else " s" if name.endswith("_s") else ""


def verdict(report: dict) -> str:
    """**passed**, or **NOT passed** with why: the required parts that did not run, the must checks that failed."""
    if report["passed"]:
        return "**passed**"
    why = []
    missing = [p for p in REQUIRED if p not in report["parts_ran"]]
    if missing:
        why.append(f"required parts not run: {', '.join(missing)}")
    failed = [c["name"] for c in report["checks"] if c["kind"] == "must" and c["passed"] is False]
    if failed:
        why.append(f"must checks failed: {', '.join(failed)}")
    elif missing:
        why.append("every must check of the parts run passed")
    return "**NOT passed** (" + "; ".join(why or ["a must check was not run"]) + ")"


def render(report: dict) -> str:
    """The markdown of a report: docs/benchmarks.md's GPU section and OUT/acceptance.md."""
    m = report["machine"]
    gpus = f"{len(m.get('gpus') or [])} x {m['gpus'][0]}" if m.get("gpus") else "no GPU"
    lines = [
        f"Acceptance run at commit `{report['commit']}` on {gpus} (driver {m.get('driver')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}), {report['date']}: {verdict(report)} "
        f"(parts run: {', '.join(report['parts_ran']) or 'none'}). Command: `devtools/gpu_node.sh acceptance OUT PART` "
        "for each part (after the node install, docs/install.md); the report is "
        f"`benchmarks/results/h200-{report['commit'][:7]}.json`." + _leases(report.get("leases") or []),
        "",
        "| check | kind | target | measured | result |",
        "|---|---|---|---|---|",
    ]
    for c in report["checks"]:
        result = {
            True: "pass" if c["kind"] == "must" else "met",
            False: "FAIL" if c["kind"] == "must" else "missed",
            None: "not run",
        }[c["passed"]]
        lines.append(
            f"| {c['what']} | {c['kind']} | {c['target'] or ''} | {_cell(_fmt(c['value'], _unit(c['name'])))} | {result} |"
        )
    demo = report.get("demo") or {}
    runs = demo.get("runs") or []
    if runs:
        lines += ["", "| stage (end-to-end/local, GPU demo) | first run | second run |", "|---|---:|---:|"]
        second = {s["stage"]: s for s in runs[1]["stages"]} if len(runs) > 1 else {}
        for s in runs[0]["stages"]:
            again = second.get(s["stage"])
            lines.append(
                f"| {s['stage']} | {s['seconds']} s ({s['state']}) | "
                + (f"{again['seconds']} s ({again['state']}) |" if again else "|")
            )
        whole = demo.get("whole_s") or []
        lines.append("| `nemoflow demo`, whole | " + " | ".join(f"{w} s" for w in whole) + " |")
        plane = [(n, text) for n, text in enumerate(demo.get("control_plane") or [], 1) if text]
        if plane:
            lines += [
                "",
                "Before each flow run, the control plane: " + "; ".join(f"run {n}, {t}" for n, t in plane) + ".",
            ]
        t = demo.get("training") or {}
        if t.get("tokens_per_s"):
            lines += [
                "",
                f"Training in the pipeline: {t['steps']} steps, {t['tokens_per_s']:,.0f} tokens/s (median), MFU "
                f"{_fmt(t.get('mfu'), '%')}, peak {t.get('peak_mem_gib') or 0:.1f} GiB; loss {t['first_loss']:.2f} -> "
                f"{t['last_loss']:.2f}; validation loss {runs[0]['val_loss']:.3f} (untrained "
                f"{runs[0]['untrained_loss']:.3f}). Serving engine environment: {demo.get('serving') or 'not recorded'}. "
                f"Smoke answer in {runs[0]['latency_s']:.2f} s: "
                f"{runs[0]['answer'][:120]!r}",
            ]
    held = (runs[0].get("gpu_time") or {}) if runs else {}
    if held.get("rows"):
        column = held["column"]
        lines += [
            "",
            f"Where the first run's {held['unit']}-seconds went (its `gpu-time` artifact): held "
            f"{held['held']:,.1f} {column}, training steps {held['training_steps']:,.1f}: goodput "
            f"{_fmt(held.get('goodput'), '%')}.",
            "",
            f"| stage | phase | seconds | {column} |",
            "|---|---|---:|---:|",
        ]
        lines += [f"| {r['stage']} | {r['phase']} | {r['seconds']:.1f} | {r[column]:.1f} |" for r in held["rows"]]
    bench = [(part, name, r) for part in ("train", "moe") for name, r in (report.get(part) or {}).items() if r]
    if bench:
        lines += [
            "",
            "| benchmark | model | micro batch | tokens/s | MFU | peak GiB | saves blocked (median) | build and compile |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for _part, name, r in bench:
            for variant, n in _variants(r):
                lines.append(
                    f"| {name}{variant} | {r.get('model')} | {r.get('micro_batch_size')} | "
                    f"{_fmt(n.get('tokens_per_s'))} | {_fmt(n.get('mfu'), '%')} | {_fmt(n.get('peak_mem_gib'))} | "
                    f"{_fmt(n.get('blocked_median_s'), ' s')} | {_fmt((n.get('phase_s') or {}).get(BUILD), ' s')} |"
                )
        lines.append(
            "\nBuild and compile: the trainer's own phase (model init, torch.compile's first steps), with torch.compile's "
            "cache on the run's work dir as the pipeline sets it: a benchmark's second run of the same shape (no saves) "
            "loads the kernels its first run compiled."
        )
        lines += [f"\n{name}: {r['recomputed']}" for _part, name, r in bench if r.get("recomputed")]
    lines += serve_lines(report.get("serve") or {})
    return "\n".join(lines) + "\n"


def serve_lines(serve: dict) -> list[str]:
    """The serving benchmark (`vllm bench serve`): each engine and concurrency, the proxy's cost."""
    r = serve.get("bench_serve_vllm") or {}
    levels = r.get("levels") or {}
    if not levels:
        return []
    names = {"proxy": "vLLM behind nemoflow's proxy", "vllm": "vLLM's own port", "builtin": "built-in engine"}
    lines = [
        "",
        f"Serving ({r.get('workload')}; vLLM started to ready in {_fmt(r.get('vllm_start_to_ready_s'), ' s')}, the "
        f"seed's request through the proxy in {', '.join(f'{t:.2f} s' for t in r.get('seed_request_s') or []) or 'not run'}):",
        "",
        "| engine | concurrency | requests (failed) | output tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, rows in levels.items():
        lines += [_level_row(names.get(label, label), c, row) for c, row in rows.items()]
    for c, rounds in (r.get("paired") or {}).items():
        for i, pair in enumerate(rounds):
            round_name = f"paired round {i + 1} (overlap {_fmt(pair.get('overlap'))})"
            lines += [
                _level_row(f"{names[label]}, {round_name}", c, pair.get(label) or {}) for label in ("proxy", "vllm")
            ]
    restart = r.get("vllm_restart")
    if restart and restart.get("error"):
        lines.append(
            "\nvLLM's start on a new checkpoint directory of the same shape (the nightly refresh's) **failed**: "
            + _cell(restart["error"].strip().splitlines()[-1] if restart["error"].strip() else "no message")
        )
    elif restart:
        first = r.get("vllm_start") or {}
        lines.append(
            f"\nvLLM's start on a new checkpoint directory of the same shape (the nightly refresh's; after the first "
            f"server stopped, served from the stable path it freed, `{restart.get('model_path')}`): ready in "
            f"{_fmt(restart.get('start_to_ready_s'), ' s')} (the first start: "
            f"{_fmt(r.get('vllm_start_to_ready_s'), ' s')}), compile cache {restart.get('compile_cache')} "
            f"({restart.get('graphs_loaded')} graphs loaded, {restart.get('graphs_compiled')} compiled; the first "
            f"start: {first.get('compile_cache', 'not read')}), torch.compile "
            f"{_fmt(restart.get('torch_compile_s'), ' s')} (first {_fmt(first.get('torch_compile_s'), ' s')}), "
            f"engine init {_fmt(restart.get('engine_init_s'), ' s')} (first {_fmt(first.get('engine_init_s'), ' s')}), "
            f"the seed's request {_fmt(restart.get('seed_request_s'), ' s')}."
        )
    for c, cost in (r.get("proxy_cost") or {}).items():
        how = (
            f"both paths at once on one engine, the median of {len(cost.get('rounds', []))} rounds"
            if cost.get("method") == "paired"
            else "the two paths' levels one after the other"
        )
        lines.append(
            f"\nThe proxy's cost at concurrency {c} ({how}): {cost['output_tok_s_pct']} % of output tokens/s, "
            f"{cost.get('ttft_p50_pct')} % of TTFT p50."
        )
    return lines


def _level_row(name: str, concurrency: str, row: dict) -> str:
    """One `vllm bench serve` level as a row of the serving table (or the error its client ended with)."""
    if "error" in row:
        return f"| {name} | {concurrency} | error: {row['error'][:80]} | | | |"
    return (
        f"| {name} | {concurrency} | {row.get('completed')} ({row.get('failed', 0)}) | "
        f"{_fmt(row.get('output_throughput'))} | {_fmt(row.get('median_ttft_ms'))} / "
        f"{_fmt(row.get('p99_ttft_ms'))} | {_fmt(row.get('median_tpot_ms'))} / {_fmt(row.get('p99_tpot_ms'))} |"
    )


def _variants(result: dict):
    nemo = result.get("nemoflow") or {}
    if "tokens_per_s" in nemo or "error" in nemo:
        label = " (snapshots)" if nemo.get("snapshots") else ""
        if nemo.get("skip_while_writing"):
            skipped = nemo.get("skipped_saves", 0)
            label = f" (skip while writing: {skipped} of {skipped + nemo.get('checkpoints', 0)} saves skipped)"
        if nemo.get("replace_while_writing"):
            replaced = nemo.get("replaced_saves", 0)
            label = f" (replace while writing: {replaced} of {nemo.get('checkpoints', 0)} saves replaced)"
        yield label, nemo
        if result.get("nemoflow_no_saves"):
            yield " (no saves)", result["nemoflow_no_saves"]
    else:
        for impl, n in nemo.items():
            yield f" ({impl})", n or {}


def update_docs(report: dict, doc: Path = DOC) -> None:
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + render(report) + text[end:])


def docs_section(doc: Path = DOC) -> str:
    text = doc.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n") + "\n"


def memory_plan(bench_config: Path) -> dict:
    """The memory plan's estimate for a bench_train_gpu run (its run directory's bench.json, a TrainConfig), as
    tests/train/test_moe_plan.py compares it: the total less the reserve the allocator does not count."""
    sys.path.insert(0, str(REPO))
    from infra.configs.memory_plan import GIB, RESERVE_GIB, plan_memory
    from infra.configs.train import TrainConfig

    config = json.loads(bench_config.read_text())
    plan = plan_memory(TrainConfig(**config))
    shape = ("hidden_size", "num_layers", "seq_length", "micro_batch_size", "gpus_per_node", "precision")
    return {"estimate_gib": plan.total / GIB - RESERVE_GIB, "config": {k: config.get(k) for k in shape}}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "plan":
        print(json.dumps(memory_plan(Path(argv[1]))))
        return 0
    if len(argv) >= 3 and argv[0] == "collect":
        parts, out = Path(argv[1]), Path(argv[2])
        commit = argv[3] if len(argv) > 3 else "unknown"
        report = collect(parts, commit)
        out.mkdir(parents=True, exist_ok=True)
        (out / "acceptance.json").write_text(json.dumps(report, indent=1))
        (out / "acceptance.md").write_text(render(report))
        print(render(report))
        return 0
    if len(argv) >= 3 and argv[0] == "merge":
        try:
            report = merge([json.loads(Path(a).read_text()) for a in argv[2:]])
        except ValueError as exc:
            print(f"acceptance merge: {exc}", file=sys.stderr)
            return 2
        Path(argv[1]).write_text(json.dumps(report, indent=1))
        print(render(report), end="")
        return 0
    if len(argv) == 2 and argv[0] in ("docs", "render"):
        report = judge(json.loads(Path(argv[1]).read_text()))
        if argv[0] == "docs":
            update_docs(report)
        else:
            print(render(report), end="")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
