"""``nemoflow stage-image``: copy, verify and cache a container image (or import one with enroot)."""

from __future__ import annotations

import json
import sys

from nemoflow.commands import add_command

DESCRIPTION = """\
Stage the container image that every later stage runs in, and print where it is.

SOURCE is one of:
  a prebuilt enroot/pyxis squashfs image (.sqsh):
      gs://BUCKET/PATH.sqsh, https://HOST/PATH.sqsh, file:///PATH.sqsh, or a plain path
      (a fuse mount such as /gcs/BUCKET/PATH.sqsh). "<region>" in it becomes the region
      setting (NEMOFLOW_REGION: us, europe, asia), e.g.
      gs://vmds-containers-<region>/nemo/nemo-20250721.sqsh
  a registry image, docker://REGISTRY/IMAGE:TAG (or enroot's docker://REGISTRY#IMAGE:TAG,
      optionally @sha256:DIGEST): with --convert, `enroot import` turns it into a .sqsh in
      a cluster job. For --backend k8s the reference is only validated and recorded
      (REGISTRY/IMAGE:TAG, docker:// optional); the nodes pull it.
  with --backend local: nothing is staged; the "image" later stages record is this
      Python environment (interpreter, version and a hash of `pip freeze`).

A copied image is streamed to --dest under a temporary name, checked against the
checksum the source states (GCS md5/crc32c, HTTP x-goog-hash / Content-MD5 / md5 ETag
and Content-Length; otherwise its sha256 is recorded), against the squashfs
superblock (magic, version 4.0, block size, inodes, size) and by `unsquashfs -l`
(squashfs-tools reads the file system's tables), then renamed into place. A dropped
connection is resumed; a source that cannot be reached (404, 403, bad credentials,
a host that does not resolve) fails at once with one line naming it.
A sidecar IMAGE.sqsh.meta.json records source, checksum, size and time of
verification; running the command again with the same source copies nothing.

Registry credentials (for nvcr.io: user $oauthtoken, password = your NGC API key):
  NEMOFLOW_REGISTRY_USER, NEMOFLOW_REGISTRY_PASSWORD (or NGC_API_KEY). They reach
  only the import job, through its environment; they are never written into the
  job script, logs or artifacts.

Examples:
  nemoflow stage-image gs://vmds-containers-<region>/nemo/nemo-20250721.sqsh --dest /lustre/images
  NGC_API_KEY=... nemoflow stage-image docker://nvcr.io/nvidia/nemo:25.02 --convert \\
      --dest /lustre/images --cpus-per-task 16 --partition cpu
  nemoflow stage-image nvcr.io/nvidia/nemo:25.02 --backend k8s
  nemoflow stage-image --backend local"""


def register(sub) -> None:
    parser = add_command(
        sub,
        "stage-image",
        "copy and verify a .sqsh container image (or import one with enroot); cached by checksum",
        DESCRIPTION,
    )
    parser.add_argument("source", nargs="?", metavar="SOURCE", help="a .sqsh URI/path or docker:// reference")
    parser.add_argument(
        "--dest",
        metavar="DIR",
        help="directory for the image, a path the cluster nodes see or gs://... for copies "
        "(default: NEMOFLOW_WORK_DIR/images)",
    )
    parser.add_argument(
        "--convert",
        action="store_true",
        help="import a docker:// reference into a .sqsh with `enroot import` in a job on the backend",
    )
    parser.defer(_backend_option)  # the backends' names come from infra/executors.py, imported when it runs
    job = parser.add_argument_group("the enroot import job (--convert)")
    job.add_argument(
        "--cpus-per-task",
        type=int,
        metavar="N",
        help="CPUs for enroot import (default 4; more makes mksquashfs faster)",
    )
    job.add_argument("--time", metavar="LIMIT", help="time limit, sbatch syntax (default 02:00:00)")
    job.add_argument("--partition", metavar="NAME", help="Slurm partition (default: the cluster's default)")
    job.add_argument("--account", metavar="NAME", help="Slurm account")
    parser.add_argument("--force", action="store_true", help="copy or import again even if a verified image is there")
    parser.add_argument(
        "--no-prefect",
        action="store_true",
        help="run directly, without a Prefect task run (no artifact, no Prefect cache; "
        "the sidecar cache still applies)",
    )
    parser.add_argument("--json", action="store_true", help="print the ImageRef as JSON")
    parser.set_defaults(func=run)


# Where later stages run when --backend is not given (what staging means: see the description).
DEFAULT_BACKEND = "slurm"


def _backend_option(parser) -> None:
    from infra.executors import EXECUTORS

    parser.add_argument(
        "--backend",
        choices=list(EXECUTORS),
        default=DEFAULT_BACKEND,
        help=f"where later stages run (default: {DEFAULT_BACKEND}); decides what staging means, see above",
    )


def _job_options(args) -> tuple[dict | None, dict]:
    """The import job's resources, and the executor (``--backend`` plus Slurm's --partition/--account)."""
    resources = {k: v for k, v in (("cpus_per_task", args.cpus_per_task), ("time", args.time)) if v is not None}
    options = {k: v for k, v in (("partition", args.partition), ("account", args.account)) if v is not None}
    if (resources or options) and not args.convert:
        from nemoflow.cli import UserError

        raise UserError("--cpus-per-task, --time, --partition and --account apply to the import job: add --convert")
    from infra.executors import EXECUTORS

    if options and not set(options) <= set(EXECUTORS[args.backend].model_fields):
        from nemoflow.cli import UserError

        # the executors that have these options, from their models
        having = [kind for kind, cls in EXECUTORS.items() if set(options) <= set(cls.model_fields)]
        raise UserError(f"--partition and --account are {'/'.join(having)} options: use --backend {having[0]}")
    return resources or None, {"kind": args.backend, **options}


def _run_in_flow(args):
    """The task inside a one-task flow, so its logs and artifact belong to a flow run in the UI."""
    import os

    # Without PREFECT_API_URL Prefect starts a temporary server; on a busy login node
    # its default 20 s start-up budget is not always enough.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    from prefect import flow

    from infra.secrets import credential_problem
    from tasks.image import stage_image

    if args.source and (problem := credential_problem(args.source)):
        from nemoflow.cli import UserError

        # The flow run would store SOURCE in Prefect's database: refuse before it exists.
        raise UserError(f"SOURCE {problem}; or use --no-prefect (nothing is recorded then)")
    resources, executor = _job_options(args)

    @flow(name="stage-image", log_prints=False)
    def stage_image_flow(source, dest, convert, force):
        return stage_image(source, dest=dest, executor=executor, convert=convert, force=force, resources=resources)

    return stage_image_flow(args.source, args.dest, args.convert, args.force)


def run(args) -> int:
    from infra.images import ImageError

    try:
        if args.no_prefect:
            from tasks.image import stage

            resources, executor = _job_options(args)
            ref, facts = stage(
                args.source,
                args.dest,
                executor,
                args.convert,
                args.force,
                log=lambda line: print(line, file=sys.stderr),
                resources=resources,
            )
            note = " (already staged, nothing copied)" if facts["cached"] else ""
        else:
            ref = _run_in_flow(args)
            note = ""
    except ImageError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from exc
    if args.json:
        print(json.dumps(ref.model_dump(), indent=2))
    else:
        print(f"{ref.kind} {ref.uri}{note}")
        for name in ("checksum", "size", "digest", "source"):
            value = getattr(ref, name)
            if value is not None:
                print(f"  {name}: {value}")
    return 0
