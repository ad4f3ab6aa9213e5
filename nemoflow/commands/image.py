"""``nemoflow image build``: build the nemoflow container image with podman (see deployments/image/build.py)."""

from __future__ import annotations

import json

from nemoflow.commands import add_command

DESCRIPTION = """\
Build the container image every Kubernetes pod of a run (flow run and stage Jobs) runs in.

  nemoflow image build                       # CPU variant: localhost/nemoflow:<version>-cpu
  nemoflow image build --tag registry.example.com/team/nemoflow:0.1.0
  podman push registry.example.com/team/nemoflow:0.1.0

--variant cpu (default) is built on any Debian/Ubuntu host with podman, runc and
mmdebstrap (scripts/debian-packages.txt), without any container registry: a Debian
base from Debian packages (mmdebstrap, podman import), the pinned Python
dependencies from a wheelhouse made with pip on the host, and this repository at
/opt/nemoflow. Base and wheelhouse are cached in ~/.cache/nemoflow-image
(NEMOFLOW_IMAGE_CACHE); podman caches the dependency layer until constraints.txt
changes, so a rebuild after a code change takes seconds.

--variant cuda builds FROM NVIDIA's PyTorch container (needs nvcr.io access; it is
not built or tested on nemoflow's CI machines, which reach no registry)."""


def register(sub) -> None:
    parser = add_command(
        sub, "image", "build the nemoflow container image (podman; CPU variant from Debian packages)", DESCRIPTION
    )
    actions = parser.add_subparsers(dest="image_command", metavar="ACTION", title="actions")
    build = add_command(actions, "build", "build the image (cached: base, wheelhouse, dependency layer)", DESCRIPTION)
    build.add_argument("--variant", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda")
    build.add_argument(
        "--tag",
        action="append",
        metavar="REF",
        help="image reference to tag (repeatable; default localhost/nemoflow:<version>-<variant>)",
    )
    build.add_argument("--base-image", metavar="REF", help="use this base instead of the Debian one / NVIDIA's")
    build.add_argument("--rebuild-base", action="store_true", help="bootstrap the Debian base again")
    build.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    build.add_argument("--json", action="store_true", help="print the result (tag, id, size, seconds) as JSON")
    build.set_defaults(func=run_build)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def run_build(args) -> int:
    from deployments.image.build import ImageBuildError, build
    from infra.k8s.images import validate_image_reference
    from nemoflow.cli import UserError

    for tag in args.tag or []:
        validate_image_reference(tag)
    try:
        result = build(
            args.variant,
            args.tag,
            rebuild_base=args.rebuild_base,
            no_cache=args.no_cache,
            base_image=args.base_image,
        )
    except ImageBuildError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(result.__dict__))
    else:
        print(result.tag)
    return 0
