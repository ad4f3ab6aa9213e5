"""A Kubernetes API stand-in that answers what prefect-kubernetes' worker and nemoflow's backend ask.

No API server can run on this machine, so tests talk to kmock (an in-memory API over HTTP).
kmock 0.8 stores objects and streams watches, but leaves out parts of the API that real
clients rely on. :class:`KubeApi` extends its emulator with them, following the API's
documented behaviour (https://kubernetes.io/docs/reference/using-api/api-concepts/):

- ``metadata.generateName``: the server picks a unique name with that prefix (5 random
  characters, as the API server does); a create without name or generateName is 422;
- ``metadata.uid``, ``creationTimestamp``, a cluster-wide increasing ``resourceVersion`` on every
  write, list ``metadata.resourceVersion``; a new Pod is ``Pending``, other kinds with a status
  start with ``status: {}``;
- label selectors (``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x)``)
  and field selectors (``=``, ``==``, ``!=`` on the fields the API supports per kind; others are
  400 ``field label not supported``) on list AND watch; a watched object that stops matching
  arrives as ``DELETED``, one that starts matching as ``ADDED``, as the API's watch cache does;
- list pages (``limit`` + ``continue``); watches from a ``resourceVersion`` (only the changes
  after it; one older than the last :meth:`KubeApi.compact` is ``410 Gone``), or from now with the
  current objects first as ``ADDED``; ``timeoutSeconds`` ends a watch server-side;
- deletion with ``propagationPolicy``: ``Background`` deletes the object then its dependents
  (objects whose ``ownerReferences`` name its uid), ``Foreground`` marks it (``deletionTimestamp``
  + the ``foregroundDeletion`` finalizer), deletes its dependents, then the object (one without
  dependents goes at once); ``Orphan``
  removes the owner reference from its dependents. Left out, the policy is the resource's default:
  ``Orphan`` for ``batch/v1`` Jobs (kept for compatibility by the API server, which warns about it),
  ``Background`` otherwise. The garbage collector runs as a task, as the real one is a controller;
- Events (``v1`` and ``events.k8s.io/v1``) are an ordinary resource; :meth:`KubeApi.record_event`
  is how the test controller and kubelet report what they did, as a cluster's components do.

What it still does not do: admission, RBAC, defaulting of spec fields, ``metadata.generation`` (so
no controller here reports ``observedGeneration``), strategic merge patch (a
patch is a JSON merge patch), server-side apply, graceful pod termination (a deleted pod is gone
at once), resourceVersion preconditions on update.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import datetime
import re
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import attrs
from kmock._internal import apps, enums, k8s, references, rendering

KubernetesError = k8s.KubernetesError

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

# group/version/plural -> (kind, namespaced, whether a new object gets a status)
KNOWN: dict[str, tuple[str, bool, bool]] = {
    "v1/pods": ("Pod", True, True),
    "v1/services": ("Service", True, True),
    "v1/events": ("Event", True, False),
    "v1/namespaces": ("Namespace", False, True),
    "v1/nodes": ("Node", False, True),
    "v1/secrets": ("Secret", True, False),
    "v1/configmaps": ("ConfigMap", True, False),
    "v1/serviceaccounts": ("ServiceAccount", True, False),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, True),
    "batch/v1/jobs": ("Job", True, True),
    "apps/v1/deployments": ("Deployment", True, True),
    "events.k8s.io/v1/events": ("Event", True, False),
    "kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True, True),
    "serving.knative.dev/v1/services": ("Service", True, True),
}

# The fields each kind can be selected by (the API refuses the others), beyond metadata.name/namespace.
FIELDS: dict[str, set[str]] = {
    "Pod": {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
    "Event": {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    },
    "Secret": {"type"},
    "Job": {"status.successful"},
    "Node": {"spec.unschedulable"},
    "Namespace": {"status.phase"},
}

_KEY = re.compile(r"^([a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?/)?[a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?$")
_VALUE = re.compile(r"^([a-z0-9A-Z]([-a-z0-9A-Z_.]*[a-z0-9A-Z])?)?$")
# the API server's generateName suffix alphabet: no vowels, no look-alike characters
SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bad_request(message: str) -> KubernetesError:
    return KubernetesError(status=400, reason="BadRequest", message=message)


# --- selectors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=" and "notin" match absent keys too


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b`` is two requirements)."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def parse_label_selector(selector: str) -> list[Requirement]:
    """A label selector in the API's string form; ValueError names the part that is not one."""
    requirements: list[Requirement] = []
    if not selector.strip():
        return requirements
    for part in _split_top_level(selector):
        text = part.strip()
        set_match = re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^()]*)\)", text)
        if set_match:
            key, op, raw = set_match.groups()
            values = tuple(v.strip() for v in raw.split(",") if v.strip())
            if not values:
                raise ValueError(f"{text!r}: a set needs at least one value")
            requirements.append(Requirement(key, op, values))
        elif m := re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", text):
            key, op, value = m.groups()
            requirements.append(Requirement(key, "!=" if op == "!=" else "=", (value,)))
        elif m := re.fullmatch(r"!\s*(\S+)", text):
            requirements.append(Requirement(m.group(1), "!"))
        elif re.fullmatch(r"\S+", text):
            requirements.append(Requirement(text, "exists"))
        else:
            raise ValueError(f"{text!r} is not a label requirement")
        last = requirements[-1]
        if not _KEY.match(last.key) or len(last.key.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{last.key!r} is not a valid label key")
        bad = [v for v in last.values if not _VALUE.match(v) or len(v) > 63]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a valid label value")
    return requirements


def parse_field_selector(selector: str, kind: str) -> list[tuple[str, bool, str]]:
    """(field, equal, value) triples; ValueError for a field this kind cannot be selected by."""
    terms: list[tuple[str, bool, str]] = []
    if not selector.strip():
        return terms
    allowed = {"metadata.name", "metadata.namespace"} | FIELDS.get(kind, set())
    for part in selector.split(","):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*", part)
        if not m:
            raise ValueError(f"invalid selector: {part!r}; can't understand it")
        field, op, value = m.groups()
        if field not in allowed:
            raise ValueError(f"field label not supported: {field}")
        terms.append((field, op != "!=", value))
    return terms


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclass(frozen=True)
class Selector:
    labels: tuple[Requirement, ...] = ()
    fields: tuple[tuple[str, bool, str], ...] = ()

    @classmethod
    def from_params(cls, params: dict[str, str], kind: str) -> Selector:
        try:
            return cls(
                tuple(parse_label_selector(params.get("labelSelector", ""))),
                tuple(parse_field_selector(params.get("fieldSelector", ""), kind)),
            )
        except ValueError as exc:
            raise _bad_request(f"unable to parse requirement: {exc}") from None

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((_field(obj, f) == v) == equal for f, equal, v in self.fields)


# --- the API ----------------------------------------------------------------------------------


@dataclass
class _Change:
    rv: int
    resource: references.resource
    namespace: str | None
    type: str  # ADDED, MODIFIED, DELETED
    old: dict[str, Any] | None
    new: dict[str, Any] | None


def _res_key(resource: references.resource) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/")


@attrs.define(kw_only=True)
class KubeApi(k8s.KubernetesEmulator):
    """kmock's emulator with the API behaviour listed in the module docstring.

    Use it as kmock's class: ``pytestmark = pytest.mark.kmock(cls=KubeApi)`` (or the ``kube``
    fixture of tests/k8s/conftest.py). Objects put straight into ``kmock.objects`` get their uid
    and resourceVersion when first read.
    """

    garbage_collect: bool = True
    _rv: int = attrs.field(default=0, init=False)
    _changes: list[_Change] = attrs.field(factory=list, init=False)
    _compacted: int = attrs.field(default=0, init=False)  # watches from at or before this rv: 410
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _created: dict[int, tuple] = attrs.field(factory=dict, init=False)
    _gc_tasks: set[asyncio.Task] = attrs.field(factory=set, init=False)
    generated_names: list[str] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced, _) in KNOWN.items():
            self.resources[key] = references.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=set(VERBS), subresources={"status"}
            )

    # --- bookkeeping ---
    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _info(self, resource: references.resource) -> tuple[str, bool, bool]:
        known = KNOWN.get(_res_key(resource))
        if known:
            return known
        info = self.resources[_res_key(resource)] if resource in self.resources else None
        kind = (info.kind if info and info.kind else resource.plural.capitalize()) if resource.plural else "Object"
        return kind, bool(info.namespaced) if info and info.namespaced is not None else True, True

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    async def _record(self, resource, namespace, type_: str, old, new) -> None:
        """Called under the lock, after the store changed: the change for watches, in rv order."""
        # a deletion is a write of its own: it gets the next resourceVersion
        rv = self._next_rv() if type_ == "DELETED" else int(new["metadata"]["resourceVersion"])
        self._changes.append(_Change(rv, resource, namespace, type_, old, new))
        condition = self._condition()
        async with condition:
            condition.notify_all()

    def compact(self) -> int:
        """Forget the history up to now, as etcd compaction does: older watches get 410 Gone."""
        self._compacted = self._rv
        self._changes.clear()
        return self._rv

    def _stamp(self, key, obj) -> dict[str, Any]:
        """An object's raw dict, giving one put straight into ``objects`` a uid and resourceVersion."""
        raw = obj.raw
        meta = raw.get("metadata") or {}
        if not meta.get("uid") or not meta.get("resourceVersion"):
            resource, namespace, name = key
            obj.patch(
                {
                    "metadata": {
                        "name": name,
                        **({"namespace": namespace} if namespace else {}),
                        "uid": meta.get("uid") or str(uuid.uuid4()),
                        "resourceVersion": str(self._next_rv()),
                        "creationTimestamp": meta.get("creationTimestamp") or _now(),
                    }
                }
            )
            raw = obj.raw
        return raw

    def _live(self, resource, namespace: str | None) -> list[tuple[tuple, Any]]:
        found = []
        for key, obj in list(self._objects.items()):
            res, ns, _ = key
            if res == resource and (namespace is None or ns == namespace) and not obj.deleted:
                found.append((key, obj))
        found.sort(key=lambda item: (item[0][1] or "", item[0][2]))
        return found

    # --- writes ---
    async def _handle(self, request: rendering.Request):
        if request.resource is not None and request.subresource in (None, "status"):
            if request.action == enums.action.CREATE and request.subresource is None:
                async with self._lock:
                    self._created[id(request)] = await self._create(request)
            elif request.action == enums.action.UPDATE and request.name is not None:
                async with self._lock:
                    await self._update(request)
            elif request.action == enums.action.DELETE and request.name is not None:
                async with self._lock:
                    await self._delete(request)
        # kmock's emulator tracks writes itself in its _handle: skip that one, keep the dispatch
        return await apps.RawHandler._handle(self, request)

    def _generate_name(self, resource, namespace, prefix: str) -> str:
        for _ in range(100):
            name = prefix[:58] + "".join(secrets.choice(SUFFIX_ALPHABET) for _ in range(5))
            key = (resource, namespace, name)
            if key not in self._objects or self._objects[key].deleted:
                self.generated_names.append(name)
                return name
        raise KubernetesError(status=409, reason="AlreadyExists", message="no unique name left for " + prefix)

    async def _create(self, request: rendering.Request) -> tuple:
        kind, namespaced, has_status = self._info(request.resource)
        body = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if body is None:
            raise _bad_request(f"the body of a {kind} must be a JSON object")
        meta = body.setdefault("metadata", {})
        namespace = (request.namespace or meta.get("namespace")) if namespaced else None
        if namespaced and request.namespace and meta.get("namespace") not in (None, request.namespace):
            raise _bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise KubernetesError(
                    status=422,
                    reason="Invalid",
                    message=f'{kind} "" is invalid: metadata.name: Required value: name or generateName is required',
                )
            meta["name"] = self._generate_name(request.resource, namespace, meta["generateName"])
        key = (request.resource, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise KubernetesError(
                status=409,
                reason="AlreadyExists",
                message=f'{request.resource.plural}.{request.resource.group or ""} "{meta["name"]}" already exists'.replace(
                    '. "', ' "'
                ),
            )
        if namespace:
            meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = str(self._next_rv())
        meta.pop("deletionTimestamp", None)
        if has_status:
            body.setdefault("status", {"phase": "Pending"} if kind == "Pod" else {})
        if key in self._objects:
            self._objects[key].create(body)
        else:
            self._objects[key] = body
        await self._record(request.resource, namespace, "ADDED", None, self._objects[key].raw)
        return key

    def _existing(self, request: rendering.Request):
        """The request's object and its key; 404 (NotFound) when there is none, or it is being deleted."""
        key = (request.resource, request.namespace, request.name)
        obj = self._objects[key] if key in self._objects else None
        if obj is None or obj.deleted:
            raise k8s.KubernetesObjectNotFoundError(
                message=f'{request.resource.plural} "{request.name}" not found', reason="NotFound"
            )
        return key, obj

    async def _update(self, request: rendering.Request) -> None:
        key, obj = self._existing(request)
        if not isinstance(request.data, dict):
            raise KubernetesError(
                status=415, reason="UnsupportedMediaType", message="only JSON merge patches are emulated"
            )
        old = self._stamp(key, obj)
        if request.method == enums.method.PUT:
            new = copy.deepcopy(request.data)
            if request.subresource == "status":
                new = {**copy.deepcopy(old), "status": new.get("status", {})}
            kept = {k: old["metadata"][k] for k in ("uid", "creationTimestamp", "name") if k in old["metadata"]}
            new.setdefault("metadata", {}).update(kept)
            obj.create(new)
        else:
            obj.patch(copy.deepcopy(request.data))
        obj.patch({"metadata": {"resourceVersion": str(self._next_rv())}})
        new_raw = obj.raw
        meta = new_raw.get("metadata") or {}
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # the last finalizer went: the object goes
            obj.delete()
            await self._record(key[0], key[1], "DELETED", old, None)
            return
        await self._record(key[0], key[1], "MODIFIED", old, new_raw)

    def _policy(self, request: rendering.Request) -> str:
        options = request.data if isinstance(request.data, dict) else {}
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy")
        orphan = options.get("orphanDependents", request.params.get("orphanDependents"))
        if policy is None and orphan is not None:
            policy = "Orphan" if str(orphan).lower() == "true" else "Background"
        if policy is None:
            # batch/v1 Jobs keep their pods unless told otherwise (the API server's legacy default)
            policy = "Orphan" if _res_key(request.resource) == "batch/v1/jobs" else "Background"
        if policy not in ("Orphan", "Background", "Foreground"):
            raise _bad_request(f"propagationPolicy {policy!r} is not one of Orphan, Background, Foreground")
        return policy

    async def _delete(self, request: rendering.Request) -> None:
        key, _ = self._existing(request)
        await self.delete_object(key, self._policy(request))

    async def delete_object(self, key, policy: str = "Background") -> None:
        """Delete as the API does (call with the lock held): see the module docstring."""
        obj = self._objects[key]
        old = self._stamp(key, obj)
        meta = old.get("metadata") or {}
        uid = meta.get("uid")
        if meta.get("deletionTimestamp"):
            return  # already being deleted
        finalizers = list(meta.get("finalizers") or [])
        # Foreground with nothing to wait for ends as the collector would end it, without the wait
        if policy == "Foreground" and self.garbage_collect and self._dependents(uid):
            finalizers.append("foregroundDeletion")
        if finalizers:
            obj.patch(
                {
                    "metadata": {
                        "deletionTimestamp": _now(),
                        "finalizers": finalizers,
                        "resourceVersion": str(self._next_rv()),
                    }
                }
            )
            await self._record(key[0], key[1], "MODIFIED", old, obj.raw)
        if policy == "Orphan":
            for dep_key, dep in self._dependents(uid):
                dep_old = dep.raw
                refs = [r for r in dep_old["metadata"]["ownerReferences"] if r.get("uid") != uid]
                dep.patch({"metadata": {"ownerReferences": refs or None, "resourceVersion": str(self._next_rv())}})
                await self._record(dep_key[0], dep_key[1], "MODIFIED", dep_old, dep.raw)
        if not finalizers:
            obj.delete()
            await self._record(key[0], key[1], "DELETED", old, None)
        if policy in ("Background", "Foreground") and self.garbage_collect:
            task = asyncio.get_running_loop().create_task(self._collect(key, uid, policy))
            self._gc_tasks.add(task)
            task.add_done_callback(self._gc_tasks.discard)

    def _dependents(self, uid: str | None) -> list[tuple[tuple, Any]]:
        if not uid:
            return []
        found = []
        for key, obj in list(self._objects.items()):
            if obj.deleted:
                continue
            refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                found.append((key, obj))
        return found

    async def _collect(self, owner_key, uid: str | None, policy: str) -> None:
        """The garbage collector: delete an owner's dependents, then (Foreground) the owner itself."""
        await asyncio.sleep(0.05)  # a controller: it acts after the API call returned
        async with self._lock:
            for dep_key, dep in self._dependents(uid):
                if not dep.deleted:
                    await self.delete_object(dep_key, policy)
        if policy != "Foreground":
            return
        # the owner goes once no dependent that blocks it is left (they may be in Foreground themselves)
        while True:
            async with self._lock:
                if not self._dependents(uid):
                    owner = self._objects[owner_key]
                    if owner.deleted:
                        return
                    old = owner.raw
                    left = [f for f in old["metadata"].get("finalizers") or [] if f != "foregroundDeletion"]
                    owner.patch({"metadata": {"finalizers": left or None, "resourceVersion": str(self._next_rv())}})
                    if left:
                        await self._record(owner_key[0], owner_key[1], "MODIFIED", old, owner.raw)
                    else:
                        owner.delete()
                        await self._record(owner_key[0], owner_key[1], "DELETED", old, None)
                    return
            await asyncio.sleep(0.05)

    # --- reads ---
    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        key = self._created.pop(id(request), None)
        if key is None:
            raise _bad_request("the object was not created")
        return self._objects[key].raw

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                kind = request.resource.plural if request.resource else "object"
                raise k8s.KubernetesObjectNotFoundError(message=f'{kind} "{request.name}" not found', reason="NotFound")
            return self._stamp(key, self._objects[key])

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        key = (request.resource, request.namespace, request.name)
        obj = self._objects[key]
        return obj.raw if not obj.deleted else obj.last.raw

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise k8s.KubernetesResourceNotFoundError()
        kind, _, _ = self._info(request.resource)
        selector = Selector.from_params(dict(request.params), kind)
        async with self._lock:
            items = [self._stamp(key, obj) for key, obj in self._live(request.resource, request.namespace)]
            rv = self._rv
        items = [item for item in items if selector.matches(item)]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        start = int(request.params.get("continue") or 0)
        limit = int(request.params.get("limit") or 0)
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)  # opaque to clients: the next page's offset
            meta["remainingItemCount"] = len(items) - start - limit
            items = items[start : start + limit]
        else:
            items = items[start:]
        api_version = "/".join(p for p in (request.resource.group, request.resource.version) if p)
        return {"apiVersion": api_version, "kind": f"{kind}List", "metadata": meta, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # the headers at once: a watch is a stream even when nothing happens
        kind, _, _ = self._info(request.resource)
        try:
            selector = Selector.from_params(dict(request.params), kind)
        except KubernetesError as exc:
            yield {"type": "ERROR", "object": _status(exc.status, exc.reason, exc.message)}
            return
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with self._lock:
            if since in (None, "", "0"):
                cursor = self._rv
                initial = [
                    {"type": "ADDED", "object": self._stamp(key, obj)}
                    for key, obj in self._live(request.resource, request.namespace)
                ]
                initial = [event for event in initial if selector.matches(event["object"])]
            else:
                try:
                    cursor = int(since)
                except ValueError:
                    cursor = -1
                if cursor < self._compacted or cursor < 0:
                    expired = _status(410, "Expired", f"too old resource version: {since} ({self._compacted})")
                    initial = [{"type": "ERROR", "object": expired}]
                    cursor = -1
                else:
                    initial = []
        for event in initial:
            yield event
        if cursor < 0:
            return
        condition = self._condition()
        while True:
            async with condition:
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return
                try:
                    await asyncio.wait_for(condition.wait_for(lambda seen=cursor: self._rv > seen), left)
                except TimeoutError:
                    return
            start = bisect.bisect_right(self._changes, cursor, key=lambda change: change.rv)
            for change in self._changes[start:]:
                cursor = max(cursor, change.rv)
                if change.resource != request.resource:
                    continue
                if request.namespace is not None and change.namespace != request.namespace:
                    continue
                event = _watch_event(change, selector)
                if event is not None:
                    yield event
            cursor = max(cursor, self._rv)

    # --- what cluster components report ---
    async def record_event(
        self,
        involved: dict[str, Any],
        reason: str,
        message: str,
        *,
        type_: str = "Normal",
        component: str = "kmock",
    ) -> dict[str, Any]:
        """A core/v1 Event about ``involved``, named ``<name>.<hex>`` as the API's recorders name them."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": component},
            "reportingComponent": component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        resource = references.resource("", "v1", "events")
        async with self._lock:
            key = (resource, namespace, body["metadata"]["name"])
            body["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=now, resourceVersion=str(self._next_rv()))
            self._objects[key] = body
            await self._record(resource, namespace, "ADDED", None, self._objects[key].raw)
        return body

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The recorded Events (about the object ``name``, if given), oldest first."""
        found = [
            obj.raw
            for (res, _, _), obj in list(self._objects.items())
            if res.plural == "events" and not obj.deleted
            if name is None or obj.raw["involvedObject"].get("name") == name
        ]
        return sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))

    async def settle(self) -> None:
        """Wait for the garbage collector's pending work (for tests that assert on its result)."""
        while self._gc_tasks:
            await asyncio.gather(*list(self._gc_tasks), return_exceptions=True)


def _status(code: int, reason: str | None, message: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def _watch_event(change: _Change, selector: Selector) -> dict[str, Any] | None:
    """What a selective watch sends for one change (the API's watch cache rules)."""
    was, now = selector.matches(change.old), selector.matches(change.new)
    if change.type == "DELETED":
        return {"type": "DELETED", "object": _with_rv(change.old, change.rv)} if was else None
    if was and now:
        return {"type": change.type, "object": change.new}
    if now:
        return {"type": "ADDED", "object": change.new}
    if was:
        # it left the selection: DELETED, with its last matching state at this change's version
        return {"type": "DELETED", "object": _with_rv(change.old, change.rv)}
    return None


def _with_rv(obj: dict[str, Any] | None, rv: int) -> dict[str, Any]:
    out = copy.deepcopy(obj or {})
    out.setdefault("metadata", {})["resourceVersion"] = str(rv)
    return out
