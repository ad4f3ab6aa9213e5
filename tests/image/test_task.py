"""The stage_image Prefect task, the `nemoflow stage-image` command and lineage helpers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from infra.jobs import ImageRef, workload_job
from tasks.image import stage
from tests.support import fault_ledger


@pytest.mark.prefect
def run_artifacts(flow_run_id, key: str = "staged-image") -> list[str]:
    """The artifacts ``key`` made by ONE flow run (not the newest of that key on the server: other
    tests stage the same image, with the same checksum)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )
    return [a.data for a in artifacts]


def stage_image_runs() -> set:
    """Ids of the runs of the `nemoflow stage-image` command's flow."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage-image"])), limit=200)
    return {r.id for r in runs}


def test_task_caches_on_source_checksum_and_publishes_artifact(prefect_server, served, tmp_path):
    from prefect import flow

    from tasks.image import stage_image

    server, root = served
    url = server.url("nemo-test.sqsh")
    dest = str(tmp_path / "images")

    @flow
    def twice():
        first = stage_image(url, dest=dest, executor="slurm", return_state=True)
        second = stage_image(url, dest=dest, executor="slurm", return_state=True)
        return first, second

    state = twice(return_state=True)
    first, second = state.result()
    assert first.name == "Completed" and second.name == "Cached"
    ref = second.result()
    assert isinstance(ref, ImageRef) and ref.kind == "sqsh"
    assert ref.checksum == "md5:" + hashlib.md5((root / "nemo-test.sqsh").read_bytes()).hexdigest()
    assert server.count("/nemo-test.sqsh", "GET") == 1
    artifacts = run_artifacts(state.state_details.flow_run_id)
    assert len(artifacts) == 1, artifacts  # the first call made it; the cached one did not copy anything
    assert ref.checksum in artifacts[0] and "| kind | sqsh |" in artifacts[0]

    # Deleting the staged copy changes the key: the next run stages it again instead of trusting the cache.
    (tmp_path / "images" / "nemo-test.sqsh").unlink()

    @flow
    def once():
        return stage_image(url, dest=dest, executor="slurm", return_state=True)

    third = once()
    assert third.name == "Completed"
    assert (tmp_path / "images" / "nemo-test.sqsh").exists()
    assert server.count("/nemo-test.sqsh", "GET") == 2


def test_local_backend_records_the_python_environment():
    lines: list[str] = []
    assert stage("gs://bucket/nemo.sqsh", executor="local", log=lines.append)[0].kind == "python-env"
    assert any("is not staged" in line for line in lines)
    ref, facts = stage(None, executor="local")
    assert ref.kind == "python-env" and ref.uri == sys.executable
    assert ref.source.startswith("Python {}.{}.".format(*sys.version_info[:2]))
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True).stdout
    expected = hashlib.sha256("\n".join(sorted(line for line in frozen.splitlines() if line.strip())).encode())
    assert ref.checksum == "sha256:" + expected.hexdigest()


def test_backend_rules_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="the slurm backend runs stages in a container"):
        stage(None, executor="slurm")
    with pytest.raises(ValueError, match="pass --convert"):
        stage("docker://nvcr.io/nvidia/nemo:25.02", str(tmp_path), executor="slurm")
    with pytest.raises(ValueError, match="Kubernetes needs|only docker:// references"):
        stage("gs://bucket/nemo.sqsh", executor="k8s")
    with pytest.raises(ValueError, match="unknown executor kind 'lsf'"):
        stage("x.sqsh", executor="lsf")


def test_kubernetes_records_reference_and_digest():
    digest = "sha256:" + "0f" * 32
    ref, _ = stage(f"nvcr.io/nvidia/nemo:25.02@{digest}", executor="k8s")
    assert (ref.kind, ref.uri, ref.digest) == ("registry", f"nvcr.io/nvidia/nemo:25.02@{digest}", digest)


def test_lineage_reaches_the_job():
    image = ImageRef(kind="sqsh", uri="/lustre/images/nemo.sqsh", checksum="md5:abc", source="gs://b/nemo.sqsh")
    spec = workload_job("train", "workloads.train", image=image)
    assert spec.container_image == "/lustre/images/nemo.sqsh" and spec.command[0] == "python"
    assert spec.env["NEMOFLOW_IMAGE"] == "/lustre/images/nemo.sqsh"
    assert spec.env["NEMOFLOW_IMAGE_CHECKSUM"] == "md5:abc"
    assert image.lineage()["image_source"] == "gs://b/nemo.sqsh"
    assert "`/lustre/images/nemo.sqsh`" in image.lineage_markdown()
    local = workload_job("train", "workloads.train", image=ImageRef(kind="python-env", uri="/shared/venv/bin/python"))
    assert local.container_image is None and local.env["NEMOFLOW_IMAGE_KIND"] == "python-env"
    assert local.command[0] == "/shared/venv/bin/python"


def test_cli_copies_and_reports(served, tmp_path, capsys):
    from nemoflow.cli import main

    server, _ = served
    dest = tmp_path / "images"
    assert main(["stage-image", server.url("nemo-test.sqsh"), "--dest", str(dest), "--no-prefect", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "sqsh" and out["uri"] == str(dest / "nemo-test.sqsh") and out["checksum"].startswith("md5:")
    assert main(["stage-image", server.url("nemo-test.sqsh"), "--dest", str(dest), "--no-prefect"]) == 0
    assert "already staged, nothing copied" in capsys.readouterr().out
    assert main(["stage-image", "docker://nvcr.io/nvidia/nemo", "--backend", "k8s", "--no-prefect"]) == 2
    assert "has no tag or digest" in capsys.readouterr().err


def test_cli_help_explains():
    out = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "stage-image", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for phrase in ("--convert", "NEMOFLOW_REGISTRY_PASSWORD", "<region>", "meta.json", "--backend"):
        assert phrase in out


@pytest.mark.prefect
def test_cli_runs_the_task_in_a_flow(prefect_server, served, tmp_path, capsys):
    from nemoflow.cli import main

    server, _ = served
    dest = tmp_path / "images"
    before = stage_image_runs()
    assert main(["stage-image", server.url("nemo-test.sqsh"), "--dest", str(dest), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["uri"] == str(dest / "nemo-test.sqsh")
    (run,) = stage_image_runs() - before  # the command ran one flow run...
    artifacts = run_artifacts(run)  # ...which published the staged image's artifact
    assert len(artifacts) == 1 and out["checksum"] in artifacts[0] and str(dest / "nemo-test.sqsh") in artifacts[0]


@pytest.mark.prefect
@pytest.mark.faults
def test_task_retries_transient_failures_only(prefect_server, tmp_path, counted_server):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from infra import images
    from infra.images import copying
    from tasks.image import stage_image
    from tests.support.fault_server import Fault

    row = fault_ledger.open_row("http connection dropped more often than a copy resumes: stage_image task retried")
    server = counted_server(row)
    quick = stage_image.with_options(retry_delay_seconds=0)
    # First attempt: the connection drops more often than one copy resumes; the retry succeeds.
    server.add_faults(
        "/nemo-test.sqsh", *[Fault(stall_at=1000, stall=0.05) for _ in range(copying.RESUME_ATTEMPTS + 1)]
    )

    @flow
    def stage_both():
        flaky = quick(server.url("nemo-test.sqsh"), dest=str(tmp_path / "a"), executor="slurm", return_state=True)
        missing = quick(server.url("missing.sqsh"), dest=str(tmp_path / "b"), executor="slurm", return_state=True)
        return flaky, missing

    flaky, missing = stage_both(return_state=False)
    assert flaky.is_completed() and missing.is_failed()
    with get_client(sync_client=True) as client:
        assert client.read_task_run(flaky.state_details.task_run_id).run_count == 2
        assert client.read_task_run(missing.state_details.task_run_id).run_count == 1  # a 404 is not retried
    with pytest.raises(images.ImageNotFound, match="missing.sqsh"):
        missing.result()


def test_local_environment_and_k8s_reference_are_cached_on_rerun(prefect_server):
    """The demo's second run must be all Cached: the local "image" and a k8s reference key on what they are."""
    from prefect import flow

    from tasks.image import stage_image

    reference = "nvcr.io/nvidia/nemo:25.02@sha256:" + "ab" * 32

    @flow
    def twice():
        return [stage_image(None, executor="local", return_state=True) for _ in range(2)] + [
            stage_image(reference, executor="k8s", return_state=True) for _ in range(2)
        ]

    local_1, local_2, k8s_1, k8s_2 = twice()
    assert local_2.name == "Cached" and k8s_2.name == "Cached"
    assert local_2.result() == local_1.result() and k8s_2.result().digest == "sha256:" + "ab" * 32
