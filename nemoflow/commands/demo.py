"""``nemoflow demo``: the whole pipeline on the embedded default, watched in the Prefect UI."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

POOLS = {
    # backend: (work pool, worker type, deployment)
    "local": ("local", "process", "end-to-end/local"),
    "slurm": ("gpu-cluster", "slurm", "end-to-end/slurm"),
}


# Where `demo --backend slurm` keeps the endpoint key it generates (the server binds every interface there).
ENDPOINT_KEY_FILE = "serve-api-key"

AUTH_HELP = (
    "run the Prefect API with HTTP Basic authentication: the server gets PREFECT_SERVER_API_AUTH_STRING, "
    "workers and the CLI PREFECT_API_AUTH_STRING (yours if set, else one generated into "
    "~/.nemoflow/prefect/auth-string, mode 0600); the UI asks for it once"
)


def register(sub) -> None:
    parser = sub.add_parser(
        "demo",
        help="run end-to-end on this machine: Prefect server, work pool, deployment, worker, watched run",
        description="""\
Run the whole lifecycle on the embedded default and watch it:
  1. reuse the Prefect API at PREFECT_API_URL, or start a local Prefect server, and record
     its URL in the active Prefect profile (so `prefect ...` works in any shell);
  2. create the work pool and `prefect --no-prompt deploy` the deployment from prefect.yaml;
  3. start a worker for the pool (in the background; `--down` stops it); its flow runs send
     heartbeats, and an automation marks a run Crashed when they stop (its process died), which
     frees its concurrency slots;
  4. `prefect deployment run end-to-end/<pool> --watch`;
  5. print the run's UI link, the dataset and checkpoint URIs and the smoke-test answer
     (or, when the run fails, each failed stage with its one-line cause).
The inference server stays up after the run (`nemoflow serve stop nemoflow-demo`, or `--down`).
A second run with nothing changed finishes with every stage Cached.

On a machine with NVIDIA GPUs (--gpus auto, the default) the local demo trains a 0.25B-parameter
Llama on all of them (torchrun, bf16-mixed, each layer compiled), validates on one and serves on
one (the built-in engine on the GPU; vLLM where it is installed): the run's parameters say so in
the UI. --gpus 0 runs the CPU demo anyway; --gpus N asks for N (refused in one line, before
anything starts, when this machine cannot give them). GPUs the driver lists but torch cannot use
(a CPU build of torch, a CUDA build newer than the driver) stop the demo with the fix.

--backend slurm serves from a Slurm node, bound to every interface, so the endpoint needs an API
key: NEMOFLOW_SERVE_API_KEY if set, else one generated into ~/.nemoflow/serve-api-key (mode 0600)
and reused; clients send it as `Authorization: Bearer KEY`.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend", choices=sorted(POOLS), default="local", help="work pool to run on (default: local)"
    )
    parser.add_argument("--port", type=int, default=4200, help="port of the local Prefect server if one is started")
    parser.add_argument(
        "--down",
        action="store_true",
        help="cancel the demo's runs in progress (and their jobs), stop its worker, server and inference endpoint",
    )
    parser.add_argument("--auth", action="store_true", help=AUTH_HELP)
    parser.add_argument(
        "--gpus",
        default="auto",
        help="local backend: auto (default) = every GPU torch can use here, else the CPU demo; 0 = the CPU demo; "
        "N = N GPUs (refused when this machine has fewer)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"CPU demo: train N steps instead of {DEMO_STEPS} (a quicker look at the pipeline; the model learns "
        f"less, 20 still passes the validation gate); default ${STEPS_ENV} if set",
    )
    parser.set_defaults(func=run)


DEMO_STEPS = 40  # flows/end_to_end.py:demo_train_config
STEPS_ENV = "NEMOFLOW_DEMO_STEPS"


def demo_steps(choice: int | None) -> int | None:
    """--steps, else NEMOFLOW_DEMO_STEPS, else None (the demo's own 40)."""
    raw = choice if choice is not None else os.environ.get(STEPS_ENV, "").strip() or None
    if raw is None:
        return None
    try:
        steps = int(raw)
    except ValueError:
        raise ValueError(f"{STEPS_ENV}={raw!r} is not a whole number of steps") from None
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    return steps


def deployment_config(deployment: str) -> dict:
    """The deployment's own ``config`` parameter in prefect.yaml (empty when it sets none)."""
    import copy

    import yaml

    from devtools.prefect_local import REPO_ROOT

    flow, name = deployment.split("/")
    for entry in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]:
        if entry["name"] == name and entry["entrypoint"].endswith(":" + flow.replace("-", "_")):
            return copy.deepcopy((entry.get("parameters") or {}).get("config") or {})
    return {}


def demo_parameters(deployment: str, steps: int | None, gpus: int) -> dict | None:
    """The ``--params`` of the demo's ``prefect deployment run``: none for the demo as deployed; else the
    deployment's own ``config`` (run parameters replace a deployment's whole ``config``, so its settings, the
    executor and the Slurm CPU counts, are carried over) with training cut to ``steps`` (validated and saved at
    the last step, as the 40-step demo is) or the GPU demo's training and serving on ``gpus`` GPUs.
    tests/foundation/test_submitted_parameters.py checks every set against the deployment's schema as the
    Prefect server does."""
    if steps is None and not gpus:
        return None
    config = deployment_config(deployment)
    if gpus:
        from flows.end_to_end import demo_gpu_config

        config.update(demo_gpu_config(gpus))
    if steps is not None:
        train = config.setdefault("train", {})
        train.update(max_steps=steps, ckpt_every_n_steps=steps, val_check_interval=min(20, steps))
    return {"config": config}


def demo_gpus(choice: str, backend: str) -> int:
    """How many GPUs the demo trains on: ``auto`` = every GPU torch can use on this machine (0 without an NVIDIA
    GPU); a number is checked. GPUs the driver lists but torch cannot use stop the demo with the fix
    (infra/gpus.py), rather than a CPU demo on a GPU machine."""
    from infra import gpus

    if choice != "auto" and not choice.isdigit():
        raise ValueError(f"--gpus {choice!r}: give auto, 0 or a number of GPUs")
    if backend != "local":
        if choice not in ("auto", "0"):
            raise ValueError(f"--gpus {choice} is for --backend local (the Slurm demo runs its CPU configuration)")
        return 0
    if choice == "0":
        return 0
    machine = gpus.probe()
    if choice == "auto":
        if not machine.names:
            return 0
        gpus.check_request(1, machine, what="the GPU demo (--gpus auto)")
        return machine.usable
    gpus.check_request(int(choice), machine, what=f"the GPU demo (--gpus {choice})")
    return int(choice)


def training_speed(checkpoint: str) -> str | None:
    """One line from the run's metrics.jsonl: steps, median tokens/s (and MFU, peak GPU memory on GPUs)."""
    import json
    import statistics
    from pathlib import Path

    try:
        metrics_path = Path(checkpoint).parents[3] / "metrics.jsonl"
        steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if '"loss"' in line]
    except (OSError, IndexError, ValueError):
        return None
    if not steps:
        return None
    later = steps[1:] or steps  # the first logged window holds compilation and start-up
    line = f"{steps[-1]['step']} steps, {statistics.median(m['tokens_per_s'] for m in later):,.0f} tokens/s"
    if any("mfu" in m for m in later):
        line += f", MFU {statistics.median(m['mfu'] for m in later if 'mfu' in m):.1%}"
    if any("peak_mem_gib" in m for m in later):
        line += f", peak GPU memory {max(m.get('peak_mem_gib', 0) for m in later):.1f} GiB"
    return line


def _stop_endpoint() -> None:
    try:
        from infra import services

        for handle in services.list_services():
            if handle.name.startswith("nemoflow-demo"):
                services.stop_service(handle.name)
                print(f"stopped the inference server {handle.name}")
    except Exception as exc:  # noqa: BLE001 - the endpoint may already be gone
        print(f"note: could not stop the inference server: {exc}", file=sys.stderr)
    import shutil

    if shutil.which("scancel"):  # `demo --backend slurm` serves from a Slurm job
        try:
            from infra.executors import get_backend

            if get_backend("slurm").stop_service("nemoflow-demo"):
                print("cancelled the inference server's Slurm job nemoflow-demo")
        except Exception as exc:  # noqa: BLE001 - no cluster running: nothing to stop
            print(f"note: could not reach Slurm to stop nemoflow-demo: {exc}", file=sys.stderr)


def endpoint_key(echo=print) -> tuple[dict[str, str], str, str]:
    """The endpoint key for a server on a cluster node: (environment for the worker, where it is kept,
    the shell expression that gives it).

    The user's NEMOFLOW_SERVE_API_KEY when set; else one generated once into
    ``$NEMOFLOW_HOME/serve-api-key`` (mode 0600, like ``--auth``'s Prefect auth string) and reused.
    It reaches the flow run through the worker's environment (sbatch's, for a Slurm flow run),
    the server job by name, and the smoke test from the flow run's settings; never argv or a log.
    """
    import secrets
    from pathlib import Path

    from devtools import prefect_local as pl
    from infra.settings import DEFAULT_HOME, SERVE_API_KEY_ENV, get_settings, reload_settings

    configured = get_settings().serve_api_key
    if configured is not None and configured.get_secret_value().strip():
        return (
            {SERVE_API_KEY_ENV: configured.get_secret_value()},
            f"{SERVE_API_KEY_ENV} (yours)",
            f"${SERVE_API_KEY_ENV}",
        )
    path = Path(os.environ.get("NEMOFLOW_HOME", DEFAULT_HOME)) / ENDPOINT_KEY_FILE
    new = not path.exists()
    key = pl.secret_file(path, lambda: "nf-" + secrets.token_hex(24)).get_secret_value()
    if new:
        echo(f"generated an API key for the endpoint into {path} (mode 0600; set {SERVE_API_KEY_ENV} to use yours)")
    os.environ[SERVE_API_KEY_ENV] = key
    reload_settings()
    return {SERVE_API_KEY_ENV: key}, f"{_display(str(path))} (mode 0600)", f"$(cat {_display(str(path))})"


def _display(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home) :] if path.startswith(home + os.sep) else path


def run(args) -> int:
    from devtools import prefect_local as pl
    from infra.settings import get_settings

    if args.down:
        try:
            pl.cancel_active_runs()
        except Exception as exc:  # noqa: BLE001 - the server may be unreachable: stop what we can
            print(f"note: could not cancel the runs in progress: {exc}", file=sys.stderr)
        _stop_endpoint()
        if not pl.stop_all():
            print("nothing to stop")
        return 0

    started = time.monotonic()
    pool, worker_type, deployment = POOLS[args.backend]
    try:
        n_gpus = demo_gpus(str(args.gpus), args.backend)
    except ValueError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    params: list[str] = []
    try:
        steps = demo_steps(args.steps)
    except ValueError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    if steps is not None and n_gpus:
        from nemoflow.cli import UserError

        raise UserError("--steps is for the CPU demo (the GPU demo trains on a token budget): add --gpus 0")
    if steps is not None:
        print(f"a shorter demo: {steps} training steps instead of {DEMO_STEPS}")
    if n_gpus:
        from infra import gpus

        names = gpus.probe().names
        print(f"GPU demo: {n_gpus} x {names[0]} (a 0.25B Llama; --gpus 0 for the CPU demo)")
    run_parameters = demo_parameters(deployment, steps, n_gpus)
    if run_parameters is not None:
        import json

        params = ["--params", json.dumps(run_parameters)]
    if args.backend == "slurm":
        subprocess.run([sys.executable, "-m", "nemoflow.cli", "local-slurm", "up"], check=True)
    try:
        api = pl.ensure_server(args.port, auth=args.auth)
    except pl.ControlPlaneError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    pl.record_in_profile(api)
    os.environ.update(api.client_env())
    pl.ensure_pools(api)
    pl.ensure_zombie_automation(api)
    if not pl.deploy_if_changed(api):
        print("prefect.yaml is already deployed (unchanged)")
    worker_env, key_where, key_shell = endpoint_key() if args.backend == "slurm" else ({}, None, None)
    pl.ensure_worker(pool, worker_type, api, extra_env=worker_env)

    print(
        f"$ prefect deployment run {deployment} --watch"
        + ((" --params '{\"config\": <the GPU demo>}'" if n_gpus else f" --params '{params[1]}'") if params else "")
    )
    flow_run_id, code = pl.run_deployment(
        api,
        deployment,
        params,
        on_run=lambda run_id: print(f"\n  watch it in the UI: {pl.ui_url(api, run_id)}\n"),
    )
    elapsed = time.monotonic() - started
    if flow_run_id is None:
        print("could not start the deployment run", file=sys.stderr)
        return code or 1
    print()
    print(f"flow run:    {pl.ui_url(api, flow_run_id)}")
    summary_uri = os.path.join(get_settings().work_dir, "flow-runs", f"{flow_run_id}.json")
    if code != 0 or not os.path.exists(summary_uri):
        print(f"the run did not complete (exit {code})")
        try:
            for cause in pl.failure_causes(api, flow_run_id):
                print(f"failed:      {cause}")
        except Exception as exc:  # noqa: BLE001 - the API may be gone; the page and the log still say why
            print(f"(could not read the failed stages from the Prefect API: {exc})")
        print(
            f"details:     {pl.ui_url(api, flow_run_id)} (logs of each stage); worker log {pl.log_path('worker-' + pool)}"
        )
        return code or 1
    import json

    summary = json.loads(open(summary_uri).read())
    print(f"dataset:     {summary['dataset']}")
    print(f"checkpoint:  {summary['checkpoint']}  (val loss {summary['val_loss']:.3f})")
    speed = training_speed(summary["checkpoint"])
    if speed:
        print(f"training:    {speed}")
    print(f"endpoint:    {summary['endpoint']}  (model {summary['model']})")
    if key_where is not None:
        print(f"api key:     {key_where}; every request sends it:")
        print(f'             curl -H "Authorization: Bearer {key_shell}" {summary["endpoint"]}/v1/models')
    answer = summary["answer"]
    more = f" ... ({len(answer)} characters: the whole answer is in the run's smoke-test artifact)"
    print(f"smoke test:  {summary['prompt']!r} -> {answer[:160]!r}{more if len(answer) > 160 else ''}")
    print(f"total:       {elapsed:.0f} s")
    print("stop everything with: nemoflow demo --down")
    return 0
