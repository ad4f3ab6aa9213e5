"""Every parameter set nemoflow submits passes the deployment's parameter schema as the Prefect server checks it.

``prefect deployment run DEPLOYMENT --params ...`` makes the server merge the run's parameters over the
deployment's (top-level keys: a run's ``config`` replaces the deployment's whole ``config``) and validate the
result against the schema ``prefect deploy`` stored, with ``required`` enforced
(prefect/server/api/deployments.py, ``create_flow_run_from_deployment``). Pydantic accepting a config is not
enough: the GPU demo once wrote ``serve: {resources: ...}``, which a before-validator of ``ServeConfig`` took
and the schema refused ("Additional properties are not allowed ('resources' was unexpected)"), so
``nemoflow demo`` on a GPU machine did not start while every CPU test passed.

Here the schema is the one ``prefect deploy`` computes (``parameter_schema`` of the flow loaded from its
entrypoint, as prefect/cli/deploy/_core.py does), and the validator is Prefect's own. That this is the schema a
real server stores is checked where the suite deploys prefect.yaml to a real server
(tests/demo/test_demo.py: the deployed schemas equal ``deployed_schema`` below).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import yaml
from prefect.utilities.schema_tools.validation import ValidationError, validate

from nemoflow.commands import demo

REPO = Path(__file__).resolve().parents[2]


def deployments() -> list[dict]:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def deployment_entry(deployment: str) -> dict:
    """prefect.yaml's entry of ``FLOW/NAME`` (the flow's name is its function's with dashes)."""
    flow, name = deployment.split("/")
    for entry in deployments():
        if entry["name"] == name and entry["entrypoint"].endswith(":" + flow.replace("-", "_")):
            return entry
    raise KeyError(deployment)


@functools.cache
def deployed_schema(entrypoint: str) -> dict:
    """The parameter schema ``prefect deploy`` stores for ``entrypoint`` (prefect/cli/deploy/_core.py)."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(load_flow_from_entrypoint(str(REPO / entrypoint))).model_dump(exclude_unset=True)


def check_run(deployment: str, run_parameters: dict | None) -> None:
    """What the server does on ``prefect deployment run DEPLOYMENT --params RUN_PARAMETERS``."""
    entry = deployment_entry(deployment)
    parameters = copy.deepcopy(entry.get("parameters") or {})
    parameters.update(run_parameters or {})
    validate(parameters, deployed_schema(entry["entrypoint"]), raise_on_error=True)


def demo_cases() -> list[tuple[str, str, int | None, int]]:
    """Every parameter set ``nemoflow demo`` can submit: each backend, with and without --steps, and the GPU demo
    (local only) on 1, 2 and 8 GPUs."""
    cases = []
    for backend, (_pool, _worker, deployment) in demo.POOLS.items():
        cases += [(backend, deployment, None, 0), (backend, deployment, 20, 0)]
    cases += [("local", demo.POOLS["local"][2], None, n) for n in (1, 2, 8)]
    return cases


@pytest.mark.parametrize(("backend", "deployment", "steps", "gpus"), demo_cases())
def test_every_parameter_set_nemoflow_demo_submits_passes_the_deployments_schema(backend, deployment, steps, gpus):
    # the port the demo serves on when it is not the deployment's (the Slurm demo's, beside a local demo)
    port = demo.ENDPOINT_PORTS[backend]
    override = port if port != demo.deployed_serve_port(deployment) else None
    parameters = demo.demo_parameters(deployment, steps=steps, gpus=gpus, serve_port=override)
    if steps is None and not gpus and override is None:
        assert parameters is None  # the printed command: `prefect deployment run end-to-end/<pool> --watch`
    else:
        assert parameters and "config" in parameters
    check_run(deployment, parameters)


def test_the_gpu_demo_keeps_the_deployments_own_settings():
    """Run parameters replace the deployment's whole `config`: the GPU demo carries the deployment's settings."""
    local = demo.POOLS["local"][2]
    config = demo.demo_parameters(local, steps=None, gpus=2)["config"]
    assert config["train"]["gpus_per_node"] == 2 and config["serve"]["engine"]["resources"]["gpus_per_node"] == 1
    slurm = demo.POOLS["slurm"][2]
    shorter = demo.demo_parameters(slurm, steps=20, gpus=0)["config"]
    assert shorter["executor"] == {"kind": "slurm"} and shorter["train"]["cpus_per_task"] == 1
    assert shorter["train"]["max_steps"] == 20


@pytest.mark.parametrize("deployment", sorted({f"{e['entrypoint'].split(':')[1]}/{e['name']}" for e in deployments()}))
def test_every_deployment_runs_with_its_own_parameters(deployment):
    """A scheduled run (the nightly refresh) and `nemoflow refresh` send no parameters of their own."""
    check_run(deployment.replace("_", "-"), None)


def test_the_schema_check_refuses_what_the_server_refuses():
    """The check above is able to fail: the shape that stopped the GPU demo, and an unknown section."""
    local = demo.POOLS["local"][2]
    with pytest.raises(ValidationError, match="'resources' was unexpected"):
        check_run(local, {"config": {"serve": {"resources": {"gpus_per_node": 1}}}})
    with pytest.raises(ValidationError, match="'trian' was unexpected"):
        check_run(local, {"config": {"trian": {}}})


# Config examples in the user docs: a fenced yaml block right after `<!-- params: FLOW -->` is one flow's
# `config` (or a part of it, `<!-- params: FLOW SECTION -->`), checked as a run of FLOW/local would send it.
PARAMS_MARK = re.compile(r"<!-- params: ([a-z-]+)(?: ([a-z_]+))? -->\n```yaml\n(.*?)```", re.S)


def doc_examples() -> list[tuple[str, str, str | None, str]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for flow, section, block in PARAMS_MARK.findall(path.read_text()):
            found.append((path.name, flow, section or None, block))
    return found


def test_the_docs_mark_their_config_examples():
    flows = {flow for _doc, flow, _section, _block in doc_examples()}
    assert {"end-to-end", "cpt-refresh", "sft"} <= flows, flows


@pytest.mark.parametrize(
    ("doc", "flow", "section", "block"), doc_examples(), ids=lambda v: v if isinstance(v, str) and len(v) < 30 else ""
)
def test_every_config_example_in_the_docs_passes_the_schema(doc, flow, section, block):
    value = yaml.safe_load(block)
    config = {section: value} if section else value
    check_run(f"{flow}/local", {"config": config})
