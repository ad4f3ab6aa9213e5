"""``nemoflow demo``: the whole pipeline on the embedded default, watched in the Prefect UI."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from nemoflow.commands import add_command

DESCRIPTION = """\
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
and reused; clients send it as `Authorization: Bearer KEY`."""


def pools() -> dict[str, tuple[str, str, str]]:
    """backend: (work pool, worker type, deployment), for every backend the demo runs on (infra/executors.py's
    ``Demo``)."""
    from infra.executors import EXECUTORS, demo_kinds

    return {
        kind: (EXECUTORS[kind].work_pool.name, EXECUTORS[kind].work_pool.worker_type, f"end-to-end/{kind}")
        for kind in demo_kinds()
    }


def endpoint_ports() -> dict[str, int]:
    """The endpoint's port per backend: each its own, so demos on two backends run side by side."""
    from infra.executors import EXECUTORS, demo_kinds

    return {kind: EXECUTORS[kind].demo.port for kind in demo_kinds()}


def __getattr__(name: str):
    # POOLS and ENDPOINT_PORTS as module constants, read from infra/executors.py when first used: importing it
    # at module level would cost every `nemoflow` command ~0.7 s.
    if name == "POOLS":
        return pools()
    if name == "ENDPOINT_PORTS":
        return endpoint_ports()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Where the demo keeps the endpoint key it generates for a backend whose server binds every interface.
ENDPOINT_KEY_FILE = "serve-api-key"
ENDPOINT_NAME = "nemoflow-demo"  # prefect.yaml's serve.model_name, the service's name on every backend
# Where each demo's endpoint lives, so `--down` finds it whatever the environment it runs in
# (the local service table is under the work dir: NEMOFLOW_WORK_DIR may differ between the two commands).
RECORD_FILE = "demo-endpoints.json"

AUTH_HELP = (
    "run the Prefect API with HTTP Basic authentication: the server gets PREFECT_SERVER_API_AUTH_STRING, "
    "workers and the CLI PREFECT_API_AUTH_STRING (yours if set, else one generated into "
    "~/.nemoflow/prefect/auth-string, mode 0600); the UI asks for it once"
)


def register(sub) -> None:
    parser = add_command(
        sub,
        "demo",
        "run end-to-end on this machine: Prefect server, work pool, deployment, worker, watched run",
        DESCRIPTION,
    )
    parser.defer(_options)  # the backends' names come from infra/executors.py, imported when `demo` runs
    parser.set_defaults(func=run)


def _options(parser) -> None:
    parser.add_argument(
        "--backend", choices=sorted(pools()), default="local", help="work pool to run on (default: local)"
    )
    parser.add_argument("--port", type=int, default=4200, help="port of the local Prefect server if one is started")
    parser.add_argument(
        "--down",
        action="store_true",
        help="cancel the demo's runs in progress (and their jobs), stop its worker, server and inference endpoint",
    )
    parser.add_argument(
        "--serve-port",
        type=int,
        default=None,
        help="port of the demo's inference endpoint (default: 8000 for --backend local, 8001 for --backend slurm, "
        "so both demos can run at once); a port already held stops the demo before anything starts, naming the holder",
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


def run_config(deployment: str, steps: int | None = None, serve_port: int | None = None) -> dict:
    """The deployment's own ``config`` parameter (prefect.yaml) with the demo's overrides: training cut to
    ``steps`` (validated and saved at the last step, as the 40-step demo is), the endpoint on ``serve_port``.
    Run parameters replace a deployment's whole ``config``, so the deployment's settings (the executor, the
    Slurm CPU counts) are carried over here."""
    import copy

    import yaml

    from devtools.prefect_local import REPO_ROOT

    flow, name = deployment.split("/")
    config: dict = {}
    for entry in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]:
        if entry["name"] == name and entry["entrypoint"].endswith(":" + flow.replace("-", "_")):
            config = copy.deepcopy((entry.get("parameters") or {}).get("config") or {})
    if steps is not None:
        train = config.setdefault("train", {})
        train.update(max_steps=steps, ckpt_every_n_steps=steps, val_check_interval=min(20, steps))
    if serve_port is not None:
        config.setdefault("serve", {})["port"] = serve_port
    return config


def demo_parameters(deployment: str, steps: int | None, gpus: int, serve_port: int | None = None) -> dict | None:
    """The ``--params`` of the demo's ``prefect deployment run``: none for the demo as deployed; else
    :func:`run_config` with, for ``gpus``, the GPU demo's training and serving (flows/end_to_end.py).
    tests/foundation/test_submitted_parameters.py checks every set against the deployment's schema as the
    Prefect server does."""
    if steps is None and not gpus and serve_port is None:
        return None
    config = run_config(deployment, steps, serve_port)
    if gpus:
        from flows.end_to_end import demo_gpu_config

        gpu = demo_gpu_config(gpus)
        config["train"] = {**config.get("train", {}), **gpu["train"]}
        config["serve"] = {**config.get("serve", {}), **gpu["serve"]}
    return {"config": config}


def deployed_serve_port(deployment: str) -> int:
    """The endpoint port the deployment's own config gives (ServeConfig's default when it gives none)."""
    from tasks.serve import DEFAULT_PORT

    return int(run_config(deployment).get("serve", {}).get("port", DEFAULT_PORT))


def check_endpoint_port(port: int, backend: str) -> None:
    """Refuse, in one line naming the holder and the fix, a port this demo's endpoint cannot bind.

    Checked before anything starts. A port held by this demo's own endpoint (same backend, same name)
    passes: the deploy stage reuses or replaces it. Raises ValueError."""
    import socket

    from infra.executors import as_executor

    if not 1 <= port <= 65535:
        raise ValueError(f"--serve-port {port}: a TCP port is between 1 and 65535")
    with socket.socket() as sock:
        # Where the backend's server binds (a cluster node's every interface, the local one loopback); probe
        # like uvicorn does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((as_executor(backend).backend().bind_host, port))
            return
        except OSError:
            pass
    from infra import processes

    owner = processes.port_owner(port)
    holder = _demo_endpoint_holding(port, owner)
    if holder is not None and holder[0] == backend:
        return
    if holder is not None:
        who = f"the {holder[0]} demo's inference server {holder[1]}"
        fix = "stop it with `nemoflow demo --down`"
    elif owner is not None:
        who = f"pid {owner} ({_command_line(owner)})"
        fix = "stop that process"
    else:
        who = "a process this user cannot see"
        fix = "free the port"
    other = _free_port_near(port)
    raise ValueError(
        f"port {port}, where this demo's endpoint would listen, is held by {who}: {fix}, "
        f"or serve elsewhere: `nemoflow demo --backend {backend} --serve-port {other}`"
    )


def _demo_endpoint_holding(port: int, owner: int | None) -> tuple[str, str] | None:
    """(backend, description) of a demo endpoint that serves on ``port``, if one does."""
    from infra.executors import as_executor

    for kind, work_dir in _endpoint_places(read_records()):
        executor = as_executor(kind)
        if not executor.available_here():
            continue
        with _work_dir(work_dir), contextlib.suppress(Exception):
            found = executor.find_service(ENDPOINT_NAME, port, owner)
            if found is not None:
                return kind, found
    return None


def _endpoint_places(records: list[dict]) -> list[tuple[str, str]]:
    """(backend, work dir) pairs where this home's demo endpoints may be: each recorded demo's backend in its
    recorded work dirs and this shell's (every demo backend when nothing is recorded: a demo from before
    endpoints were recorded)."""
    from infra.executors import demo_kinds
    from infra.settings import get_settings

    recorded = [(r.get("backend"), r.get("work_dir")) for r in records if r.get("backend") in endpoint_ports()]
    kinds = dict.fromkeys(kind for kind, _ in recorded) or dict.fromkeys(demo_kinds())
    here = get_settings().work_dir
    return list(dict.fromkeys([*recorded, *((kind, here) for kind in kinds)]))


def _command_line(pid: int) -> str:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return "command unknown"
    line = " ".join(a.decode(errors="replace") for a in argv if a)
    return line[:80] + ("..." if len(line) > 80 else "")


def _free_port_near(port: int) -> int:
    import socket

    for candidate in range(port + 1, port + 100):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", candidate))
                return candidate
            except OSError:
                continue
    return port + 1


# ---------------------------------------------------------------- where the demo's endpoints are


def _record_path():
    from devtools import prefect_local as pl

    return pl.state_dir() / RECORD_FILE


def read_records() -> list[dict]:
    """The demo endpoints recorded under ``$NEMOFLOW_HOME/prefect`` (newest last)."""
    import json

    path = _record_path()
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def record_endpoint(backend: str, port: int) -> None:
    """Record where this demo's endpoint will live (backend, work dir of its service table, port), before the
    run starts: ``--down`` then finds it even from a shell with another NEMOFLOW_WORK_DIR, or none."""
    import json

    from infra.settings import get_settings

    entry = {"backend": backend, "work_dir": get_settings().work_dir, "port": port}
    records = [r for r in read_records() if r != entry] + [entry]
    path = _record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(path)  # never half-written


@contextlib.contextmanager
def _work_dir(work_dir: str | None):
    """Settings (and so the local service table) of ``work_dir`` inside the block."""
    from infra.settings import reload_settings

    if work_dir is None:
        yield
        return
    old = os.environ.get("NEMOFLOW_WORK_DIR")
    os.environ["NEMOFLOW_WORK_DIR"] = work_dir
    reload_settings()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NEMOFLOW_WORK_DIR", None)
        else:
            os.environ["NEMOFLOW_WORK_DIR"] = old
        reload_settings()


class Background:
    """``fn(*args, **kwargs)`` in a daemon thread (a process that exits first does not wait for it); ``result()``
    waits for it and returns its value or raises its exception."""

    def __init__(self, fn, *args, **kwargs):
        import threading

        self._outcome: tuple[bool, object] | None = None

        def work() -> None:
            try:
                self._outcome = (True, fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
                self._outcome = (False, exc)

        self._thread = threading.Thread(target=work, name=getattr(fn, "__name__", "background"), daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class ControlPlaneClock:
    """The control plane's seconds step by step, for the demo's last line (where a cold start's time goes: the GPU
    node's first demo spent 25 s before its flow run at e5b86ee, against 7-8 s on a second start)."""

    def __init__(self, started: float):
        self.last = started
        self.steps: dict[str, float] = {}

    def mark(self, step: str) -> None:
        """The time since the last mark is ``step``'s (a step marked twice adds up)."""
        now = time.monotonic()
        self.steps[step] = self.steps.get(step, 0.0) + now - self.last
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.steps.items())


def demo_gpus(choice: str, backend: str) -> int:
    """How many GPUs the demo trains on: ``auto`` = every GPU torch can use on this machine (0 without an NVIDIA
    GPU); a number is checked. GPUs the driver lists but torch cannot use stop the demo with the fix
    (infra/gpus.py), rather than a CPU demo on a GPU machine."""
    from infra import gpus
    from infra.executors import EXECUTORS, as_executor, demo_kinds

    if choice != "auto" and not choice.isdigit():
        raise ValueError(f"--gpus {choice!r}: give auto, 0 or a number of GPUs")
    if not as_executor(backend).on_this_machine:  # its jobs run elsewhere: the demo's CPU configuration
        if choice not in ("auto", "0"):
            here = " or ".join(kind for kind in demo_kinds() if EXECUTORS[kind].on_this_machine)
            raise ValueError(f"--gpus {choice} is for --backend {here} (the {backend} demo runs its CPU configuration)")
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


def _stop_endpoint() -> list[str]:
    """Stop the demo endpoints recorded by ``nemoflow demo`` (and those of this shell's work dir); one line per
    endpoint it could not stop. Names of the problems (empty when all is stopped)."""
    from infra import processes
    from infra.executors import as_executor

    records = read_records()
    problems: list[str] = []
    ports: set[int] = set()
    for kind, work_dir in _endpoint_places(records):
        executor = as_executor(kind)
        if not executor.available_here():
            continue
        with _work_dir(work_dir):
            try:
                stopped, failed, served = executor.stop_services(ENDPOINT_NAME)
            except Exception as exc:  # noqa: BLE001 - no cluster running: nothing to stop
                print(f"note: could not reach the {kind} backend to stop {ENDPOINT_NAME}: {exc}", file=sys.stderr)
                continue
        for line in stopped:
            print(line)
        problems += failed
        ports |= served
    # Whatever still serves on the port of an endpoint on this machine is named, not left unsaid.
    ports |= {
        int(r["port"])
        for r in records
        if r.get("backend") in endpoint_ports()
        and as_executor(r["backend"]).on_this_machine
        and str(r.get("port", "")).isdigit()
    }
    for port in sorted(ports):
        owner = processes.port_owner(port)
        if owner is not None:
            problems.append(f"port {port} is still served by pid {owner} ({_command_line(owner)})")
    for problem in problems:
        print(f"not stopped: {problem}", file=sys.stderr)
    if not problems:
        with contextlib.suppress(OSError):
            _record_path().unlink()
    return problems


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
    from infra.executors import as_executor
    from infra.settings import get_settings

    if args.down:
        try:
            pl.cancel_active_runs()
        except Exception as exc:  # noqa: BLE001 - the server may be unreachable: stop what we can
            print(f"note: could not cancel the runs in progress: {exc}", file=sys.stderr)
        problems = _stop_endpoint()
        if not pl.stop_all():
            print("nothing to stop")
        return 1 if problems else 0

    started = time.monotonic()
    plane = ControlPlaneClock(started)
    pool, worker_type, deployment = pools()[args.backend]
    # The Prefect server starts (or is found) while the GPUs are probed (torch in a subprocess: seconds on a GPU
    # node) and the arguments checked; a demo refused for its arguments leaves it running, as a finished one does.
    server = Background(pl.ensure_server, args.port, auth=args.auth)
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
    serve_port = args.serve_port or endpoint_ports()[args.backend]
    try:
        check_endpoint_port(serve_port, args.backend)
    except ValueError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    override_port = serve_port if serve_port != deployed_serve_port(deployment) else None
    if steps is not None:
        print(f"a shorter demo: {steps} training steps instead of {DEMO_STEPS}")
    if n_gpus:
        from infra import gpus

        names = gpus.probe().names
        print(f"GPU demo: {n_gpus} x {names[0]} (a 0.25B Llama; --gpus 0 for the CPU demo)")
    run_parameters = demo_parameters(deployment, steps, n_gpus, override_port)
    if run_parameters is not None:
        import json

        params = ["--params", json.dumps(run_parameters)]
    record_endpoint(args.backend, serve_port)
    executor = as_executor(args.backend)
    plane.mark("checks and GPU probe")
    if executor.demo.setup:  # the backend on this machine (the one-machine Slurm)
        subprocess.run([sys.executable, "-m", "nemoflow.cli", *executor.demo.setup], check=True)
        plane.mark("backend setup")
    try:
        api = server.result()
    except pl.ControlPlaneError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    plane.mark("Prefect server")
    pl.record_in_profile(api)
    os.environ.update(api.client_env())
    pl.ensure_pools(api)
    pl.ensure_zombie_automation(api)
    plane.mark("work pools and automation")
    # A server bound beyond loopback (a cluster node's) refuses to start without a key (tasks/serve.py)
    from tasks.serve import LOOPBACK

    public = executor.backend().bind_host not in LOOPBACK
    worker_env, key_where, key_shell = endpoint_key() if public else ({}, None, None)
    pl.ensure_worker(pool, worker_type, api, extra_env=worker_env)  # its start overlaps the deploy
    pending = pl.deploy_if_changed(api, first=deployment)
    if pending is None:
        print("prefect.yaml is already deployed (unchanged)")
    plane.mark("worker and deployment")
    ready = time.monotonic() - started  # the control plane (server, pools, deployments, worker) is up

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
    deployed = pending is None or pending.wait()  # the rest of prefect.yaml, deployed beside the run
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
    print(
        f"total:       {elapsed:.0f} s (control plane {ready:.0f} s: {plane}; then the flow run {elapsed - ready:.0f} s)"
    )
    print("stop everything with: nemoflow demo --down")
    return 0 if deployed else 1
