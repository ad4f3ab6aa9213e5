"""prefect.yaml as shipped: every deployment's parameters are valid for its flow, as Prefect validates them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def _flow(entrypoint: str):
    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=lambda d: f"{_flow(d['entrypoint']).name}/{d['name']}")
def test_parameters_validate_against_the_flow_signature(deployment, monkeypatch):
    # the variables the pool's job template puts in the flow run's environment
    for name, value in ((deployment.get("work_pool") or {}).get("job_variables") or {}).get("env", {}).items():
        monkeypatch.setenv(name, str(value))
    from infra.settings import reload_settings

    reload_settings()
    flow = _flow(deployment["entrypoint"])
    params = flow.validate_parameters(deployment.get("parameters") or {})
    config = params.get("config")
    if config is not None and hasattr(config, "executor"):
        kind = {"local": "local", "gpu-cluster": "slurm", "nemoflow-k8s": "k8s"}[deployment["work_pool"]["name"]]
        assert config.executor.kind == kind
        if kind == "k8s":
            # stage jobs run the image the pool names (no image.source): the nemoflow image, not NeMo's
            assert config.executor.image == deployment["work_pool"]["job_variables"]["image"]
            assert config.executor.namespace == deployment["work_pool"]["job_variables"]["namespace"]
    reload_settings()


def test_a_bad_parameter_is_refused_naming_it():
    flow = _flow("flows/end_to_end.py:end_to_end")
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="executor"):
        flow.validate_parameters({"config": {"executor": {"kind": "slurm", "partion": "gpu"}}})
    with pytest.raises(ParameterTypeError, match="backend"):
        flow.validate_parameters({"config": {"backend": "slurm"}})
