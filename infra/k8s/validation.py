"""Kubernetes' own rules for names, labels and quantities, checked before anything is built or written.

The API server would refuse a bad value too, but only at submit time, one object at
a time, and ``nemoflow render`` has no API server at all. The rules and their wording
follow k8s.io/apimachinery (``validation.IsDNS1123Label``, ``IsDNS1123Subdomain``,
``IsDNS1035Label``, ``IsQualifiedName``, ``IsValidLabelValue``) and
``resource.Quantity``'s grammar; each check raises :class:`ValueError` whose message
starts with the field's name, so a user sees which setting to fix::

    >>> dns1123_label("Bad_Namespace!", "k8s.namespace")
    Traceback (most recent call last):
    ...
    ValueError: k8s.namespace 'Bad_Namespace!' is not a valid name: ...
"""

from __future__ import annotations

import re
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = re.compile(rf"^{_LABEL}$")
_DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_DNS1035_LABEL = re.compile(r"^[a-z](?:[-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME_PART = re.compile(r"^(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(?:(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# resource.Quantity: <sign><digits[.digits]><binarySI | decimalSI | e<exponent>>
_QUANTITY = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")

LABEL_RULE = "lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"
SUBDOMAIN_RULE = (
    "lowercase letters, digits, '-' and '.', each dot-separated part starting and ending with a letter "
    "or digit, at most 253 characters"
)


def _fail(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"{field} {value!r} is not valid: {why}")


def dns1123_label(value: str, field: str) -> str:
    """Namespaces, Service-like names, container and port names."""
    if len(value) > 63 or not _DNS1123_LABEL.match(value):
        raise ValueError(f"{field} {value!r} is not a valid name: a DNS-1123 label has {LABEL_RULE} (e.g. 'team-llm')")
    return value


def dns1035_label(value: str, field: str) -> str:
    """Service names: a DNS-1123 label that starts with a letter."""
    if len(value) > 63 or not _DNS1035_LABEL.match(value):
        raise ValueError(
            f"{field} {value!r} is not a valid Service name: a DNS-1035 label starts with a lowercase letter "
            f"and has {LABEL_RULE} (e.g. 'llm-serve')"
        )
    return value


def dns1123_subdomain(value: str, field: str) -> str:
    """Most object names: PVCs, Secrets, ServiceAccounts, Jobs, Deployments, storage classes."""
    if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
        raise ValueError(
            f"{field} {value!r} is not a valid name: a DNS-1123 subdomain has {SUBDOMAIN_RULE} (e.g. 'nemo-workspace')"
        )
    return value


def qualified_name(value: str, field: str) -> str:
    """Label and annotation keys: ``[prefix/]name``, prefix a DNS subdomain, name at most 63 characters."""
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        raise _fail(field, value, f"the prefix before '/' must be a DNS-1123 subdomain ({SUBDOMAIN_RULE})")
    if len(name) > 63 or not _QUALIFIED_NAME_PART.match(name):
        raise _fail(
            field,
            value,
            "a label key is [prefix/]name, name at most 63 characters of letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit (e.g. 'team' or 'example.com/team')",
        )
    return value


def label_value(value: str, field: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise _fail(
            field,
            value,
            "a label value is empty or at most 63 characters of letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit",
        )
    return value


def labels(values: dict[str, str], field: str) -> dict[str, str]:
    for key, value in values.items():
        qualified_name(key, f"{field} key")
        label_value(value, f"{field}[{key!r}]")
    return values


def env_name(value: str, field: str) -> str:
    if not _ENV_NAME.match(value):
        raise _fail(
            field, value, "environment variable names are letters, digits, '_', '-' and '.', not starting with a digit"
        )
    return value


def secret_key(value: str, field: str) -> str:
    if len(value) > 253 or not _SECRET_KEY.match(value):
        raise _fail(field, value, "a Secret key is letters, digits, '-', '_' and '.'")
    return value


def quantity(value: str | int | float, field: str, *, positive: bool = True) -> Decimal:
    """The value of a Kubernetes quantity (``64Gi``, ``500m``, ``1e9``); raises naming ``field``."""
    text = str(value).strip() if isinstance(value, int | float) else value
    if not isinstance(text, str) or not _QUANTITY.match(text):
        raise ValueError(
            f"{field} {value!r} is not a Kubernetes quantity: a number with an optional suffix "
            "Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024), k, M, G, T, P, E (powers of 1000) or m (e.g. 64Gi, 512Mi, 1Ti)"
        )
    amount = Decimal(parse_quantity(text))
    if positive and amount <= 0:
        raise ValueError(f"{field} {value!r} must be more than zero")
    return amount


def absolute_path(value: str, field: str) -> str:
    if not value.startswith("/") or ":" in value:
        raise _fail(field, value, "a mount path is an absolute path without ':' (e.g. /nemo-workspace)")
    return value
