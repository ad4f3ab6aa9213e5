"""The API stand-in (tests/support/kube.py) against the Kubernetes API's documented behaviour.

The clients are the ones the code under test uses: kubernetes_asyncio (prefect-kubernetes' worker
and observer) and the sync ``kubernetes`` client (nemoflow's backend); raw HTTP where a detail of
the wire format is the point.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from kubernetes_asyncio import client as ka
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support.kube import KubeApi, parse_label_selector

pytestmark = pytest.mark.kmock(cls=KubeApi)
NS = "team"


@pytest.fixture
async def api(kmock):
    configuration = ka.Configuration(host=str(kmock.url).rstrip("/"))
    async with ka.ApiClient(configuration) as client:
        yield client


def job(generate_name: str | None = None, name: str | None = None, labels: dict | None = None) -> dict:
    meta = {"labels": labels or {}}
    if generate_name:
        meta["generateName"] = generate_name
    if name:
        meta["name"] = name
    container = {"name": "c", "image": "busybox", "command": ["true"]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {"template": {"spec": {"containers": [container], "restartPolicy": "Never"}}},
    }


def pod(name: str, labels: dict | None = None, owner: dict | None = None, phase: str | None = None) -> dict:
    meta: dict = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    if phase:
        body["status"] = {"phase": phase}
    return body


async def test_generate_name_gives_unique_names_with_the_prefix_uid_and_increasing_versions(api):
    batch = ka.BatchV1Api(api)
    created = [await batch.create_namespaced_job(NS, job(generate_name="end-to-end-k8s-")) for _ in range(20)]
    names = [j.metadata.name for j in created]
    assert len(set(names)) == 20
    assert all(re.fullmatch(r"end-to-end-k8s-[bcdfghjklmnpqrstvwxz2456789]{5}", n) for n in names), names
    assert len({j.metadata.uid for j in created}) == 20
    versions = [int(j.metadata.resource_version) for j in created]
    assert versions == sorted(versions) and len(set(versions)) == 20
    assert all(j.metadata.namespace == NS and j.metadata.creation_timestamp for j in created)
    assert all(j.status is not None for j in created), "a new Job has a status (empty)"
    # the name is the one the server stored: it can be read back
    assert (await batch.read_namespaced_job(names[3], NS)).metadata.uid == created[3].metadata.uid


async def test_create_without_name_or_generate_name_is_422_and_a_taken_name_409(api):
    batch = ka.BatchV1Api(api)
    with pytest.raises(ApiException) as missing:
        await batch.create_namespaced_job(NS, job())
    assert missing.value.status == 422 and "name or generateName is required" in missing.value.body
    await batch.create_namespaced_job(NS, job(name="once"))
    with pytest.raises(ApiException) as taken:
        await batch.create_namespaced_job(NS, job(name="once"))
    assert taken.value.status == 409 and "already exists" in taken.value.body


async def test_a_new_pod_is_pending(api):
    created = await ka.CoreV1Api(api).create_namespaced_pod(NS, pod("p"))
    assert created.status.phase == "Pending"


LABELLED = {
    "p-match": {"a": "b", "e": "f"},
    "p-c-other": {"a": "b", "c": "x", "e": "f"},
    "p-c-d": {"a": "b", "c": "d", "e": "f"},
    "p-e-g": {"a": "b", "e": "g"},
    "p-no-a": {"e": "f"},
    "p-none": {},
}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("a=b,c!=d,e in (f)", {"p-match", "p-c-other"}),
        ("a==b,e notin (f)", {"p-e-g"}),
        ("a", {"p-match", "p-c-other", "p-c-d", "p-e-g"}),
        ("!a", {"p-no-a", "p-none"}),
        ("e in (f, g),!c", {"p-match", "p-e-g", "p-no-a"}),
        ("", set(LABELLED)),
    ],
)
async def test_label_selector_filters_a_list(api, selector, expected):
    core = ka.CoreV1Api(api)
    for name, labels in LABELLED.items():
        await core.create_namespaced_pod(NS, pod(name, labels))
    listed = await core.list_namespaced_pod(NS, label_selector=selector)
    assert {p.metadata.name for p in listed.items} == expected
    assert int(listed.metadata.resource_version) >= len(LABELLED)


async def test_an_invalid_label_selector_is_400(api):
    with pytest.raises(ApiException) as bad:
        await ka.CoreV1Api(api).list_namespaced_pod(NS, label_selector="a in (")
    assert bad.value.status == 400
    with pytest.raises(ValueError, match="not a valid label key"):
        parse_label_selector("-bad-=x")


async def test_field_selector_on_supported_fields_only(api, kmock):
    core = ka.CoreV1Api(api)
    await core.create_namespaced_pod(NS, pod("running", phase="Running"))
    await core.create_namespaced_pod(NS, pod("waiting"))
    await core.create_namespaced_pod("other", pod("running"))
    running = await core.list_namespaced_pod(NS, field_selector="status.phase=Running")
    assert [p.metadata.name for p in running.items] == ["running"]
    not_running = await core.list_pod_for_all_namespaces(field_selector="status.phase!=Running")
    assert [(p.metadata.namespace, p.metadata.name) for p in not_running.items] == [
        ("other", "running"),  # Pending: only its name is the same
        (NS, "waiting"),
    ]
    by_name = await core.list_pod_for_all_namespaces(field_selector="metadata.name=running,metadata.namespace=other")
    assert [(p.metadata.namespace, p.metadata.name) for p in by_name.items] == [("other", "running")]
    with pytest.raises(ApiException) as bad:
        await core.list_namespaced_pod(NS, field_selector="spec.containers=x")
    assert bad.value.status == 400 and "field label not supported: spec.containers" in bad.value.body


async def test_list_pages_with_limit_and_continue(api):
    core = ka.CoreV1Api(api)
    for i in range(7):
        await core.create_namespaced_pod(NS, pod(f"p{i}"))
    seen, token, pages = [], None, 0
    while True:
        page = await core.list_namespaced_pod(NS, limit=3, _continue=token) if token else None
        page = page or await core.list_namespaced_pod(NS, limit=3)
        pages += 1
        seen += [p.metadata.name for p in page.items]
        token = page.metadata._continue
        if not token:
            break
    assert pages == 3 and seen == [f"p{i}" for i in range(7)]


async def _watch(kmock, path: str, params: dict, until: int, timeout: float = 5.0) -> list[tuple[str, str]]:
    """(type, name) of the watch's events until ``until`` arrived (or the server ends it)."""
    events: list[tuple[str, str]] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{str(kmock.url).rstrip('/')}{path}", params={"watch": "true", **params}) as resp:
            assert resp.status == 200
            async with asyncio.timeout(timeout):
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    events.append((event["type"], obj.get("metadata", {}).get("name") or obj.get("code")))
                    if len(events) >= until:
                        break
    return events


async def test_watch_with_label_selector_sees_objects_enter_and_leave_the_selection(api, kmock):
    core = ka.CoreV1Api(api)
    await core.create_namespaced_pod(NS, pod("before", {"run": "1"}))
    rv = (await core.list_namespaced_pod(NS)).metadata.resource_version
    params = {"labelSelector": "run=1", "resourceVersion": rv}
    watcher = asyncio.create_task(_watch(kmock, f"/api/v1/namespaces/{NS}/pods", params, until=5))
    await asyncio.sleep(0.2)
    await core.create_namespaced_pod(NS, pod("in", {"run": "1"}))
    await core.create_namespaced_pod(NS, pod("out", {"run": "2"}))  # never selected: no event
    await core.patch_namespaced_pod("out", NS, {"metadata": {"labels": {"run": "1"}}})  # enters: ADDED
    await core.patch_namespaced_pod("in", NS, {"metadata": {"labels": {"run": "2"}}})  # leaves: DELETED
    await core.patch_namespaced_pod("before", NS, {"status": {"phase": "Running"}})  # stays: MODIFIED
    await core.delete_namespaced_pod("out", NS)
    events = await watcher
    # nothing from before the resourceVersion: "before" was created earlier
    assert events == [
        ("ADDED", "in"),
        ("ADDED", "out"),
        ("DELETED", "in"),
        ("MODIFIED", "before"),
        ("DELETED", "out"),
    ]


async def test_watch_without_version_starts_with_the_current_objects_and_ends_at_its_timeout(api, kmock):
    core = ka.CoreV1Api(api)
    await core.create_namespaced_pod(NS, pod("a", {"x": "1"}))
    await core.create_namespaced_pod(NS, pod("b", {"x": "2"}))
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = await _watch(kmock, f"/api/v1/namespaces/{NS}/pods", {"labelSelector": "x=1", "timeoutSeconds": "1"}, 99)
    assert events == [("ADDED", "a")]
    assert 0.9 <= loop.time() - started < 4, "timeoutSeconds ends the watch on the server"


async def test_watch_from_a_compacted_version_is_410_gone(api, kmock):
    core = ka.CoreV1Api(api)
    old = (await core.create_namespaced_pod(NS, pod("a"))).metadata.resource_version
    await core.create_namespaced_pod(NS, pod("b"))
    kmock.compact()
    events = await _watch(kmock, f"/api/v1/namespaces/{NS}/pods", {"resourceVersion": old}, until=1)
    assert events == [("ERROR", 410)]


async def _job_with_pods(api, name: str, n: int = 2):
    created = await ka.BatchV1Api(api).create_namespaced_job(NS, job(name=name))
    owner = api.sanitize_for_serialization(created)
    for i in range(n):
        await ka.CoreV1Api(api).create_namespaced_pod(NS, pod(f"{name}-{i}", {"job-name": name}, owner=owner))
    await ka.CoreV1Api(api).create_namespaced_pod(NS, pod(f"{name}-unowned", {"job-name": name}))
    return created


async def _pods(api) -> set[str]:
    return {p.metadata.name for p in (await ka.CoreV1Api(api).list_namespaced_pod(NS)).items}


async def test_background_deletion_deletes_the_jobs_pods(api, kmock):
    await _job_with_pods(api, "bg")
    await ka.BatchV1Api(api).delete_namespaced_job("bg", NS, propagation_policy="Background")
    assert not (await ka.BatchV1Api(api).list_namespaced_job(NS)).items, "the Job goes at once"
    await kmock.settle()
    assert await _pods(api) == {"bg-unowned"}, "its own pods go with it, others stay"


async def test_foreground_deletion_keeps_the_job_until_its_pods_are_gone(api, kmock):
    await _job_with_pods(api, "fg")
    batch = ka.BatchV1Api(api)
    await batch.delete_namespaced_job("fg", NS, propagation_policy="Foreground")
    marked = await batch.read_namespaced_job("fg", NS)
    assert marked.metadata.deletion_timestamp and "foregroundDeletion" in marked.metadata.finalizers
    await kmock.settle()
    assert await _pods(api) == {"fg-unowned"}
    with pytest.raises(ApiException) as gone:
        await batch.read_namespaced_job("fg", NS)
    assert gone.value.status == 404


async def test_a_job_deleted_without_policy_orphans_its_pods(api, kmock):
    await _job_with_pods(api, "legacy")
    await ka.BatchV1Api(api).delete_namespaced_job("legacy", NS)
    await kmock.settle()
    pods = (await ka.CoreV1Api(api).list_namespaced_pod(NS)).items
    assert {p.metadata.name for p in pods} == {"legacy-0", "legacy-1", "legacy-unowned"}
    assert all(not p.metadata.owner_references for p in pods), "the orphans lose their owner reference"


@pytest.mark.parametrize("policy", ["Foreground", "Background"])
async def test_deleting_an_owner_job_cascades_to_the_jobs_it_owns_and_their_pods(api, kmock, policy):
    """A Job owned by another Job (an ownerReference without blockOwnerDeletion, as a flow-run pod sets it on its
    stage Jobs) goes when its owner is deleted with Foreground or Background, and its own pods with it; the
    garbage collector follows ownerReferences by uid, whatever the kinds (kubernetes.io/docs/concepts/
    architecture/garbage-collection/)."""
    batch = ka.BatchV1Api(api)
    owner = api.sanitize_for_serialization(await batch.create_namespaced_job(NS, job(name="flow-run")))
    stage = job(name="stage")
    stage["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "flow-run", "uid": owner["metadata"]["uid"]}
    ]
    owned = api.sanitize_for_serialization(await batch.create_namespaced_job(NS, stage))
    for i in range(2):
        await ka.CoreV1Api(api).create_namespaced_pod(NS, pod(f"stage-{i}", {"job-name": "stage"}, owner=owned))
    await batch.create_namespaced_job(NS, job(name="bystander"))
    await batch.delete_namespaced_job("flow-run", NS, propagation_policy=policy)
    await kmock.settle()
    assert [j.metadata.name for j in (await batch.list_namespaced_job(NS)).items] == ["bystander"]
    assert await _pods(api) == set()


async def test_events_are_recorded_and_selected_by_involved_object(api, kmock):
    created = await ka.CoreV1Api(api).create_namespaced_pod(NS, pod("p"))
    await kmock.record_event(api.sanitize_for_serialization(created), "Scheduled", "assigned team/p to node-0")
    await kmock.record_event({"metadata": {"name": "q", "namespace": NS}, "kind": "Pod"}, "Pulled", "x")
    listed = await ka.CoreV1Api(api).list_namespaced_event(NS, field_selector="involvedObject.name=p")
    assert [(e.reason, e.involved_object.uid) for e in listed.items] == [("Scheduled", created.metadata.uid)]
    assert [e["reason"] for e in kmock.events()] == ["Scheduled", "Pulled"]
