"""The backend contract (infra/jobs.py): every backend implements all of it; stages never branch on one."""

from __future__ import annotations

import doctest
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from infra.executors import EXECUTORS, as_executor, get_backend
from infra.jobs import Backend, ImageRef, JobState, Resources, workload_job

REPO = Path(__file__).resolve().parents[2]


def test_every_executor_builds_a_backend_that_implements_the_whole_contract():
    abstract = set(Backend.__abstractmethods__)
    assert {"run", "cancel", "start_service", "stop_service", "service", "switch_service", "stage_image"} <= abstract
    for kind, executor in EXECUTORS.items():
        backend = executor().backend()  # instantiating an ABC subclass fails if a method is missing
        assert isinstance(backend, Backend) and backend.name == kind


def test_stages_and_flows_never_branch_on_the_backend():
    pattern = re.compile(
        r"""backend\s*(==|!=|in\s*\()|\.kind\s*(==|!=|in\s*\()|["'](slurm|k8s|kubernetes)["']\s*(==|!=)"""
    )
    offenders = []
    for folder in ("tasks", "flows"):
        for path in sorted((REPO / folder).glob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_an_executor_is_a_name_or_options_and_only_known_kinds():
    assert as_executor("local").kind == "local"
    assert as_executor({"kind": "slurm", "partition": "gpu"}).partition == "gpu"
    with pytest.raises(ValueError, match="unknown executor kind 'kubernetes'"):
        as_executor("kubernetes")
    with pytest.raises(ValueError, match="partion"):
        as_executor({"kind": "slurm", "partion": "gpu"})


def test_the_builder_places_code_and_data_by_image_kind():
    data = ["/data/tokenized"]
    local = workload_job("t", "workloads.train", ["--x"], read_only=data)
    assert local.command == [sys.executable, "-m", "workloads.train", "--x"] and local.mounts == []
    shared = workload_job("t", "workloads.train", image=ImageRef(kind="python-env", uri="/shared/venv/bin/python"))
    assert shared.command[0] == "/shared/venv/bin/python" and shared.container_image is None
    sqsh = workload_job("t", "workloads.train", image=ImageRef(kind="sqsh", uri="/img/nemo.sqsh"), read_only=data)
    assert sqsh.command[0] == "python" and sqsh.container_image == "/img/nemo.sqsh"
    mounts = {(m.source, m.read_only) for m in sqsh.mounts}
    assert (sqsh.workdir, True) in mounts and ("/data/tokenized", True) in mounts  # the NeMo image lacks our code
    registry = workload_job(
        "t", "workloads.train", image=ImageRef(kind="registry", uri="nemoflow:1"), read_only=[*data, sys.prefix]
    )
    assert registry.workdir == "/opt/nemoflow" and registry.env["PYTHONPATH"] == "/opt/nemoflow"
    assert [m.source for m in registry.mounts] == ["/data/tokenized"]  # the image holds code and environment


def test_doctests_of_the_contract_modules():
    for name in ("infra.jobs", "infra.backends.local", "infra.slurm.options", "infra.slurm.script"):
        failures, _ = doctest.testmod(importlib.import_module(name))
        assert failures == 0, name


@pytest.mark.slow
def test_local_backend_runs_a_distributed_job_under_torchrun(tmp_path):
    spec = workload_job(
        "ranks", "tests.support.ranks", [str(tmp_path)], nproc_per_node=2, resources=Resources(cpus_per_task=1)
    )
    spec = spec.model_copy(update={"workdir": str(REPO), "env": {**spec.env, "PYTHONPATH": str(REPO)}})
    lines: list[str] = []
    result = get_backend("local").run(spec, on_log=lines.append)
    assert result.state is JobState.COMPLETED, "\n".join(lines)
    seen = sorted(json.loads(p.read_text())["rank"] for p in tmp_path.glob("rank-*.json"))
    assert seen == [0, 1]
    assert all(
        json.loads(p.read_text())["sum"] == 1 and json.loads(p.read_text())["world"] == 2
        for p in tmp_path.glob("rank-*.json")
    )


def test_the_local_backend_refuses_several_nodes():
    spec = workload_job("multi", "workloads.train", resources=Resources(nodes=2))
    with pytest.raises(ValueError, match="asks for 2 nodes; the local backend runs on this machine only"):
        get_backend("local").run(spec)
