"""Stage 1: the container image every later stage runs in.

    from tasks.image import stage_image
    image = stage_image("gs://vmds-containers-<region>/nemo/nemo-20250721.sqsh", "/lustre/images", "slurm")
    image = stage_image("docker://nvcr.io/nvidia/nemo:25.02", "/lustre/images", "slurm", convert=True)
    image = stage_image("nvcr.io/nvidia/nemo:25.02", executor="k8s")
    image = stage_image()                        # local: the Python environment is the "image"

It returns an :class:`infra.jobs.ImageRef`; later stages take it as an argument,
build their jobs in it (:func:`infra.jobs.workload_job`) and record it
(``ImageRef.lineage``), so every checkpoint and endpoint says which image produced it.

What staging means is the backend's (:meth:`infra.jobs.Backend.stage_image`):

* ``slurm``: a ``.sqsh`` source is copied (streamed, checksum- and
  superblock-verified, cached by the source's checksum) into ``dest``, a
  shared path the nodes see; a ``docker://`` source with ``convert=True`` is
  imported by ``enroot import`` in a Slurm job (see infra/images/conversion.py);
* ``k8s``: the registry reference is validated and recorded (nodes pull it);
  without a SOURCE, the executor's ``image`` (the nemoflow image);
* ``local``: no container; the interpreter and a hash of ``pip freeze`` (a
  SOURCE, if given, is not staged: local stages never run in it).

Caching: the Prefect cache key is the source URL, the source's checksum (GCS
md5/crc32c, HTTP hash headers or validators, the digest of a registry image;
for a local or fuse-mounted file its inode/size/mtime/ctime, so a 20 GB image
is not read once more only to compute a key), the destination and the code
version; a key whose staged copy has vanished is not trusted. Even without
Prefect's cache, the sidecar ``<image>.meta.json`` makes a second copy of the
same source a no-op.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from prefect import task
from pydantic import BaseModel, ConfigDict, Field

from infra import images, storage
from infra.executors import Executor, as_executor, get_backend
from infra.jobs import ImageRef, Resources
from infra.secrets import CredentialFree
from infra.settings import get_settings
from tasks.common import code_fingerprint, logger, transient_only

CODE_MODULES = ("infra.images", "infra.environment", "tasks.image")


class ImageConfig(BaseModel):
    # hide_input_in_errors: a refused source may hold a credential; errors name the field, never repeat it.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    source: CredentialFree | None = Field(
        None,
        description="a .sqsh (gs://, https://, file://, path; '<region>' resolved from settings) or docker://REF; "
        "'python-env' = no container, the nodes share this Python environment; unset = the executor's default "
        "(local: this Python environment; k8s: the executor's image). A signed URL's query or a password only by "
        "reference: https://host/nemo.sqsh?<secret:BLOCK> (a Prefect Secret block) or <env:VARIABLE>",
    )
    dest: str | None = Field(None, description="directory on shared storage for the staged .sqsh")
    convert: bool = Field(False, description="convert a docker:// reference with enroot (a Slurm job)")


def default_dest() -> str:
    return storage.join(get_settings().work_dir, "images")


def stage(
    source: str | None = None,
    dest: str | None = None,
    executor: Any = None,
    convert: bool = False,
    force: bool = False,
    log=None,
    progress=None,
    resources: Resources | dict | None = None,
) -> tuple[ImageRef, dict[str, Any]]:
    """Stage an image without Prefect; returns the ref and facts for the report (cached, bytes, seconds).

    ``resources`` apply to an enroot import job (Slurm with ``convert``).
    """
    log = log or (lambda line: None)
    started = time.monotonic()
    if isinstance(resources, dict):
        resources = Resources(**{**images.default_import_resources().model_dump(), **resources})
    ref, facts = get_backend(executor).stage_image(
        source, dest or default_dest(), convert=convert, force=force, log=log, progress=progress, resources=resources
    )
    facts.setdefault("seconds", time.monotonic() - started)
    return ref, facts


def image_cache_key(context, parameters: dict[str, Any]) -> str | None:
    """The backend's identity of what would be staged, plus the code version.

    A cached ImageRef is only as good as the file it points at: when the staged copy is gone or no
    longer matches the source, and a record exists under the key, a one-off key makes this run
    stage again instead of returning the stale record. None (no caching) for what cannot be keyed.
    """
    if parameters.get("force"):
        return None
    try:
        executor = as_executor(parameters.get("executor"))
        identity = get_backend(executor).image_identity(
            parameters.get("source"), parameters.get("dest") or default_dest(), bool(parameters.get("convert"))
        )
    except Exception:  # noqa: BLE001 - the task body raises the clear error; a key must not
        return None
    if identity is None:
        return None
    what, staged = identity
    parts = [executor.kind, what, code_fingerprint(*CODE_MODULES)]
    key = "stage-image-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    if not staged:
        store = getattr(context, "result_store", None)
        try:
            stale = store is None or store.exists(key)
        except Exception:  # noqa: BLE001 - an unreadable store counts as stale
            stale = True
        if stale:
            return f"{key}-restage-{uuid.uuid4().hex[:8]}"
    return key


def artifact_markdown(ref: ImageRef, facts: dict[str, Any]) -> str:
    copied = facts.get("bytes_copied", 0)
    rows = [
        ("kind", ref.kind),
        ("uri", f"`{ref.uri}`"),
        ("size", images.human_bytes(ref.size) if ref.size is not None else "-"),
        ("checksum", f"`{ref.checksum}`" if ref.checksum else "-"),
        ("source", f"`{ref.source}`" if ref.source else "-"),
        ("digest", f"`{ref.digest}`" if ref.digest else "-"),
        ("copied", "no (verified copy already staged)" if facts.get("cached") else images.human_bytes(copied)),
        ("seconds", f"{facts.get('seconds', 0.0):.1f}"),
    ]
    lines = ["### Staged image", "", "| field | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"


class _ProgressArtifact:
    """A Prefect progress artifact for long copies, created on the first report (small copies make none)."""

    def __init__(self) -> None:
        self.artifact_id = None

    def __call__(self, copied: int, total: int | None) -> None:
        if not total:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        percent = min(100.0, 100.0 * copied / total)
        try:
            if self.artifact_id is None:
                if copied >= total:
                    return
                self.artifact_id = create_progress_artifact(
                    progress=percent, key="staged-image-progress", description="image copy"
                )
            else:
                update_progress_artifact(self.artifact_id, progress=percent)
        except Exception as exc:  # noqa: BLE001 - progress display must never fail a copy
            logger().debug("progress artifact: %s", exc)


def _executor_kind() -> str:
    from prefect.runtime import task_run

    try:
        return as_executor(task_run.parameters.get("executor")).kind
    except ValueError:
        return "unknown"


@task(
    name="stage-image",
    cache_key_fn=image_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=transient_only(),  # a dropped or corrupted transfer; not a missing source or enroot
    task_run_name=lambda: f"stage-image-{_executor_kind()}",
)
def stage_image(
    source: str | None = None,
    dest: str | None = None,
    executor: Executor | None = None,
    convert: bool = False,
    force: bool = False,
    resources: dict[str, Any] | None = None,
) -> ImageRef:
    """Stage the container image for a run; see the module docstring. Returns an ImageRef.

    ``resources`` (e.g. ``{"cpus_per_task": 16, "time": "01:00:00"}``) apply to the enroot import
    job only; where it runs (partition, account) is the executor's.
    """
    from prefect.artifacts import create_markdown_artifact

    log = logger()
    ref, facts = stage(
        source,
        dest,
        executor,
        convert,
        force,
        log=lambda line: log.info("%s", line),
        progress=_ProgressArtifact(),
        resources=resources,
    )
    create_markdown_artifact(
        key="staged-image", markdown=artifact_markdown(ref, facts), description=f"{ref.kind} image {ref.uri}"
    )
    return ref
