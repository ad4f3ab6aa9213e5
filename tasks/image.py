"""Stage 1: the container image every later stage runs in.

    from tasks.image import stage_image
    image = stage_image("gs://vmds-containers-<region>/nemo/nemo-20250721.sqsh", dest="/lustre/images")
    image = stage_image("docker://nvcr.io/nvidia/nemo:25.02", dest="/lustre/images", convert=True)
    image = stage_image("nvcr.io/nvidia/nemo:25.02", backend="k8s")
    image = stage_image(backend="local")        # the Python environment is the "image"

It returns a :class:`tasks.refs.ImageRef`; later stages take it as an argument,
put it on their jobs with :func:`with_image` and record it (:func:`lineage`),
so every checkpoint and endpoint says which image produced it.

By backend:

* ``slurm``: a ``.sqsh`` source is copied (streamed, checksum- and
  superblock-verified, cached by the source's checksum) into ``dest``, a
  shared path the nodes see; a ``docker://`` source with ``convert=True`` is
  imported by ``enroot import`` in a Slurm job (see infra/images.py);
* ``k8s``: the registry reference is validated and recorded (nodes pull it);
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
import json
import time
import uuid
from typing import Any

from prefect import task

from infra import images, storage
from infra.backends import BACKENDS
from infra.jobs import JobSpec, Resources
from infra.settings import get_settings
from tasks.common import code_fingerprint, logger
from tasks.refs import ImageRef

CODE_MODULES = ("infra.images", "tasks.image")


def default_dest() -> str:
    return storage.join(get_settings().work_dir, "images")


# On Slurm, "python-env" instead of an image: run jobs with this (shared) Python environment.
PYTHON_ENV = "python-env"


def _check_backend(backend: str) -> str:
    backend = "k8s" if backend == "kubernetes" else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


def _from_staged(staged: images.StagedImage) -> ImageRef:
    return ImageRef(
        kind="sqsh",
        uri=staged.uri,
        checksum=staged.checksum,
        digest=staged.digest,
        size=staged.size,
        source=staged.source,
    )


def python_env_ref() -> ImageRef:
    env = images.python_environment()
    return ImageRef(
        kind="python-env",
        uri=env["executable"],
        checksum="sha256:" + env["freeze_sha256"],
        source=f"Python {env['python']}, {env['packages']} packages (pip freeze)",
    )


def stage(
    source: str | None = None,
    dest: str | None = None,
    backend: str = "slurm",
    convert: bool = False,
    force: bool = False,
    log=None,
    progress=None,
    resources: Resources | dict | None = None,
    backend_options: dict[str, Any] | None = None,
) -> tuple[ImageRef, dict[str, Any]]:
    """Stage an image without Prefect; returns the ref and facts for the report (cached, bytes, seconds)."""
    log = log or (lambda line: None)
    backend = _check_backend(backend)
    started = time.monotonic()
    if backend == "local":
        # Local stages run as processes of this interpreter, never in a container: recording
        # a .sqsh here would make later stages believe they ran in it.
        if source is not None:
            log(f"the local backend runs no containers: {images.public_uri(source)} is not staged")
        ref = python_env_ref()
        log(f"local backend: the image is the Python environment {ref.uri} ({ref.checksum})")
        return ref, {"cached": False, "bytes_copied": 0, "seconds": time.monotonic() - started}
    if source == PYTHON_ENV and backend == "slurm":
        # No container: the nodes share this file system and Python environment (the local test
        # cluster, or nemoflow installed on the cluster's shared storage).
        ref = python_env_ref()
        log(f"slurm without a container: jobs run with the shared Python environment {ref.uri}")
        return ref, {"cached": False, "bytes_copied": 0, "seconds": time.monotonic() - started}
    if source is None:
        raise ValueError(
            f"the {backend} backend runs stages in a container: give an image SOURCE"
            + (f" (or {PYTHON_ENV!r} when the nodes share this Python environment)" if backend == "slurm" else "")
        )
    source = images.resolve_region(source)
    if backend == "k8s":
        if convert:
            raise ValueError("--convert makes an enroot .sqsh for Slurm; Kubernetes nodes pull registry images")
        parsed = images.parse_docker_ref(source)
        log(f"Kubernetes pulls {parsed.canonical}" + ("" if parsed.digest else " (no digest: the tag may move)"))
        ref = ImageRef(kind="registry", uri=parsed.canonical, digest=parsed.digest, source=source)
        return ref, {"cached": False, "bytes_copied": 0, "seconds": time.monotonic() - started}
    dest = dest or default_dest()
    if images.is_docker_source(source):
        if not convert:
            raise ValueError(
                f"{source} is a registry image: pass --convert to import it into a .sqsh with enroot on the "
                "cluster (one pull, then every job starts from the shared file), or give a prebuilt .sqsh"
            )
        # Conversion runs where the image will be used; a "local" conversion needs enroot here.
        if isinstance(resources, dict):
            resources = Resources(**{**images.default_import_resources().model_dump(), **resources})
        staged = images.convert_image(
            source, dest, backend=backend, force=force, log=log, resources=resources, backend_options=backend_options
        )
    else:
        if convert:
            raise ValueError(f"--convert needs a docker:// reference, not {source}")
        staged = images.copy_image(source, dest, force=force, log=log, progress=progress)
    ref = _from_staged(staged)
    return ref, {"cached": staged.cached, "bytes_copied": staged.bytes_copied, "seconds": staged.seconds}


def image_cache_key(context, parameters: dict[str, Any]) -> str | None:
    """Source URL + the source's checksum + destination + backend + code version.

    A cached ImageRef is only as good as the file it points at: when the staged
    copy is gone or no longer matches the source, and a record exists under the
    key, a one-off key makes this run stage again instead of returning the
    stale record. None (no caching) for what is cheap to redo or cannot be keyed.
    """
    if parameters.get("force"):
        return None
    source = parameters.get("source")
    backend = parameters.get("backend", "slurm")
    if (backend == "local" and source is None) or (backend == "slurm" and source == PYTHON_ENV):
        # The "image" is this Python environment: key it by the interpreter and the installed
        # distributions (what pip freeze lists, read without a subprocess), so a re-run is Cached.
        import sys
        from importlib import metadata

        dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
        parts = [backend, sys.executable, sys.version, *dists, code_fingerprint(*CODE_MODULES)]
        return "stage-image-local-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    if backend in ("k8s", "kubernetes") and source is not None:
        # A registry reference is validated and recorded, nothing is copied: the reference is the key.
        parts = [source, backend, code_fingerprint(*CODE_MODULES)]
        return "stage-image-k8s-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    if source is None or backend in ("k8s", "kubernetes", "local"):
        return None
    try:
        source = images.resolve_region(source)
        dest = storage.normalize(parameters.get("dest") or default_dest())
        if images.is_docker_source(source):
            parsed = images.parse_docker_ref(source)
            identity = parsed.digest or f"tag:{parsed.canonical}"
            final = storage.join(dest, parsed.sqsh_name)
        else:
            info = images.probe_source(source)
            source, identity = info.shown, info.identity
            final = storage.join(dest, images.destination_name(source))
        sidecar = images._read_sidecar(final)
        staged = bool(sidecar) and sidecar.get("source_checksum") == identity and storage.exists(final)
    except Exception:  # noqa: BLE001 - the task body raises the clear error; a key must not
        return None
    parts = [source, identity, dest, backend, str(bool(parameters.get("convert"))), code_fingerprint(*CODE_MODULES)]
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


def _retry_transient(task, task_run, state) -> bool:
    """Retry a dropped or corrupted transfer; not a missing source, bad reference or missing enroot."""
    try:
        state.result()
    except images.ImageError as exc:
        return exc.transient
    except (ConnectionError, TimeoutError):
        return True
    except Exception:  # noqa: BLE001 - anything else is not a transient transfer failure
        return False
    return False


def artifact_markdown(ref: ImageRef, facts: dict[str, Any]) -> str:
    rows = [
        ("kind", ref.kind),
        ("uri", f"`{ref.uri}`"),
        ("size", images.human_bytes(ref.size) if ref.size is not None else "-"),
        ("checksum", f"`{ref.checksum}`" if ref.checksum else "-"),
        ("source", f"`{ref.source}`" if ref.source else "-"),
        ("digest", f"`{ref.digest}`" if ref.digest else "-"),
        (
            "copied",
            "no (verified copy already staged)"
            if facts.get("cached")
            else images.human_bytes(facts.get("bytes_copied", 0)),
        ),
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


@task(
    name="stage-image",
    cache_key_fn=image_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=_retry_transient,
    task_run_name="stage-image-{backend}",
)
def stage_image(
    source: str | None = None,
    dest: str | None = None,
    backend: str = "slurm",
    convert: bool = False,
    force: bool = False,
    resources: dict[str, Any] | None = None,
    backend_options: dict[str, Any] | None = None,
) -> ImageRef:
    """Stage the container image for a run; see the module docstring. Returns an ImageRef.

    ``resources`` (e.g. ``{"cpus_per_task": 16, "time": "01:00:00"}``) and
    ``backend_options`` (e.g. ``{"partition": "cpu", "account": "proj"}``) apply
    to the enroot import job only.
    """
    from prefect.artifacts import create_markdown_artifact

    log = logger()
    ref, facts = stage(
        source,
        dest,
        backend,
        convert,
        force,
        log=lambda line: log.info("%s", line),
        progress=_ProgressArtifact(),
        resources=resources,
        backend_options=backend_options,
    )
    create_markdown_artifact(
        key="staged-image",
        markdown=artifact_markdown(ref, facts),
        description=f"{ref.kind} image {ref.uri}",
    )
    return ref


# ---------------------------------------------------------------- lineage: what later stages call


def container_image(image: ImageRef | None) -> str | None:
    """The value for ``JobSpec.container_image``: a .sqsh path, a registry reference, or None (local)."""
    if image is None or image.kind == "python-env":
        return None
    return image.uri


def lineage(image: ImageRef | None) -> dict[str, str]:
    """Flat facts about the image a stage ran with: for manifests, artifacts and job environments."""
    if image is None:
        return {}
    facts = {"image_kind": image.kind, "image": image.uri}
    if image.checksum:
        facts["image_checksum"] = image.checksum
    if image.digest:
        facts["image_digest"] = image.digest
    if image.source:
        facts["image_source"] = image.source
    return facts


def with_image(spec: JobSpec, image: ImageRef | None) -> JobSpec:
    """``spec`` running in ``image``, with the lineage in its environment (NEMOFLOW_IMAGE*)."""
    if image is None:
        return spec
    env = dict(spec.env)
    env.update({"NEMOFLOW_" + key.upper(): value for key, value in lineage(image).items()})
    return spec.model_copy(update={"container_image": container_image(image), "env": env})


def lineage_markdown(image: ImageRef | None) -> str:
    """One line for a stage's artifact: which image produced this."""
    if image is None:
        return "image: not recorded"
    what = f"{image.kind} `{image.uri}`"
    if image.digest:
        what += f" @ `{image.digest}`"
    elif image.checksum:
        what += f" (`{image.checksum}`)"
    return "image: " + what


def lineage_json(image: ImageRef | None) -> str:
    return json.dumps(lineage(image), sort_keys=True)
