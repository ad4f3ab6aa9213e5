"""Registry image references in Docker's grammar (``docker://``, enroot's ``REGISTRY#IMAGE``, Kubernetes' form) and ``<region>``."""

from __future__ import annotations

import dataclasses
import re

from infra.images.errors import ImageError
from infra.settings import get_settings


def resolve_region(source: str, region: str | None = None) -> str:
    """Replace ``<region>`` with the configured region (us, europe, asia).

    >>> resolve_region("gs://vmds-containers-<region>/nemo.sqsh", "europe")
    'gs://vmds-containers-europe/nemo.sqsh'
    """
    return source.replace("<region>", region or get_settings().region)


# Docker's image reference grammar (distribution/reference), defined once: parse_docker_ref (enroot and
# docker:// references) and infra/k8s/images.py (what a pod pulls) match against these parts.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
REGISTRY = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]{{1,5}})?"
REPOSITORY = rf"{_COMPONENT}(?:/{_COMPONENT})*"
TAG = r"[\w][\w.-]{0,127}"
DIGEST = r"sha256:[0-9a-f]{64}"
# [registry[:port]/]path[:tag][@sha256:<64 hex>], as docker pull and Kubernetes read it
REFERENCE = re.compile(
    rf"^(?:(?P<registry>{REGISTRY})/)?(?P<repository>{REPOSITORY})(?::(?P<tag>{TAG}))?(?:@(?P<digest>{DIGEST}))?$"
)
_REGISTRY_RE = re.compile(rf"^{REGISTRY}$")
_REPOSITORY_RE = re.compile(rf"^{REPOSITORY}$")
_TAG_RE = re.compile(rf"^{TAG}$")
_DIGEST_RE = re.compile(rf"^{DIGEST}$")


@dataclasses.dataclass(frozen=True)
class DockerRef:
    """A registry image: ``registry/repository[:tag][@sha256:digest]``."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def canonical(self) -> str:
        """The form Kubernetes and docker pull take."""
        return self.registry + "/" + self._name_tag_digest

    @property
    def enroot_uri(self) -> str:
        """The form ``enroot import`` takes: ``docker://REGISTRY#IMAGE:TAG``.

        enroot has no ``@digest`` syntax; it puts the text after ``:`` into the
        manifest URL (``/v2/IMAGE/manifests/<it>``), and since 3.2 accepts ``:``
        there, so a digest goes where the tag would (``IMAGE:sha256:...``).
        Docker Hub's registry API is served by registry-1.docker.io, not docker.io.
        """
        registry = "registry-1.docker.io" if self.registry == "docker.io" else self.registry
        return f"docker://{registry}#{self.repository}:{self.digest or self.tag}"

    @property
    def _name_tag_digest(self) -> str:
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def sqsh_name(self) -> str:
        """File name of the imported image, enroot's ``+``-joined style, registry included."""
        parts = [self.registry.replace(":", "_"), *self.repository.split("/")]
        if self.tag:
            parts.append(self.tag)
        if self.digest:
            parts.append(self.digest.replace(":", "-")[:19])
        return "+".join(parts) + ".sqsh"


def is_docker_source(source: str) -> bool:
    return source.startswith("docker://")


def parse_docker_ref(reference: str) -> DockerRef:
    """Parse and validate an image reference; raise :class:`ImageError` naming what is wrong.

    Accepts ``docker://`` or none, enroot's ``REGISTRY#IMAGE`` and Docker's
    ``REGISTRY/IMAGE``; a first component without a dot, colon or ``localhost``
    is a Docker Hub repository, as ``docker pull`` reads it. A tag or a digest
    is required: an image that silently drifts makes runs irreproducible.

    >>> parse_docker_ref("docker://nvcr.io#nvidia/nemo:24.07").canonical
    'nvcr.io/nvidia/nemo:24.07'
    """
    text = reference.strip()
    body = text[len("docker://") :] if text.startswith("docker://") else text
    if "://" in body:
        raise ImageError(f"image reference {reference!r}: only docker:// references name a registry image")
    if not body:
        raise ImageError(f"image reference {reference!r} is empty")
    if "@" in body.split("#", 1)[0].split("/", 1)[0] and "#" in body:
        raise ImageError(
            f"image reference {reference!r} carries a user name; set NEMOFLOW_REGISTRY_USER and "
            "NEMOFLOW_REGISTRY_PASSWORD instead"
        )
    digest = None
    if "@" in body:
        body, digest = body.rsplit("@", 1)
        if not _DIGEST_RE.match(digest):
            raise ImageError(
                f"image reference {reference!r}: digest {digest!r} is not sha256: followed by 64 lowercase hex digits"
            )
    if "#" in body:
        registry, path = body.split("#", 1)
    else:
        first, _, rest = body.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, rest
        else:
            registry, path = "docker.io", body
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.match(tag):
            raise ImageError(
                f"image reference {reference!r}: tag {tag!r} is not letters, digits, '_', '.', '-' (max 128)"
            )
    if not _REGISTRY_RE.match(registry):
        raise ImageError(f"image reference {reference!r}: registry {registry!r} is not a host name[:port]")
    if registry == "docker.io" and "/" not in path:
        path = "library/" + path
    if not _REPOSITORY_RE.match(path):
        hint = " (repository names are lowercase)" if path.lower() != path else ""
        raise ImageError(
            f"image reference {reference!r}: repository {path!r} is not lowercase components separated by '/'{hint}"
        )
    if tag is None and digest is None:
        raise ImageError(
            f"image reference {reference!r} has no tag or digest: name one (e.g. :24.07 or "
            "@sha256:...) so every run uses the same image"
        )
    return DockerRef(registry=registry, repository=path, tag=tag, digest=digest)
