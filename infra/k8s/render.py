"""Manifests as files: one YAML document per object, ``<kind>-<name>.yaml``."""

from __future__ import annotations

import os
from typing import Any

import yaml

from infra import storage
from infra.jobs import JobSpec, ServiceSpec
from infra.k8s.manifests import job_objects, service_objects, to_dict, workspace_pvc
from infra.k8s.options import K8sOptions


def planned_objects(
    specs: list[JobSpec | ServiceSpec], options: K8sOptions, *, with_pvc: bool = True
) -> list[dict[str, Any]]:
    objects: list[Any] = [workspace_pvc(options)] if with_pvc and options.pvc_name else []
    for spec in specs:
        objects.extend(service_objects(spec, options) if isinstance(spec, ServiceSpec) else job_objects(spec, options))
    return [to_dict(obj) for obj in objects]


def file_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_manifests(specs: list[JobSpec | ServiceSpec], options: K8sOptions, out_dir: str) -> list[str]:
    """Write every object; the file names are unique per kind and name, so reruns overwrite in place."""
    objects = planned_objects(specs, options)
    names = [file_name(o) for o in objects]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"two objects would be written to {', '.join(sorted(duplicates))}")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for obj, name in zip(objects, names):
        path = os.path.join(out_dir, name)
        with storage.atomic_open(path, "w") as fh:
            yaml.safe_dump(obj, fh, sort_keys=False)
        written.append(path)
    return written
