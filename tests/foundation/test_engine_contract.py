"""The engine contract (as tests/foundation/test_backend_contract.py is the backends'): training and serving
engines are values with one interface each; stages, flows and the server call it and never ask which engine
they hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from infra.jobs import Resources
from workloads.serve_engines import ENGINES, SERVE_ENGINES, ServeEngine, ServeEngineConfig

REPO = Path(__file__).resolve().parents[2]

# Where code picks an engine by its name instead of calling the engine's interface.
BRANCH = re.compile(
    r"""engine\s*(==|!=|in\s*[(\[{])|\.engine\s*(==|!=)|kind\s*(==|!=)\s*["'](vllm|triton|builtin|auto)["']"""
    r"""|["'](vllm|triton|builtin|automodel|command)["']\s*(==|!=|in\b)"""
)


def _offenders(paths) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return found


def test_stages_flows_and_the_server_never_branch_on_an_engine():
    stages = [*sorted((REPO / "tasks").glob("*.py")), *sorted((REPO / "tasks" / "data").glob("*.py"))]  # a package too
    paths = [*stages, *sorted((REPO / "flows").glob("*.py"))]
    paths += [REPO / "workloads" / "serve.py", REPO / "workloads" / "serve_engines" / "proxy.py"]
    offenders = _offenders(paths)
    assert not offenders, "\n".join(offenders)


def test_the_command_line_infra_and_dev_tools_never_branch_on_an_engine():
    paths = [path for folder in ("nemoflow", "infra", "devtools") for path in sorted((REPO / folder).rglob("*.py"))]
    offenders = _offenders(paths)
    assert not offenders, "\n".join(offenders)


def test_the_branch_finder_sees_a_branch():
    assert BRANCH.search('if target.kind == "vllm":') and BRANCH.search("if args.engine != 'builtin':")
    assert BRANCH.search('if config.engine == "command":') and not BRANCH.search("engine = engine_named(name)")


@pytest.mark.parametrize("cls", SERVE_ENGINES, ids=lambda cls: cls.__name__)
def test_every_serving_engine_implements_the_interface(cls):
    assert issubclass(cls, ServeEngine)
    name = cls.model_fields["engine"].default
    assert ENGINES[name] is cls
    engine = cls()
    assert isinstance(engine.resources, Resources) and engine.server_args()[:2] == ["--engine", engine.served_name()]
    # on the node: an engine that can serve (auto chooses one that can)
    import argparse

    node = engine.on_node(argparse.Namespace(vllm_executable="no-vllm-here"))
    assert type(node).serve is not ServeEngine.serve, f"{type(node).__name__} does not implement serve()"


def test_serving_engines_options_are_their_own():
    adapter = TypeAdapter(ServeEngineConfig)
    assert type(adapter.validate_python({})).__name__ == "Auto"  # no engine: auto, as before engines were values
    vllm = adapter.validate_python({"engine": "vllm", "max_input_len": 2048, "resources": {"gpus_per_node": 4}})
    assert vllm.server_args() == ["--engine", "vllm", "--tensor-parallel-size", "4", "--max-input-len", "2048"]
    with pytest.raises(ValidationError, match="builtin.max_input_len"):
        adapter.validate_python({"engine": "builtin", "max_input_len": 2048})  # a vLLM option on the CPU engine
    with pytest.raises(ValidationError, match="'auto', 'builtin', 'vllm', 'triton'"):
        adapter.validate_python({"engine": "sglang"})


def test_in_json_schema_exactly_one_serving_engine_matches():
    """Prefect validates deployment parameters against the flow's JSON Schema (oneOf): the members must not
    overlap, or a config without `engine` (auto) would match two."""
    import jsonschema

    schema = TypeAdapter(ServeEngineConfig).json_schema()
    for config in ({}, {"max_queue": 2}, {"engine": "builtin", "max_queue": 2}, {"engine": "triton"}):
        jsonschema.validate(config, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"engine": "builtin", "max_input_len": 2}, schema)


def test_a_serve_config_of_the_shape_before_engines_were_values_is_refused_by_name():
    """One accepted shape (issue 31): ``serve.resources`` went into ``serve.engine``; pydantic refuses the old
    shape as the deployment's schema does, naming the field, instead of silently moving it."""
    from tasks.serve import ServeConfig

    with pytest.raises(ValidationError, match=r"(?s)resources.*Extra inputs are not permitted"):
        ServeConfig.model_validate({"resources": {"gpus_per_node": 2}, "engine": {"engine": "vllm"}})
    config = ServeConfig.model_validate({"engine": {"engine": "vllm", "resources": {"gpus_per_node": 2}}})
    assert config.engine.resources.gpus_per_node == 2 and config.engine.engine == "vllm"


def test_a_test_only_serving_engine_is_served_by_the_stage_unchanged(tmp_path):
    """An engine defined here alone: the stage's builder gives it its flags and resources, no edit in tasks/."""
    from pydantic import Field

    from tasks.refs import CheckpointRef
    from tasks.serve import build_serve_spec

    class Echo(ServeEngine):
        engine: str = "echo"
        loudness: int = Field(3, ge=1)

    spec = build_serve_spec(
        CheckpointRef(uri=str(tmp_path), step=1),
        8123,
        "echo-model",
        "127.0.0.1",
        engine=Echo(loudness=5, resources={"gpus_per_node": 0, "cpus_per_task": 3}),
    )
    assert spec.command[spec.command.index("--engine") :] == ["--engine", "echo", "--loudness", "5"]
    assert spec.resources.cpus_per_task == 3 and isinstance(Echo(), BaseModel)


# ------------------------------------------------------------------ training engines
def _training_engines():
    from tasks.train_engines import CPT_ENGINES, PRETRAIN_ENGINES, SFT_ENGINES

    return [
        (stage, name, cls)
        for stage, engines in (("pretrain", PRETRAIN_ENGINES), ("cpt", CPT_ENGINES), ("sft", SFT_ENGINES))
        for name, cls in engines.items()
    ]


@pytest.mark.parametrize(
    ("stage", "name", "cls"), _training_engines(), ids=lambda v: v if isinstance(v, str) else v.__name__
)
def test_every_training_engine_implements_the_interface(stage, name, cls):
    """Each member: a TrainEngine whose tag is its name, one Resources value, and the interface the stage
    calls (a CPT member becomes, by ``continued``, a run that has it)."""
    from tasks.train_engines import TrainEngine

    assert issubclass(cls, TrainEngine) and cls.model_fields["engine"].default == name
    runs = cls
    if stage == "cpt" and cls.continued is not TrainEngine.continued:
        # a refresh's option set: ``continued`` makes the run, a pretraining engine of the same name
        from tasks.train_engines import PRETRAIN_ENGINES

        runs = PRETRAIN_ENGINES[name]
        assert cls.continued.__annotations__["return"] in (runs.__name__, runs)
    for method in ("prepared", "job", "result", "expected_result"):
        assert getattr(runs, method) is not getattr(TrainEngine, method), f"{runs.__name__} lacks {method}()"
    assert runs.modules, f"{runs.__name__} names no code for the stage's cache key"
    engine = cls.model_validate({k: v for k, v in {"command": "true", "max_steps": 1}.items() if k in cls.model_fields})
    assert isinstance(engine.resources, Resources)


def test_training_engines_options_are_their_own_and_automodel_is_the_default():
    from tasks.train_engines import AutoModel, Command, PretrainEngine, SftEngine

    adapter = TypeAdapter(PretrainEngine)
    old = adapter.validate_python({"hidden_size": 128, "max_steps": 3})  # a train section from before engines
    assert type(old) is AutoModel and old.hidden_size == 128
    command = adapter.validate_python({"engine": "command", "command": "python x.py", "gpus_per_node": 2})
    assert type(command) is Command and command.resources.gpus_per_node == 2
    with pytest.raises(ValidationError, match=r"command\.hidden_size"):
        adapter.validate_python({"engine": "command", "command": "x", "hidden_size": 128})  # AutoModel's option
    with pytest.raises(ValidationError, match="'automodel', 'command'"):
        adapter.validate_python({"engine": "torchtitan"})
    assert type(TypeAdapter(SftEngine).validate_python({"max_steps": 5})).__name__ == "AutoModelSft"


@pytest.mark.parametrize("name", ["automodel", "command"])
def test_the_sft_check_comes_from_the_engine(name):
    """tasks/sft.py asks the engine for the held-out check's options (``sft_check``) instead of copying the
    fields whose names match SftConfig's: every SFT engine implements it, and what it does not set stays the
    demo run's."""
    from tasks.sft import check_options, demo_sft_config
    from tasks.train_engines import SFT_ENGINES, TrainEngine

    cls = SFT_ENGINES[name]
    assert cls.sft_check is not TrainEngine.sft_check, f"{cls.__name__} lacks sft_check()"
    given = {"seq_length": 64, "run_dir": "/runs/tuned", "gpus_per_node": 2}
    engine = cls.model_validate({**given, **({"command": ["python", "tune.py"]} if name == "command" else {})})
    check = check_options(engine)
    assert type(check).__name__ == "SftConfig" and {k: getattr(check, k) for k in given} == given
    assert check.max_steps == demo_sft_config().max_steps and check.lr == demo_sft_config().lr


def test_in_json_schema_exactly_one_training_engine_matches():
    import jsonschema

    from tasks.train_engines import CptEngine, PretrainEngine, SftEngine

    for union in (PretrainEngine, CptEngine, SftEngine):
        schema = TypeAdapter(union).json_schema()
        for config in ({}, {"max_steps": 3}, {"engine": "command", "command": ["python", "t.py"]}):
            jsonschema.validate(config, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"engine": "command", "max_steps": 3}, schema)  # no command; AutoModel's option


def test_the_training_stages_cache_keys_are_stored_where_prefect_stores_them():
    """The stages' cache policy (inputs + the engine's code) keeps Prefect's key storage: a positional argument
    once set it, and every run wrote cache metadata into a directory named after the stage in the cwd."""
    from tasks.sft import fine_tune
    from tasks.train import pretrain

    for stage in (pretrain, fine_tune):
        policies = stage.cache_policy.policies
        assert {type(p).__name__ for p in policies} == {"Inputs", "EngineCode"}
        assert all(p.key_storage is None for p in (stage.cache_policy, *policies)), stage.name


WRITE_CHECKPOINT = """
import json, os, sys
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
json.dump({"model_type": "llama", "written_by": "echo", "pid": os.getpid()}, open(os.path.join(out, "config.json"), "w"))
"""


@pytest.mark.prefect
def test_a_test_only_training_engine_runs_through_the_stage_and_a_flow_config_unchanged(prefect_server, work_dir):
    """ARCHITECTURE.md: a new training engine is one module under tasks/train_engines/ and its line in the
    stage lists of its __init__.py. Here the module is this test and the lists are built here: the pretrain
    stage runs it as it is (its job on the local backend, its result read by the engine), and a config built on
    the lists takes it by its tag: nothing in tasks/train.py, tasks/sft.py or flows/ names an engine."""
    import hashlib
    import os
    import sys

    from prefect import flow

    from infra import storage
    from infra.jobs import JobSpec
    from infra.settings import get_settings
    from tasks.refs import CheckpointRef, DatasetRef, TokenizerRef
    from tasks.train import pretrain
    from tasks.train_engines import PRETRAIN_ENGINES, TrainEngine, engine_union

    class Echo(TrainEngine):
        """Writes a config.json and calls it a checkpoint; its options: a step number and its CPUs."""

        engine: str = "echo"
        step: int = 1
        cpus: int = 1
        run_dir: str | None = None

        @property
        def resources(self) -> Resources:
            return Resources(cpus_per_task=self.cpus)

        def prepared(self, inputs):
            name = "echo-" + hashlib.sha256(f"{self.step}{inputs.dataset.manifest_uri}".encode()).hexdigest()[:8]
            return self.model_copy(update={"run_dir": storage.join(get_settings().work_dir, "runs", name)})

        def job(self, inputs):
            out = os.path.join(self.run_dir, "hf")
            return JobSpec(name="echo", command=[sys.executable, "-c", WRITE_CHECKPOINT, out], resources=self.resources)

        def result(self, inputs, run):
            return CheckpointRef(uri=os.path.join(self.run_dir, "hf"), step=self.step, run_dir=self.run_dir)

        def expected_result(self, inputs):
            return self.result(inputs, None)

    # a flow config with the engine in its list (what the line in tasks/train_engines/__init__.py does)
    class Config(BaseModel):
        train: engine_union({**PRETRAIN_ENGINES, "echo": Echo}, "pretraining")

    engine = Config.model_validate({"train": {"engine": "echo", "step": 7}}).train
    assert type(engine) is Echo and engine.step == 7
    assert type(Config.model_validate({"train": {"max_steps": 30}}).train).__name__ == "AutoModel"

    dataset = DatasetRef(
        prefixes=[], blend=[], manifest_uri="test://none", tokenizer=TokenizerRef(), documents=0, tokens=0, bytes=0
    )
    ref = flow(name="echo-engine-test")(lambda: pretrain(engine, dataset))()
    written = json.loads((Path(ref.uri) / "config.json").read_text())
    assert written["written_by"] == "echo" and written["pid"] != os.getpid()  # by the stage's job, not in here
    assert ref.step == 7 and Path(ref.run_dir).parent == work_dir / "runs"
    architecture = " ".join((REPO / "ARCHITECTURE.md").read_text().split())
    assert "A new training engine is one module under `tasks/train_engines/` and its line in the stage lists" in (
        architecture
    )


def test_prefect_yaml_deployments_parameters_pass_prefects_own_deployment_check():
    """The check the Prefect server makes when ``prefect deploy`` creates a deployment: its parameters against
    the flow's schema with every ``required`` removed (they may be partial). A config without an engine tag
    matched every member there (`nemoflow demo --backend slurm` could not deploy: "is valid under each of")."""
    import importlib

    import yaml
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    deployments = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())["deployments"]
    checked = 0
    for deployment in deployments:
        path, name = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
        schema = parameter_schema(flow).model_dump_for_openapi()
        parameters = deployment.get("parameters") or {}
        validate(parameters, schema, raise_on_error=True, preprocess=True, ignore_required=True)
        checked += bool(parameters)
    assert checked >= 5  # the deployments that set parameters (slurm, k8s, the refreshes, sft)
    # and the shapes that failed: a train section without its tag, a serve section without an engine
    schema = parameter_schema(importlib.import_module("flows.end_to_end").end_to_end).model_dump_for_openapi()
    partial = {"config": {"train": {"cpus_per_task": 1}, "serve": {"port": 8001, "engine": {"max_queue": 4}}}}
    validate(partial, schema, raise_on_error=True, preprocess=True, ignore_required=True)
