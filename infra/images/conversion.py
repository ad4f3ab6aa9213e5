"""``docker://`` references imported with ``enroot import`` in a cluster job, then verified and cached like a copy."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import time
import uuid
from pathlib import Path

from infra import storage
from infra.images.credentials import LOGIN_REQUIRED, PASSWORD_ENV, USER_ENV, netrc_hosts, registry_login
from infra.images.errors import EnrootNotFound, ImageError
from infra.images.references import DockerRef, parse_docker_ref
from infra.images.squashfs import check_filesystem, read_superblock
from infra.images.staged import (
    LogSink,
    StagedImage,
    cached_image,
    local_sha256,
    prepare_destination,
    remove_stale_temporaries,
    write_sidecar,
)
from infra.jobs import Backend, JobResult, JobSpec, JobState, Resources
from infra.settings import get_settings
from infra.transfer import human_bytes

TEMPLATE = Path(__file__).resolve().parents[2] / "deployments" / "slurm" / "enroot-import.sh.j2"
ENROOT_MISSING = "enroot not found on the node (install enroot + pyxis, or stage a prebuilt .sqsh)"
IMPORT_CPUS = 4
IMPORT_TIME = "02:00:00"


def render_import_script(
    ref: DockerRef, output_tmp: str, *, login_user_default: str | None, with_credentials: bool
) -> str:
    """The bash script a conversion job runs; it holds no secret values, only variable names."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env.get_template(TEMPLATE.name).render(
        reference=ref.canonical,
        enroot_uri=ref.enroot_uri,
        output_tmp=output_tmp,
        with_credentials=with_credentials,
        netrc_hosts=netrc_hosts(ref.registry),
        login_user_default=login_user_default or "",
        user_env=USER_ENV,
        password_env=PASSWORD_ENV,
        enroot_missing=ENROOT_MISSING,
    )


def default_import_resources() -> Resources:
    # enroot import decompresses layers and runs mksquashfs on every CPU it gets:
    # one CPU makes a 20 GB NeMo image take the better part of an hour.
    return Resources(cpus_per_task=IMPORT_CPUS, time=IMPORT_TIME)


def _job_name(ref: DockerRef) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{ref.repository.rsplit('/', 1)[-1]}-{ref.tag or ref.digest[7:19]}".lower())
    return ("enroot-import-" + slug.strip("-"))[:63].rstrip("-")


@dataclasses.dataclass
class ConversionPlan:
    ref: DockerRef
    spec: JobSpec
    script: str
    script_uri: str
    output_tmp: str
    final: str
    identity: str


def plan_conversion(
    reference: str,
    dest_dir: str,
    *,
    resources: Resources | None = None,
) -> ConversionPlan:
    """Validate the reference and credentials and build the job; nothing is submitted or written."""
    ref = parse_docker_ref(reference)
    if not storage.is_local(dest_dir):
        raise ImageError(
            f"--dest {dest_dir}: enroot writes the image on the node, so the destination must be a shared file "
            "system path the nodes see (e.g. /lustre/... or a gcsfuse mount like /gcs/bucket/...), not a URL"
        )
    dest_dir = storage.local_path(dest_dir)
    login = registry_login(ref)
    final = os.path.join(dest_dir, ref.sqsh_name)
    token = uuid.uuid4().hex[:12]
    output_tmp = os.path.join(dest_dir, f"{storage.TMP_MARK}{token}-{ref.sqsh_name}")
    script = render_import_script(
        ref,
        output_tmp,
        login_user_default=LOGIN_REQUIRED.get(ref.registry),
        with_credentials=login is not None,
    )
    jobs_dir = os.path.join(dest_dir, ".nemoflow-jobs")
    script_uri = os.path.join(jobs_dir, f"{_job_name(ref)}-{token}.sh")
    spec = JobSpec(
        name=_job_name(ref),
        command=["bash", script_uri],
        secret_env=[USER_ENV, PASSWORD_ENV] if login is not None else [],
        resources=resources or default_import_resources(),
        log_dir=jobs_dir,
        workdir=dest_dir,
    )
    # A tag can move to another image; only a digest names content, so a tag-only
    # reference is cached by name (re-import with force=True after a re-push).
    identity = ref.digest or f"tag:{ref.canonical}"
    return ConversionPlan(ref, spec, script, script_uri, output_tmp, final, identity)


def convert_image(
    reference: str,
    dest_dir: str,
    *,
    backend: Backend,
    force: bool = False,
    log: LogSink | None = None,
    resources: Resources | None = None,
) -> StagedImage:
    """Import a registry image into ``dest_dir`` with ``enroot import`` in a job of ``backend``; verify, cache."""
    from infra.settings import redact

    log = log or (lambda line: None)
    plan = plan_conversion(reference, dest_dir, resources=resources)
    if not force and (hit := cached_image(plan.final, plan.ref.canonical, plan.identity, log)):
        log(f"{plan.final} already imported from {plan.ref.canonical}; nothing to do")
        return hit
    prepare_destination(os.path.dirname(plan.final), None)
    # A job killed outright (SIGKILL after its time limit) skips its cleanup trap.
    remove_stale_temporaries(os.path.dirname(plan.final), plan.ref.sqsh_name, log)
    storage.write_text(plan.script_uri, plan.script)
    # Backends inject JobSpec.secret_env by name from the settings; redact
    # again here so no backend's log path can leak the password.
    hidden = get_settings().secret_values()
    started = time.monotonic()
    log(f"importing {plan.ref.canonical} with enroot in a {backend.name} job")
    try:
        result: JobResult = backend.run(plan.spec, on_log=lambda line: log(redact(line, hidden)))
        if result.state is not JobState.COMPLETED:
            tail = "\n".join(redact(line, hidden) for line in result.log_tail[-20:])
            if ENROOT_MISSING in tail or "enroot: command not found" in tail:
                raise EnrootNotFound(
                    f"cannot import {plan.ref.canonical}: {ENROOT_MISSING} ({result.backend} job {result.job_id})"
                )
            raise ImageError(
                f"enroot import of {plan.ref.canonical} failed: {result.backend} job {result.job_id} ended "
                f"{result.state.value} (exit code {result.exit_code}; {result.reason or 'no reason given'})"
                + (f"\nlast log lines:\n{tail}" if tail else "")
            )
        if not os.path.exists(plan.output_tmp):
            raise ImageError(
                f"{result.backend} job {result.job_id} reported success but wrote no image at {plan.output_tmp}"
            )
        superblock = read_superblock(plan.output_tmp)
        check_filesystem(plan.output_tmp, superblock, plan.output_tmp)
        size = os.path.getsize(plan.output_tmp)
        checksum = local_sha256(plan.output_tmp)
        os.replace(plan.output_tmp, plan.final)
    finally:
        with contextlib.suppress(OSError):
            os.remove(plan.output_tmp)
    image = StagedImage(
        uri=plan.final,
        size=size,
        checksum=checksum,
        source=plan.ref.canonical,
        source_checksum=plan.identity,
        digest=plan.ref.digest,
        bytes_copied=size,
        seconds=time.monotonic() - started,
        superblock=superblock,
    )
    write_sidecar(image)
    log(f"verified {plan.final}: {checksum}, {human_bytes(size)}")
    return image
