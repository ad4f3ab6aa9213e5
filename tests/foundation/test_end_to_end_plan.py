"""The end-to-end flow, its stage list and `nemoflow render`'s plan agree (flows/end_to_end.py STAGES, flows/plan.py).

The flow calls the stages of ``STAGES`` in their order and no other task or subflow; the plan builds one job or
service for each stage that submits one, in the same order, and has no builder without a stage.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from prefect import Flow, Task

from flows import end_to_end as e2e
from flows.plan import BUILDERS, planned_specs


def stage_calls(source: str, namespace: dict) -> tuple[list[str], list[str]]:
    """(the stages a flow function calls, in order; the tasks and subflows it calls that are not in STAGES).

    The stages are the names the flow unpacks from ``(stage.runner(...) for stage in STAGES)``; any other name
    it calls that is a Prefect task or flow in ``namespace`` (the flow module's globals) is undeclared."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    runners: list[str] = []
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple)
            and "STAGES" in {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
        ):
            runners = [target.id for target in node.targets[0].elts]
    assert runners, "the flow does not take its stages from STAGES"

    def called(node: ast.Call) -> ast.Name | None:
        """The name called: ``name(...)``, or a stage submitted to run beside the next ones (``name.submit(...)``)."""
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "submit" and isinstance(func.value, ast.Name):
            func = func.value if func.value.id in runners else None
        return func if isinstance(func, ast.Name) else None

    calls = sorted(
        (node for node in ast.walk(function) if isinstance(node, ast.Call) and called(node) is not None),
        key=lambda node: (node.lineno, node.col_offset),
    )
    for call in calls:
        call.func = called(call)
    stages = [e2e.STAGES[runners.index(call.func.id)].name for call in calls if call.func.id in runners]
    undeclared = [
        call.func.id
        for call in calls
        if call.func.id not in runners and isinstance(namespace.get(call.func.id), Task | Flow)
    ]
    return stages, undeclared


def test_the_flow_runs_exactly_its_declared_stages_in_order():
    stages, undeclared = stage_calls(inspect.getsource(e2e.end_to_end.fn), vars(e2e))
    assert stages == [stage.name for stage in e2e.STAGES]
    assert undeclared == [], f"tasks/subflows the flow calls outside STAGES: {undeclared}"
    # each stage's name is the one its task or subflow is known by in the Prefect UI, give or take a suffix
    for stage in e2e.STAGES:
        assert stage.runs.name.startswith(stage.name), (stage.name, stage.runs.name)


def test_a_stage_left_out_of_the_list_is_found():
    """The check can fail: a flow that calls a task directly, or skips a declared stage."""
    source = """
def flow_fn(config):
    stage_image_, prepare_dataset_, start_early_, pretrain_, validate_, deploy_, smoke_ = (s.runner(r) for s in STAGES)
    image = stage_image_(config)
    dataset = prepare_dataset_(config, image)
    checkpoint = pretrain_(config, dataset)
    stop_inference(checkpoint)
    deploy_(checkpoint)
"""
    from tasks.serve import stop_inference

    stages, undeclared = stage_calls(source, {"stop_inference": stop_inference})
    # start-inference-early, validate and smoke-test missing
    assert stages == ["stage-image", "prepare-dataset", "pretrain", "deploy"]
    assert stages != [stage.name for stage in e2e.STAGES]
    assert undeclared == ["stop_inference"]


@pytest.mark.parametrize("executor", ["local", "k8s"])
def test_render_plans_one_spec_per_submitting_stage_in_the_flows_order(work_dir, monkeypatch, executor):
    if executor == "k8s":
        monkeypatch.setenv("NEMOFLOW_WORK_DIR", "/nemo-workspace/nemoflow")  # the only path pods see
        from infra.settings import reload_settings

        reload_settings()
    submitting = [stage.submits for stage in e2e.STAGES if stage.submits]
    assert set(BUILDERS) == set(submitting), "a builder without a stage, or a stage without a builder"
    plan = planned_specs(e2e.EndToEndConfig(executor=executor))
    assert [name for name, _ in plan] == submitting == ["tokenize", "pretrain", "validate", "serve"]
