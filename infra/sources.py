"""Turn a dataset source specification into the exact list of files to download.

    expand_sources("https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/"
                   "train/chunk{chunk}/example_train_{shard}.jsonl.zst", chunks="1-2", shards="0,3")
    # -> 4 sources; the second is .../train/chunk1/example_train_3.jsonl.zst
    #    with name "chunk1/example_train_3.jsonl.zst"

A specification is one of

* a list of URIs or paths (``https://``, ``http://``, ``gs://``, ``file://``, plain paths);
* a glob (``gs://bucket/raw/*.jsonl.zst``, ``/data/**/*.jsonl``), expanded through fsspec;
* a URL template with ``{chunk}`` and/or ``{shard}`` placeholders, filled from ranges such
  as ``"1-10"`` or ``"0,3,5-7"``; a format spec pads numbers: ``part-{shard:05d}.jsonl``.

Each :class:`Source` carries a ``name``: the relative path the file gets under the download
directory. It keeps the part of the path that tells files apart (``chunk1/example_train_0``),
so two chunks' ``example_train_0`` never overwrite each other.
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlsplit

from pydantic import BaseModel

SUPPORTED_SCHEMES = ("https", "http", "gs", "file")
PLACEHOLDERS = ("chunk", "shard")
_GLOB_CHARS = re.compile(r"[*?\[]")
# {chunk}, {shard}, or with a format spec: {shard:05d} (C4's "c4-train.{shard:05d}-of-01024.json.gz").
_FIELD = re.compile(r"\{([^{}:]*)(?::([^{}]*))?\}")


class Source(BaseModel):
    url: str
    name: str  # relative path under the download directory, e.g. "chunk1/example_train_0.jsonl.zst"


class SourceError(ValueError):
    """A source specification cannot be expanded; the message names the bad part."""


def parse_range(text: str, what: str = "range") -> list[int]:
    """``"0,3,5-7"`` -> ``[0, 3, 5, 6, 7]`` (sorted, without duplicates)."""
    values: set[int] = set()
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not str(text).strip() or any(not p for p in parts):
        raise SourceError(f"bad {what} {text!r}: expected numbers and ranges like '1-10' or '0,3,5-7'")
    for part in parts:
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise SourceError(f"bad {what} {text!r}: {part!r} is not a number or a range like '5-7'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise SourceError(f"bad {what} {text!r}: {part!r} runs backwards")
        values.update(range(lo, hi + 1))
    return sorted(values)


def _scheme(uri: str) -> str:
    if "://" not in uri:
        return "file"
    proto = uri.split("://", 1)[0].lower()
    if proto not in SUPPORTED_SCHEMES:
        raise SourceError(
            f"unsupported scheme {proto!r} in {uri!r}: supported are {', '.join(SUPPORTED_SCHEMES)} and plain paths"
        )
    return proto


def _path_of(uri: str) -> str:
    """The path part of a URI (no scheme, host or query), used to derive names."""
    proto = _scheme(uri)
    if proto == "file":
        return uri[len("file://") :] if uri.startswith("file://") else uri
    if proto == "gs":
        return "/" + uri.split("://", 1)[1]  # bucket/object
    return urlsplit(uri).path


def _names_for(urls: list[str]) -> list[str]:
    """Names relative to the deepest directory all ``urls`` share (basenames when they share one)."""
    paths = [_path_of(u) for u in urls]
    dirs = [posixpath.dirname(p) for p in paths]
    try:
        common = posixpath.commonpath(dirs) if dirs else ""
    except ValueError:  # mix of absolute and relative paths
        common = ""
    names = [posixpath.relpath(p, common) if common else p.lstrip("/") for p in paths]
    seen: dict[str, str] = {}
    for url, name in zip(urls, names):
        if name in seen:
            raise SourceError(f"two sources would be saved under the same name {name!r}: {seen[name]} and {url}")
        seen[name] = url
    return names


def _expand_glob(pattern: str) -> list[Source]:
    proto = _scheme(pattern)
    if proto in ("http", "https"):
        raise SourceError(f"cannot expand a glob over {proto}: {pattern!r}; list the URLs or use a template")
    from infra import storage, transfer

    fs, path = storage.url_to_fs(pattern)
    if proto == "gs":
        fs = transfer.gcs_filesystem()
        try:
            matches = transfer.remote_call(lambda: fs.glob(path, detail=True), pattern, what="list")
        except transfer.TransferError as exc:
            raise SourceError(f"cannot expand {pattern!r}: {exc}") from None
    else:
        matches = fs.glob(path, detail=True)
    files = sorted(p for p, meta in matches.items() if meta.get("type") != "directory")
    if not files:
        raise SourceError(f"glob {pattern!r} matched no files")
    # Names are relative to the pattern's literal prefix, so '/data/**/*.jsonl' keeps sub-folders.
    literal = _GLOB_CHARS.split(path, 1)[0]
    base = literal if literal.endswith("/") else posixpath.dirname(literal)
    out = []
    for p in files:
        uri = storage.to_uri(fs, p)
        out.append(Source(url=uri, name=posixpath.relpath(p, base) if base else posixpath.basename(p)))
    return out


def _format(value: int, spec: str | None, template: str) -> str:
    try:
        return format(value, spec or "")
    except ValueError as exc:
        raise SourceError(f"bad format spec {spec!r} in {template!r}: {exc}") from None


def _expand_template(template: str, chunks: str | None, shards: str | None) -> list[Source]:
    fields = [name for name, _ in _FIELD.findall(template)]
    unknown = sorted({f for f in fields if f not in PLACEHOLDERS})
    if unknown:
        raise SourceError(
            f"unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)} in {template!r}; "
            f"supported: {{chunk}}, {{shard}}"
        )
    _scheme(template)
    given = {"chunk": chunks, "shard": shards}
    ranges: dict[str, list[int]] = {}
    for field in PLACEHOLDERS:
        if field in fields:
            if given[field] is None:
                raise SourceError(
                    f"{template!r} has a {{{field}}} placeholder but no {field} range was given "
                    f"(e.g. {field}s='1-10' or '0,3,5-7')"
                )
            ranges[field] = parse_range(given[field], f"{field} range")
        elif given[field] is not None:
            raise SourceError(f"a {field} range ({given[field]!r}) was given but {template!r} has no {{{field}}}")
    # The name starts at the first path segment holding a placeholder: "chunk{chunk}/example_train_{shard}..."
    path = _path_of(template)
    segments = path.split("/")
    first = next(i for i, seg in enumerate(segments) if _FIELD.search(seg))
    name_template = "/".join(segments[first:])
    out = []
    for c in ranges.get("chunk", [None]):
        for s in ranges.get("shard", [None]):
            values = {"chunk": c, "shard": s}
            out.append(Source(url=_fill(template, values), name=_fill(name_template, values, template)))
    return out


def _fill(text: str, values: dict, template: str | None = None) -> str:
    """``text`` with its ``{chunk}``/``{shard}`` placeholders filled (errors name ``template``)."""
    return _FIELD.sub(lambda m: _format(values[m.group(1)], m.group(2), template or text), text)


def expand_sources(spec: str | list[str], chunks: str | None = None, shards: str | None = None) -> list[Source]:
    """The files a specification names, in a deterministic order (chunk, then shard; sorted globs)."""
    if isinstance(spec, (list, tuple)):
        items = [str(s).strip() for s in spec if str(s).strip()]
        if not items:
            raise SourceError("the source list is empty")
        if any(_FIELD.search(s) for s in items):
            if len(items) == 1:
                return _expand_template(items[0], chunks, shards)
            raise SourceError("a URL template ({chunk}/{shard}) must be given alone, not inside a list")
        out: list[Source] = []
        plain: list[str] = []
        for item in items:
            _scheme(item)
            if _GLOB_CHARS.search(_path_of(item)):
                out.extend(_expand_glob(item))
            else:
                plain.append(item)
        if plain:
            out.extend(Source(url=u, name=n) for u, n in zip(plain, _names_for(plain)))
        names: dict[str, str] = {}
        for src in out:
            if src.name in names:
                raise SourceError(
                    f"two sources would be saved under the same name {src.name!r}: {names[src.name]} and {src.url}"
                )
            names[src.name] = src.url
        return out
    spec = str(spec).strip()
    if not spec:
        raise SourceError("the source specification is empty")
    if _FIELD.search(spec):
        return _expand_template(spec, chunks, shards)
    if chunks is not None or shards is not None:
        raise SourceError(f"chunk/shard ranges were given but {spec!r} has no {{chunk}} or {{shard}} placeholder")
    return expand_sources([spec])


def local_name(source: Source) -> str:
    """``source.name`` as a safe relative path (no '..', no absolute path)."""
    norm = posixpath.normpath(source.name)
    if norm.startswith("../") or norm == ".." or os.path.isabs(norm):
        raise SourceError(f"source name {source.name!r} escapes the download directory")
    return norm
