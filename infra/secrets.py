"""Credentials by reference: a flow parameter names a secret, the transfer that needs it reads it.

    https://storage.googleapis.com/bucket/shard.jsonl.zst?<secret:slimpajama-signed-query>
    https://<env:MIRROR_USER>:<env:MIRROR_PASSWORD>@mirror.example.com/data/shard.jsonl.zst
    https://host/file.jsonl.zst?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature=<env:SIGNATURE>

Prefect stores every flow run's parameters in its database and shows them in the UI, so a
signed URL or a ``user:password@`` given as a parameter would sit there in clear for as long as
the run is kept. Here a parameter carries a *reference* instead, and only the code that makes
the request (infra/transfer/http_source.py) replaces it with the value, in memory, for that request:

* ``<secret:NAME>``: the value of the Prefect Secret block ``NAME``
  (``prefect block create secret`` in the UI, or ``Secret(value=...).save("NAME")``). Prefect keeps
  block values encrypted (Fernet; set ``PREFECT_SERVER_ENCRYPTION_KEY`` on the server so the key
  is not in the same database) and masks them in the UI.
* ``<env:NAME>``: the environment variable ``NAME`` of the process doing the transfer (the flow
  run: set it on the worker, or in the work pool's job variables from a Kubernetes Secret).

A reference stands for text, anywhere in the string: a whole query (``?<secret:q>``), one query
value, a password. The value is inserted as it is, so store it as it appears in a URL
(percent-encoded). Angle brackets are not valid in URLs, so a reference never collides with a real
URL, nor with ``{chunk}``/``{shard}`` templates or globs (infra/sources.py). Resolved values are
remembered for the rest of the process (:func:`resolved_values`) and infra.settings.redact hides
them from every log line, error and record that passes it.

:func:`check_no_credentials` (and the :data:`CredentialFree` type for config models) refuses a
literal credential in a parameter before anything is stored: user info in a URL (``scheme://user:
password@``, ``user:password@registry``) and query parameters of http(s) URLs other than a few
known harmless ones (``download``, ``alt``, ``generation``, ``revision``, ...) unless their values
are references. The same rule is the ``pattern`` of the JSON schema, so a Prefect server that
enforces a deployment's parameter schema refuses such a flow run before storing it, whether it
comes from the UI, the API or ``prefect deployment run``.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Annotated
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from pydantic import AfterValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

# --------------------------------------------------------------------------- the reference syntax

KINDS = ("env", "secret")
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
# In the JSON-schema pattern below too: keep it free of Python-only syntax (JavaScript runs it in the UI).
REF = rf"<(?:env|secret):{_NAME}>"
REFERENCE = re.compile(rf"<(env|secret):({_NAME})>")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Query parameters that never carry a credential and that real download links use
# (Hugging Face "?download=true", GCS JSON API "alt=media" / "generation=N", git refs).
SAFE_QUERY_NAMES = ("download", "alt", "generation", "revision", "ref", "dl", "raw", "format")

_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
_USERINFO_OK = rf"(?:(?:{REF}|[^:/?#@<>]*):)?{REF}"
_SAFE = "(?:" + "|".join(SAFE_QUERY_NAMES) + ")"
_PAIR_OK = rf"(?:[^=&#]+={REF}|{_SAFE}(?:=[^&#]*)?)"
_QUERY_OK = rf"(?:{REF}|{_PAIR_OK}(?:&{_PAIR_OK})*)"
# Each rule is a "bad" shape; the pattern is the conjunction of their negations.
_BAD_USERINFO = rf"{_SCHEME}(?!{_USERINFO_OK}@)[^/?#@]*@"
_BAD_QUERY = rf"[hH][tT][tT][pP][sS]?://[^?#]*\?(?!{_QUERY_OK}?(?:#|$))"
_BAD_REGISTRY_LOGIN = r"[^/@:]+:[^/@]*@"  # user:password@registry/image (no scheme)
NO_CREDENTIALS_PATTERN = rf"^(?!{_BAD_USERINFO})(?!{_BAD_QUERY})(?!{_BAD_REGISTRY_LOGIN})"
_ALLOWED = re.compile(NO_CREDENTIALS_PATTERN, re.DOTALL)
_IS_BAD_USERINFO = re.compile(_BAD_USERINFO)
_IS_BAD_REGISTRY_LOGIN = re.compile(_BAD_REGISTRY_LOGIN)

CREDENTIAL_ERROR = "credential_literal"


class SecretError(ValueError):
    """A reference cannot be resolved; the message names the reference, never a value."""


# --------------------------------------------------------------------------- resolution


def references(text: str) -> list[tuple[str, str]]:
    """The ``(kind, name)`` references in ``text``, in order."""
    return REFERENCE.findall(text)


def has_references(text: str) -> bool:
    return REFERENCE.search(text) is not None


def load_secret_block(name: str) -> str:
    """The value of the Prefect Secret block ``name`` (through the Prefect API of this process)."""
    from prefect.blocks.system import Secret

    try:
        block = Secret.load(name, _sync=True)
    except ValueError:  # Prefect: "Unable to find block document named ..."
        raise SecretError(
            f"<secret:{name}>: no Prefect Secret block named {name!r} on this Prefect server "
            f"(create it in the UI, or: Secret(value=...).save({name!r}))"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the API is down, auth refused: one line naming the reference
        raise SecretError(f"<secret:{name}>: cannot read the Secret block: {type(exc).__name__}") from None
    value = block.value.get_secret_value()
    if not isinstance(value, str):
        raise SecretError(f"<secret:{name}>: the Secret block holds a {type(value).__name__}, not a string")
    return value


_resolved: set[str] = set()
_blocks: dict[str, str] = {}
_lock = threading.Lock()


def resolve(
    text: str,
    *,
    environ: Mapping[str, str] | None = None,
    load_block: Callable[[str], str] | None = None,
) -> str:
    """``text`` with every reference replaced by its value; unchanged when it has none.

    ``environ`` (default ``os.environ``) and ``load_block`` (default: Prefect's Secret block) are
    parameters so tests can run this without a server. A Secret block is read once per process.
    Raises :class:`SecretError` naming the first reference that cannot be resolved.
    """
    if "<" not in text:
        return text
    environ = os.environ if environ is None else environ

    def value_of(match: re.Match) -> str:
        kind, name = match.groups()
        if kind == "env":
            if not _ENV_NAME.fullmatch(name):
                raise SecretError(f"<env:{name}>: {name!r} is not an environment variable name")
            value = environ.get(name)
            if not value:
                raise SecretError(
                    f"<env:{name}>: environment variable {name} is not set (or empty) in the process doing the "
                    "transfer (the flow run: set it on the worker or in the work pool's job variables)"
                )
        else:
            with _lock:
                cached = _blocks.get(name) if load_block is None else None
            if cached is None:
                value = (load_block or load_secret_block)(name)
                if not value:
                    raise SecretError(f"<secret:{name}>: the Secret block is empty")
                if load_block is None:
                    with _lock:
                        _blocks[name] = value
            else:
                value = cached
        remember(value)
        return value

    return REFERENCE.sub(value_of, text)


def remember(value: str) -> None:
    """Redact ``value`` from now on, with the forms it takes inside URLs and messages.

    A resolved query string is also remembered parameter by parameter (a client may print one
    value alone); values under 8 characters are not, since hiding "900" everywhere would only
    garble the logs (the query-string rule of infra.transfer.redact hides them in URLs anyway).
    """
    forms = {value, unquote(value), quote(value, safe="")}
    if "=" in value:
        forms |= {v for _, v in parse_qsl(value, keep_blank_values=True) if len(v) >= 8}
        forms |= {quote(v, safe="") for _, v in parse_qsl(value, keep_blank_values=True) if len(v) >= 8}
    with _lock:
        _resolved.update(f for f in forms if f)


def resolved_values() -> list[str]:
    """Every value resolved in this process (longest first, so a value hides before its parts do)."""
    with _lock:
        return sorted(_resolved, key=len, reverse=True)


def forget() -> None:
    """Drop cached Secret blocks and remembered values (tests)."""
    with _lock:
        _resolved.clear()
        _blocks.clear()


# --------------------------------------------------------------------------- the validator


class CredentialInParameter(ValueError):
    """A parameter holds a credential literally; the message says how to pass it by reference."""


def _shown(value: str) -> str:
    """``value`` with its user info and query hidden: what an error may repeat."""
    if "://" in value:
        parts = urlsplit(value)
        netloc = ("***@" if "@" in parts.netloc else "") + parts.netloc.rpartition("@")[2]
        query = "?***" if parts.query else ""
        return f"{parts.scheme}://{netloc}{parts.path}{query}"
    if _IS_BAD_REGISTRY_LOGIN.match(value):
        return "***@" + value.split("@", 1)[1]
    return value


def _bad_query_names(value: str) -> list[str]:
    query = urlsplit(value).query
    names = []
    for pair in query.split("&"):
        name, _, item = pair.partition("=")
        if name in SAFE_QUERY_NAMES or re.fullmatch(REF, item) or re.fullmatch(REF, pair):
            continue
        names.append(name or "(empty)")
    return names


def credential_problem(value: str) -> str | None:
    """Why ``value`` may hold a credential literally (one line, without the value), or None."""
    if _ALLOWED.match(value):
        return None
    shown = _shown(value)
    hint = (
        "keep the credential in a Prefect Secret block and write <secret:NAME> in its place (or <env:NAME>, "
        "an environment variable of the flow run)"
    )
    if _IS_BAD_USERINFO.match(value) or _IS_BAD_REGISTRY_LOGIN.match(value):
        if value.startswith("docker://") or "://" not in value:
            return (
                f"{shown!r} holds a registry login (user:password@): set NEMOFLOW_REGISTRY_USER and "
                "NEMOFLOW_REGISTRY_PASSWORD (or NGC_API_KEY) for the import job instead"
            )
        parts = urlsplit(value)
        example = f"{parts.scheme}://user:<secret:NAME>@{parts.netloc.rpartition('@')[2]}{parts.path}"
        return f"{shown!r} holds user info (user:password@), which Prefect would store: {hint}, e.g. {example!r}"
    names = ", ".join(_bad_query_names(value))
    parts = urlsplit(value)
    example = f"{parts.scheme}://{parts.netloc}{parts.path}?<secret:NAME>"
    return (
        f"{shown!r} has query parameters that may be credentials ({names}), which Prefect would store: "
        f"{hint}, e.g. {example!r} with the query string in the block"
    )


def check_no_credentials(value: str, what: str = "value") -> str:
    """``value`` unchanged, or :class:`CredentialInParameter` naming ``what`` and the reference to use."""
    problem = credential_problem(value)
    if problem is not None:
        raise CredentialInParameter(f"{what}: {problem}")
    return value


def _validate(value: str) -> str:
    problem = credential_problem(value)
    if problem is not None:
        # A custom error type: callers that echo the input (nemoflow/options.py) leave it out for this one.
        raise PydanticCustomError(CREDENTIAL_ERROR, "{problem}", {"problem": problem})
    return value


# A string field that refuses literal credentials (pydantic) and whose JSON schema says the same
# (a Prefect server enforcing a deployment's parameter schema refuses the run before storing it).
CredentialFree = Annotated[
    str,
    AfterValidator(_validate),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": NO_CREDENTIALS_PATTERN,
            "description": "credentials (signed query strings, user:password@) only by reference: "
            "<secret:PREFECT_SECRET_BLOCK> or <env:VARIABLE>",
        }
    ),
]
