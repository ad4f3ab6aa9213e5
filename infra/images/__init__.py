"""Container images for the stages: prebuilt squashfs files, registry references, enroot imports.

Three ways to say which image a run uses:

* a prebuilt enroot/pyxis ``.sqsh``: ``gs://``, ``https://``, ``file://`` or a
  plain path (a fuse mount such as ``/gcs/...``). :func:`copy_image` streams it
  through fsspec to shared storage, verifies it and caches it;
* ``docker://REGISTRY/IMAGE:TAG`` (or enroot's ``docker://REGISTRY#IMAGE:TAG``):
  :func:`convert_image` imports it with ``enroot import`` in a cluster job;
* on Kubernetes the reference itself (``nvcr.io/nvidia/nemo:25.02``), checked
  by :func:`parse_docker_ref` and recorded, digest included when given.

``<region>`` in a source (``gs://vmds-containers-<region>/...``) becomes the
``region`` setting (us, europe or asia).

Bytes move through the one transfer stack (infra/transfer/: probe, resumable
copy, retries through infra/retry.py policies, redaction); this module adds what
is specific to images. A copy is verified three times: against the checksum the
source states (GCS object md5/crc32c; HTTP ``x-goog-hash``, ``Content-MD5`` or an
md5 ETag, plus Content-Length); by the squashfs superblock (magic, version 4.0,
block size, inode count, ``bytes_used`` against the file size), which catches a
truncated or wrong file even when the source states no checksum; and by
squashfs-tools' ``unsquashfs -l``, which reads the inode, directory, fragment and
id tables, so a sound superblock in front of a damaged body is refused too. It is
written under a temporary name and renamed only once verified. Beside each image a
sidecar ``<image>.meta.json`` records the source, the source's checksum, the
image's checksum, its size and when it was verified; a later copy of the same
source with the same checksum finds it and copies nothing. A local (or fuse)
source states no checksum: its identity is its stat (inode, size, mtime, ctime),
the copy records its sha256, and a touched-but-unchanged source is recognised
by comparing that sha256 instead of copying again.

Registry credentials (``NEMOFLOW_REGISTRY_USER`` / ``NEMOFLOW_REGISTRY_PASSWORD``;
for nvcr.io the user defaults to ``$oauthtoken`` and the password is the NGC
API key) reach the conversion job only through its environment; the job writes
them to a private, temporary enroot config and deletes it at the end.

One module per concern; callers import the package (``from infra import images``), which names them all
except the tuning knobs (``copying.TIMEOUT_S``, ``copying.RESUME_BACKOFF_S``, ...): set those on their module.

* ``errors.py``       :class:`ImageError` and its kinds (``transient``: whether the stage's retry may cure it)
* ``references.py``   Docker's reference grammar, :class:`DockerRef`, :func:`parse_docker_ref`, ``<region>``
* ``squashfs.py``     the superblock check and ``unsquashfs -l`` over the tables
* ``staged.py``       :class:`StagedImage`, the sidecar cache, the destination's checks, stale temporaries
* ``copying.py``      :func:`probe_source` and :func:`copy_image` (a prebuilt ``.sqsh``)
* ``credentials.py``  :func:`registry_login`: registry credentials from the settings
* ``conversion.py``   :func:`plan_conversion` and :func:`convert_image` (``enroot import`` in a job)
"""

from __future__ import annotations

from infra.images.conversion import (
    ENROOT_MISSING,
    IMPORT_CPUS,
    IMPORT_TIME,
    TEMPLATE,
    ConversionPlan,
    convert_image,
    default_import_resources,
    plan_conversion,
    render_import_script,
)
from infra.images.copying import SourceInfo, copy_image, copy_policy, new_hasher, probe_source
from infra.images.credentials import LOGIN_REQUIRED, NETRC_HOSTS, PASSWORD_ENV, USER_ENV, netrc_hosts, registry_login
from infra.images.errors import (
    EnrootNotFound,
    ImageCorrupted,
    ImageDestinationError,
    ImageError,
    ImageNotFound,
    ImageSourceError,
    ImageVerificationError,
    RegistryCredentialsError,
)
from infra.images.references import (
    DIGEST,
    REFERENCE,
    REGISTRY,
    REPOSITORY,
    TAG,
    DockerRef,
    is_docker_source,
    parse_docker_ref,
    resolve_region,
)
from infra.images.squashfs import (
    COMPRESSORS,
    NO_TABLE,
    SQUASHFS_MAGIC,
    SUPERBLOCK,
    SUPERBLOCK_SIZE,
    Superblock,
    check_filesystem,
    check_superblock,
    read_superblock,
)
from infra.images.staged import (
    SIDECAR_SUFFIX,
    LogSink,
    StagedImage,
    cached_image,
    check_free_space,
    destination_name,
    read_sidecar,
    sidecar_uri,
)
from infra.transfer import human_bytes, public_uri

__all__ = [
    "COMPRESSORS",
    "DIGEST",
    "ENROOT_MISSING",
    "IMPORT_CPUS",
    "IMPORT_TIME",
    "LOGIN_REQUIRED",
    "NETRC_HOSTS",
    "NO_TABLE",
    "PASSWORD_ENV",
    "REFERENCE",
    "REGISTRY",
    "REPOSITORY",
    "SIDECAR_SUFFIX",
    "SQUASHFS_MAGIC",
    "SUPERBLOCK",
    "SUPERBLOCK_SIZE",
    "TAG",
    "TEMPLATE",
    "USER_ENV",
    "ConversionPlan",
    "DockerRef",
    "EnrootNotFound",
    "ImageCorrupted",
    "ImageDestinationError",
    "ImageError",
    "ImageNotFound",
    "ImageSourceError",
    "ImageVerificationError",
    "LogSink",
    "RegistryCredentialsError",
    "SourceInfo",
    "StagedImage",
    "Superblock",
    "cached_image",
    "check_filesystem",
    "check_free_space",
    "check_superblock",
    "convert_image",
    "copy_image",
    "copy_policy",
    "default_import_resources",
    "destination_name",
    "human_bytes",
    "is_docker_source",
    "netrc_hosts",
    "new_hasher",
    "parse_docker_ref",
    "plan_conversion",
    "probe_source",
    "public_uri",
    "read_sidecar",
    "read_superblock",
    "registry_login",
    "render_import_script",
    "resolve_region",
    "sidecar_uri",
]
