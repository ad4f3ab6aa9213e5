"""One transfer stack for every download and copy: probe a source, copy it resumably and verified.

    from infra import transfer
    remote = transfer.probe("gs://bucket/raw/shard.jsonl.zst")       # size, validators, checksums
    sink = transfer.FileSink("/data/raw/shard.jsonl.zst.part")
    copied = transfer.ResumableCopy(remote, sink, kinds={"sha256"}).run(transfer.COPY)
    copied.hashes["sha256"], copied.size

Sources: ``https://`` / ``http://`` (requests, streamed), ``gs://`` (gcsfs, one range request per
block), ``file://`` or a plain path. infra/fetch.py (dataset shards, with sidecars and resume across
calls) and infra/images/ (container images, with squashfs checks) are thin layers over this.

What it does, and why here once:

* **probe** (:func:`probe`): size, ETag / Last-Modified / generation (the validators a resume needs)
  and every checksum the source states: GCS md5Hash/crc32c; HTTP ``x-goog-hash``, ``Content-MD5`` (of
  a whole body only), Hugging Face's ``X-Linked-Etag`` sha256 (and its ETag on the hub itself),
  optionally an md5-looking ETag (S3/GCS XML single-part uploads). A server that refuses HEAD is
  asked for one byte instead.
* **resumable copy** (:class:`ResumableCopy`): blocks go from the source to a :class:`Sink` while a
  second thread hashes and writes them, so network, checksum and disk overlap. A dropped connection
  continues at the next byte: HTTP ``Range`` + ``If-Range`` (a file replaced meanwhile is never
  spliced), a range request on GCS after checking the object's generation, a seek for files. A
  ``pinned`` copy (images) refuses a source that changed; an unpinned one (shards) starts again.
* **verification**: size against what the source announced and every stated checksum, before the
  caller commits anything under a final name.
* **retries** through :mod:`infra.retry` policies (tenacity): transport errors, 408/429/5xx and
  Retry-After are retried within a time budget; 404, 401/403, bad URLs and full disks fail at once;
  an unresolvable host is retried only briefly. gcsfs's own retry loop (six attempts, ~30 s and a
  logged traceback per call) is switched off for the transfer's requests, so one policy decides.
* **redaction** (:func:`redact`, :func:`public_uri`): settings secrets, URL passwords and
  query-string values (signed URLs) never reach a log line, an error or a record.
* **credentials by reference** (infra/secrets.py): a URL may hold ``<secret:NAME>`` (a Prefect
  Secret block) or ``<env:NAME>`` in place of a query, a query value or a password. Callers and
  records keep that form; only the HTTP request itself is made with the values (:func:`request_url`),
  and the values are then hidden by :func:`redact` as well.
* **errors** are :class:`TransferError` subclasses with one-line messages that name the source
  (``gs://bucket/object``) and the cause; callers turn them into their own error types.

One module per concern; callers import the package (``from infra import transfer``), which names them all:

* ``errors.py``       the :class:`TransferError` kinds and the give-up message (:func:`unreachable`)
* ``redaction.py``    :func:`redact`, :func:`public_uri`
* ``checksums.py``    digests as sources state them (base64, ETags) and as we compute them (:class:`MultiHash`)
* ``remote.py``       :func:`scheme` and :class:`Remote`, what a source says about itself
* ``gcs.py``          gcsfs with a single attempt per request, its failures as transfer errors
* ``http_source.py``  requests: credentials for the request only, stated checksums, status errors, the HTTP probe
* ``probe.py``        :func:`probe`, :func:`remote_call`, :func:`server_side_copy` under the ``PROBE`` policy
* ``sinks.py``        :class:`FileSink`, :class:`FsspecSink`, free space, a refused write as one line
* ``resumable.py``    :class:`ResumableCopy` under the ``COPY`` policy
"""

from __future__ import annotations

# Transient and describe come from infra.retry; callers classify a copy's retries with them through this package.
from infra.retry import Transient, describe
from infra.transfer.checksums import CHUNK, MultiHash, b64_to_hex, hash_file, hex_to_b64, new_hasher, strip_etag
from infra.transfer.errors import (
    AccessDenied,
    ContentMismatch,
    DestinationError,
    NoSpace,
    SourceChanged,
    SourceNotFound,
    SourceUnreachable,
    TransferError,
    Unsupported,
    human_bytes,
    unreachable,
)
from infra.transfer.gcs import gcs_filesystem, gcs_stat, split_gs
from infra.transfer.http_source import HF_HOSTS, auth_headers, auth_hint, is_hf_host, stated_checksums
from infra.transfer.probe import PROBE, probe, remote_call, server_side_copy
from infra.transfer.redaction import public_uri, redact
from infra.transfer.remote import SCHEMES, Log, Remote, scheme
from infra.transfer.resumable import COPY, PIPELINE_BYTES, Copied, OnBlock, ResumableCopy
from infra.transfer.sinks import FileSink, FsspecSink, Sink, check_free_space, open_sink, sink_failure

__all__ = [
    "CHUNK",
    "COPY",
    "HF_HOSTS",
    "PIPELINE_BYTES",
    "PROBE",
    "SCHEMES",
    "AccessDenied",
    "ContentMismatch",
    "Copied",
    "DestinationError",
    "FileSink",
    "FsspecSink",
    "Log",
    "MultiHash",
    "NoSpace",
    "OnBlock",
    "Remote",
    "ResumableCopy",
    "Sink",
    "SourceChanged",
    "SourceNotFound",
    "SourceUnreachable",
    "TransferError",
    "Transient",
    "Unsupported",
    "auth_headers",
    "auth_hint",
    "b64_to_hex",
    "check_free_space",
    "describe",
    "gcs_filesystem",
    "gcs_stat",
    "hash_file",
    "hex_to_b64",
    "human_bytes",
    "is_hf_host",
    "new_hasher",
    "open_sink",
    "probe",
    "public_uri",
    "redact",
    "remote_call",
    "scheme",
    "server_side_copy",
    "sink_failure",
    "split_gs",
    "stated_checksums",
    "strip_etag",
    "unreachable",
]
