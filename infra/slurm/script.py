"""Render the sbatch script for a job from ONE template (templates/batch.sh.j2).

The launch line depends on :attr:`SbatchRequest.launcher`:

- ``direct``: the command itself (one task on one node);
- ``srun``: ``srun`` runs it once per task, inside the pyxis container when
  ``JobSpec.container_image`` is set (``--container-image`` is a ``.sqsh`` on
  shared storage or a registry reference pyxis imports);
- ``torchrun``: ``srun`` starts one ``torch.distributed.run`` per node with a
  c10d rendezvous at ``$MASTER_ADDR:$MASTER_PORT`` (the first node of the
  allocation), ``--nnodes=$SLURM_NNODES`` and ``--nproc-per-node`` = the job's
  ``nproc_per_node`` (else GPUs per node, or tasks per node on CPU).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from pathlib import Path

import jinja2

from infra.jobs import ARRAY_INDEX_ENV, JobSpec
from infra.slurm.options import SbatchRequest

TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    return env


def container_flags(spec: JobSpec, extra_mounts: list[str] | None = None) -> list[str]:
    """pyxis flags for ``srun``; empty without ``container_image``."""
    if not spec.container_image:
        return []
    flags = [f"--container-image={spec.container_image}"]
    mounts = [f"{m.source}:{m.target}" + (":ro" if m.read_only else "") for m in spec.mounts]
    mounts += list(extra_mounts or [])
    if mounts:
        flags.append("--container-mounts=" + ",".join(mounts))
    if spec.workdir:
        flags.append(f"--container-workdir={spec.workdir}")
    # The job's environment (incl. secrets from sbatch's env) passes into the container.
    flags.append("--no-container-mount-home")
    return flags


def launch_line(spec: JobSpec, req: SbatchRequest, extra_mounts: list[str] | None = None) -> str:
    command = list(spec.command)
    if req.launcher == "direct":
        return shlex.join(command)
    srun = ["srun", "--kill-on-bad-exit=1"] + container_flags(spec, extra_mounts)
    if req.launcher == "torchrun":
        nproc = req.nproc_per_node or req.gpus_per_node or req.ntasks_per_node
        srun += ["--ntasks-per-node=1", f"--nodes={req.nodes}"]
        rendezvous = [
            "-m",
            "torch.distributed.run",
            "--nnodes=$SLURM_NNODES",
            f"--nproc-per-node={nproc}",
            "--rdzv-id=$SLURM_JOB_ID",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
        ]
        # `python -m pkg args` -> `python -m torch.distributed.run ... -m pkg args`
        python, rest = command[0], command[1:]
        inner = shlex.join(srun + [python]) + " " + " ".join(rendezvous) + " " + shlex.join(rest)
        return inner
    return shlex.join(srun + command)


def render_batch_script(spec: JobSpec, req: SbatchRequest, extra_mounts: list[str] | None = None) -> str:
    """The complete sbatch script text. Pure: no secrets, no environment lookups."""
    forward = None
    if req.signal and req.signal.upper().startswith("B:"):
        forward = req.signal.split(":", 1)[1].split("@", 1)[0]
    return (
        _env()
        .get_template("batch.sh.j2")
        .render(
            r=req,
            workdir=spec.workdir if not spec.container_image else None,
            array_env=ARRAY_INDEX_ENV,
            launch=launch_line(spec, req, extra_mounts),
            forward_signal=forward,
        )
    )
