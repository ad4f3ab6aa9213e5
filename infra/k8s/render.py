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


class ConfigError(ValueError):
    """A config file that cannot be used, as one line naming the file (and line) and the fix."""


class ManifestWriteError(ValueError):
    """The output directory cannot take the manifests (read-only, not a directory, full): one line.

    A ValueError, so the CLI prints it as a user error instead of a traceback.
    """


def load_yaml_config(path: str | None, *, what: str = "config") -> dict[str, Any]:
    """A YAML mapping from ``path`` (``{}`` for None); every failure is one line naming the file.

    >>> load_yaml_config(None)
    {}
    """
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} file {path} is a directory; give a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} file {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} file {path}: expected a mapping (key: value lines) at the top, got {type(data).__name__}"
        )
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def write_manifests(specs: list[JobSpec | ServiceSpec], options: K8sOptions, out_dir: str) -> list[str]:
    """Write every object; the file names are unique per kind and name, so reruns overwrite in place.

    Everything is built and serialised before the first file is written, so an invalid
    value (a name, a quantity) fails with nothing written; each file appears whole or not at all.
    """
    objects = planned_objects(specs, options)
    names = [file_name(o) for o in objects]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"two objects would be written to {', '.join(sorted(duplicates))}")
    texts = [yaml.safe_dump(obj, sort_keys=False) for obj in objects]
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for text, name in zip(texts, names):
            path = os.path.join(out_dir, name)
            with storage.atomic_open(path, "w") as fh:
                fh.write(text)
            written.append(path)
    except OSError as exc:
        done = f" ({len(written)} of {len(names)} written)" if written else ""
        raise ManifestWriteError(
            f"cannot write manifests to {out_dir}: {exc.strerror or exc}{done}; choose a writable --out directory"
        ) from None
    return written
