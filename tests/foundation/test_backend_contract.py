"""The backend contract (infra/jobs.py): every backend implements all of it; stages never branch on one."""

from __future__ import annotations

import doctest
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from infra.executors import EXECUTORS, as_executor, demo_kinds, get_backend, work_pools
from infra.jobs import IMAGE_KINDS, Backend, ImageRef, JobState, Resources, workload_job

REPO = Path(__file__).resolve().parents[2]


def test_every_executor_builds_a_backend_that_implements_the_whole_contract():
    abstract = set(Backend.__abstractmethods__)
    assert {"run", "cancel", "start_service", "stop_service", "service", "switch_service", "stage_image"} <= abstract
    for kind, executor in EXECUTORS.items():
        backend = executor().backend()  # instantiating an ABC subclass fails if a method is missing
        assert isinstance(backend, Backend) and backend.name == kind


# Every name a backend or an image kind goes by (from the registries, so a new one is searched for too).
_NAMES = "|".join(re.escape(name) for name in [*EXECUTORS, "kubernetes", *IMAGE_KINDS])
# Where code picks a backend (or stands an image kind in for one) by its name, or lists the names itself
# instead of reading them from infra/executors.py: a comparison, a membership test, a literal list of two
# names, an isinstance check on an executor or backend class.
BACKEND_BRANCH = re.compile(
    rf"""backend\s*(==|!=|in\s*[(\[{{])|\.kind\s*(==|!=|in\s*[(\[{{])\s*["']({_NAMES})["']"""
    rf"""|["']({_NAMES})["']\s*(==|!=|in\b)|(==|!=|\bin)\s*[(\[{{]?\s*["']({_NAMES})["']"""
    rf"""|["']({_NAMES})["']\s*,\s*["']({_NAMES})["']|isinstance\([^)]*(Executor|Backend)\b"""
)
# The backends' own packages name themselves; they are where backend-specific code belongs.
OWN = ("infra/backends/", "infra/slurm/", "infra/k8s/")


def backend_branches(folders=("tasks", "flows", "nemoflow", "infra", "devtools")) -> list[str]:
    offenders = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if where.startswith(OWN):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if BACKEND_BRANCH.search(line):
                    offenders.append(f"{where}:{number}: {line.strip()}")
    return offenders


def test_the_branch_finder_sees_a_branch():
    for line in (
        'if config.executor.kind == "k8s" and config.executor.pvc_name:',
        'if options and args.backend != "slurm":',
        'return kind if kind in ("slurm", "k8s") else "slurm"',
        'p.add_argument("--backend", choices=["slurm", "k8s"], default=None)',
        'if image.kind == "python-env":',
        "if isinstance(executor, SlurmExecutor):",
        'executor: Literal["local", "slurm", "k8s"] = Field(',
    ):
        assert BACKEND_BRANCH.search(line), line
    for line in ('if exc.kind == "size":', "choices=list(EXECUTORS)", 'default="slurm"', 'kind: Literal["k8s"]'):
        assert not BACKEND_BRANCH.search(line), line


def test_no_code_outside_the_backends_branches_on_the_backend():
    """Stages, flows, the command line, infra and the dev tools call the executor's and the backend's
    methods; the names of the backends come from infra/executors.py."""
    offenders = backend_branches()
    assert not offenders, "\n".join(offenders)


def test_the_executors_work_pools_are_the_pools_prefect_yaml_deploys_to():
    """`nemoflow deploy` creates each executor's work pool; the demo runs end-to-end/KIND in KIND's pool."""
    import yaml

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    pools = {pool.name: pool for pool in work_pools()}
    assert {d["work_pool"]["name"] for d in deployments} == set(pools)
    for pool in pools.values():
        assert pool.base_job_template is None or (REPO / pool.base_job_template).is_file(), pool
    e2e = {d["name"]: d["work_pool"]["name"] for d in deployments if d["entrypoint"].endswith(":end_to_end")}
    assert demo_kinds() and all(e2e[kind] == EXECUTORS[kind].work_pool.name for kind in demo_kinds())


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
