"""Check a job against the cluster before submitting it, with errors that say what to change.

sbatch's own messages are terse ("Invalid partition name specified") and some
bad requests only show up as a job pending forever. One ``sinfo`` call tells
us the partitions, their limits and their largest node, which is enough to
reject most mistakes with an actionable message.
"""

from __future__ import annotations

import os

from infra.jobs import JobSpec
from infra.slurm.commands import SlurmCLI
from infra.slurm.options import SbatchRequest
from infra.slurm.parsers import Partition, parse_memory_mb


class SlurmPreflightError(ValueError):
    """The request cannot run on this cluster; the message names the bad value and the limit."""


def _fmt_seconds(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{text}" if days else text


def check_request(req: SbatchRequest, spec: JobSpec, partitions: dict[str, Partition]) -> Partition:
    """Pure check of a merged request against sinfo's partitions; returns the partition used."""
    if not partitions:
        raise SlurmPreflightError("sinfo reports no partitions: is the Slurm controller configured?")
    if req.partition is None:
        defaults = [p for p in partitions.values() if p.default]
        if not defaults:
            raise SlurmPreflightError(
                f"no partition given and the cluster has no default; available: {', '.join(partitions)}"
            )
        part = defaults[0]
    elif req.partition not in partitions:
        raise SlurmPreflightError(f"partition {req.partition!r} does not exist; available: {', '.join(partitions)}")
    else:
        part = partitions[req.partition]
    where = f"partition {part.name!r}"
    if part.available.lower() not in ("up", ""):
        raise SlurmPreflightError(f"{where} is {part.available}, not up")
    if req.nodes > part.nodes:
        raise SlurmPreflightError(f"{req.nodes} nodes requested but {where} has {part.nodes}")
    cpus = req.cpus_per_task * req.ntasks_per_node
    if part.cpus_per_node and cpus > part.cpus_per_node:
        raise SlurmPreflightError(
            f"{cpus} CPUs per node requested (cpus_per_task={req.cpus_per_task} x ntasks_per_node="
            f"{req.ntasks_per_node}) but the largest node in {where} has {part.cpus_per_node}"
        )
    if req.gpus_per_node > part.gpus_per_node:
        has = f"{part.gpus_per_node} GPUs per node" if part.gpus_per_node else "no GPUs (no gpu GRES)"
        raise SlurmPreflightError(f"{req.gpus_per_node} GPUs per node requested but {where} has {has}")
    if req.mem and part.mem_per_node_mb:
        wanted = parse_memory_mb(req.mem)
        if wanted > part.mem_per_node_mb:
            raise SlurmPreflightError(
                f"mem={req.mem} ({wanted} MB) requested but the largest node in {where} has {part.mem_per_node_mb} MB"
            )
    if req.time_seconds and part.max_time_s and req.time_seconds > part.max_time_s:
        raise SlurmPreflightError(f"time={req.time} exceeds the MaxTime of {where} ({_fmt_seconds(part.max_time_s)})")
    check_image(spec)
    return part


def check_image(spec: JobSpec) -> None:
    """A container image given as a file (``.sqsh`` or a path) must exist on shared storage."""
    image = spec.container_image
    if not image:
        return
    looks_like_file = image.startswith(("/", "./", "../", "~")) or image.endswith((".sqsh", ".squashfs"))
    if looks_like_file and not os.path.isfile(os.path.expanduser(image)):
        raise SlurmPreflightError(
            f"container image {image!r} does not exist; stage it first (enroot import -o {image} docker://...) "
            "on storage every node mounts"
        )


def preflight(req: SbatchRequest, spec: JobSpec, cli: SlurmCLI) -> Partition:
    """Ask sinfo once and check the request (raises SlurmUnavailable if Slurm is not there)."""
    return check_request(req, spec, cli.partitions())
