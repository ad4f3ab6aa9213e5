"""``nemoflow demo``: the whole pipeline on the embedded default, watched in the Prefect UI."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

POOLS = {
    # backend: (work pool, worker type, deployment)
    "local": ("local", "process", "end-to-end/local"),
    "slurm": ("gpu-cluster", "slurm", "end-to-end/slurm"),
}


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
  5. print the run's UI link, the dataset and checkpoint URIs and the smoke-test answer.
The inference server stays up after the run (`nemoflow serve stop nemoflow-demo`, or `--down`).
A second run with nothing changed finishes with every stage Cached.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend", choices=sorted(POOLS), default="local", help="work pool to run on (default: local)"
    )
    parser.add_argument("--port", type=int, default=4200, help="port of the local Prefect server if one is started")
    parser.add_argument("--down", action="store_true", help="stop the demo's worker, server and inference endpoint")
    parser.add_argument("--auth", action="store_true", help=AUTH_HELP)
    parser.set_defaults(func=run)


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


def run(args) -> int:
    from devtools import prefect_local as pl
    from infra.settings import get_settings

    if args.down:
        _stop_endpoint()
        if not pl.stop_all():
            print("nothing to stop")
        return 0

    started = time.monotonic()
    pool, worker_type, deployment = POOLS[args.backend]
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
    pl.ensure_worker(pool, worker_type, api)

    print(f"$ prefect deployment run {deployment} --watch")
    proc = subprocess.Popen(
        [pl.prefect_bin(), "deployment", "run", deployment, "--watch", "--watch-interval", "1"],
        cwd=str(pl.REPO_ROOT),
        env=dict(os.environ, **api.client_env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    flow_run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="")
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", line)
        if match and flow_run_id is None:
            flow_run_id = match.group(1)
            print(f"\n  watch it in the UI: {pl.ui_url(api, flow_run_id)}\n")
    code = proc.wait()
    elapsed = time.monotonic() - started
    if flow_run_id is None:
        print("could not start the deployment run", file=sys.stderr)
        return code or 1
    print()
    print(f"flow run:    {pl.ui_url(api, flow_run_id)}")
    summary_uri = os.path.join(get_settings().work_dir, "flow-runs", f"{flow_run_id}.json")
    if code != 0 or not os.path.exists(summary_uri):
        print(f"the run did not complete (exit {code}); its page above shows which stage failed and why")
        print(f"worker log:  {pl.log_path('worker-' + pool)}")
        return code or 1
    import json

    summary = json.loads(open(summary_uri).read())
    print(f"dataset:     {summary['dataset']}")
    print(f"checkpoint:  {summary['checkpoint']}  (val loss {summary['val_loss']:.3f})")
    print(f"endpoint:    {summary['endpoint']}  (model {summary['model']})")
    answer = summary["answer"]
    more = f" ... ({len(answer)} characters: the whole answer is in the run's smoke-test artifact)"
    print(f"smoke test:  {summary['prompt']!r} -> {answer[:160]!r}{more if len(answer) > 160 else ''}")
    print(f"total:       {elapsed:.0f} s")
    print("stop everything with: nemoflow demo --down")
    return 0
