"""``nemoflow render``: write what a run would submit (manifests, sbatch scripts), for review and kubectl."""

from __future__ import annotations

import os
import sys

from nemoflow.commands import add_command

DESCRIPTION = """\
Write every object an end-to-end run would submit, built by the stages' own job
builders and rendered by the executor's backend, without submitting anything:

  kubernetes  one YAML file per object, <kind>-<name>.yaml, plus the workspace PVC
              (apply it once): kubectl apply -f DIR
  slurm       one sbatch script per job, <name>.sbatch
  local       one shell script per job, <name>.sh

  nemoflow render --backend k8s --out manifests/
  nemoflow render --config run.yaml --out manifests/

--config FILE (YAML) is an end-to-end configuration, the same one the flow takes
(`executor: {kind: k8s, namespace: llm, ...}`, `image: {source: ...}`, `data:`,
`train:`, `serve:`); NEMOFLOW_K8S_* / NEMOFLOW_SLURM_* fill executor options it
leaves out. Secrets are referenced by name (secretKeyRef, sbatch's environment),
never written. The blend weights and the run directory come from the prepared
dataset when it exists (render after prepare-dataset for exact paths).

On Kubernetes every path is on the workspace PVC (mounted at /nemo-workspace): when
NEMOFLOW_WORK_DIR is left at its default (~/.nemoflow/work, which pods cannot see), the
objects are rendered for NEMOFLOW_WORK_DIR=/nemo-workspace/nemoflow, the work dir of
prefect.yaml's k8s deployments; a work dir you set outside the PVC is an error naming it."""


def register(sub) -> None:
    parser = add_command(
        sub, "render", "write the manifests / sbatch scripts a run would submit (kubectl apply -f DIR)", DESCRIPTION
    )
    parser.defer(_options)  # the backends' names come from infra/executors.py, imported when `render` runs
    parser.set_defaults(func=run)


# What `render` renders for when neither --backend nor the config names an executor.
DEFAULT_KIND = "k8s"


def _options(parser) -> None:
    from infra.executors import EXECUTORS

    kinds = [DEFAULT_KIND, *(kind for kind in EXECUTORS if kind != DEFAULT_KIND)]
    parser.add_argument(
        "--backend",
        choices=kinds,
        default=None,
        help=f"the executor kind to render for (default: the config's executor, else {DEFAULT_KIND})",
    )
    parser.add_argument("--out", required=True, help="directory to write the files into (created)")
    parser.add_argument("--config", help="YAML file: an end-to-end configuration (see above)")


def load_config(path: str | None) -> dict:
    """The YAML mapping in ``path`` ({} without one); one-line errors for unreadable or invalid files."""
    from infra.k8s.render import load_yaml_config

    return load_yaml_config(path, what="--config")


def build_config(data: dict, backend: str | None):
    """The EndToEndConfig of the file, with ``--backend`` choosing the executor kind."""
    from pydantic import ValidationError

    from flows.end_to_end import EndToEndConfig

    data = dict(data)
    executor = data.get("executor")
    if isinstance(executor, str):
        executor = {"kind": executor}
    executor = dict(executor or {})
    if backend:
        if executor.get("kind") not in (None, backend):
            raise ValueError(f"--backend {backend} but the config's executor is {executor['kind']!r}")
        executor["kind"] = backend
    executor.setdefault("kind", DEFAULT_KIND)
    data["executor"] = executor
    try:
        return EndToEndConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ValueError(f"{where}: {first['msg']}") from None


def write_files(files: dict[str, str], out_dir: str) -> list[str]:
    from infra import storage

    try:
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for name, text in files.items():
            path = os.path.join(out_dir, name)
            with storage.atomic_open(path, "w") as fh:
                fh.write(text)
            written.append(path)
    except OSError as exc:
        raise PermissionError(f"cannot write to --out {out_dir}: {exc.strerror or exc}") from None
    return written


def render_run(config) -> dict[str, str]:
    """File name -> text for every job and service of the run (plus the workspace PVC on Kubernetes)."""
    from flows.plan import planned_specs
    from infra.executors import get_backend

    backend = get_backend(config.executor)
    files: dict[str, str] = dict(config.executor.render_setup())  # e.g. the workspace PVC on Kubernetes
    for _, spec in planned_specs(config):
        for name, text in backend.render(spec).items():
            if name in files:
                raise ValueError(f"two objects would be written to {name}")
            files[name] = text
    return files


def render_work_dir(config) -> str | None:
    """The work dir to render the run with, when the executor's jobs cannot see the configured one
    (:meth:`infra.executors.ExecutorBase.render_work_dir`: on Kubernetes, a path outside the workspace PVC)."""
    from infra.settings import get_settings

    settings = get_settings()
    return config.executor.render_work_dir(settings.work_dir, "work_dir" in settings.model_fields_set)


def run(args) -> int:
    data = load_config(args.config)
    config = build_config(data, args.backend)
    work_dir = render_work_dir(config)
    if work_dir is not None:
        from infra.settings import reload_settings

        os.environ["NEMOFLOW_WORK_DIR"] = work_dir
        reload_settings()
        config = build_config(data, args.backend)  # paths derived from the work dir follow it
        print(
            f"rendering for NEMOFLOW_WORK_DIR={work_dir}, the k8s deployments' work dir on the workspace PVC "
            "(the default ~/.nemoflow/work is not visible to pods; set NEMOFLOW_WORK_DIR to choose another)",
            file=sys.stderr,
        )
    files = render_run(config)
    plan = config.train.memory_plan(config.executor)  # the training layout's memory per GPU, where it has one
    if plan:
        files["train-memory-plan.txt"] = plan
        print(plan, file=sys.stderr)
    written = write_files(files, args.out)
    for path in written:
        relative = os.path.relpath(path)
        print(path if relative.startswith("..") else relative)
    how = config.executor.apply_hint(args.out)
    print(f"{len(written)} files in {args.out}; review, then: {how}", file=sys.stderr)
    return 0
