"""``engine: command`` from the flows: the README's YAML as printed is the ``train`` section of end-to-end,
cpt-refresh and sft (and of an included SFT stage); end-to-end trains, validates, serves and registers a model
with a user's script (tests/command/env_trainer.py) on the local executor with a real Prefect server, and a
cpt-refresh then continues that model with the same script, compares, promotes and switches the server; the sft
flow fine-tunes with another script (tests/command/sft_trainer.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, free_port

HERE = Path(__file__).resolve().parent


def readme_command_yaml() -> dict:
    """The first YAML example of docs/stages.md's "Your own training command (`engine: command`)", as printed."""
    text = (REPO / "docs" / "stages.md").read_text()
    section = text[text.index("## Your own training command (`engine: command`)") :]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "engine: command")
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start:]:
        if not line.strip():
            break
        assert line.startswith(" " * indent), line
        block.append(line[indent:])
    return yaml.safe_load("\n".join(block))


def test_the_readmes_command_section_is_the_train_section_of_every_training_flow():
    from flows.cpt_refresh import CptRefreshConfig
    from flows.end_to_end import EndToEndConfig
    from flows.sft import SftFlowConfig
    from tasks.train_engines import Command

    train = readme_command_yaml()
    assert train["engine"] == "command" and "pretrain_llama3.py" in train["command"]
    configs = {
        "end-to-end": EndToEndConfig.model_validate({"train": train}).train,
        "cpt-refresh": CptRefreshConfig.model_validate({"train": train}).train,
        "sft": SftFlowConfig.model_validate({"train": train}).train,
        "end-to-end's sft": EndToEndConfig.model_validate({"sft": {"train": train}}).sft.train,
        "cpt-refresh's sft": CptRefreshConfig.model_validate({"sft": {"train": train}}).sft.train,
    }
    for where, engine in configs.items():
        assert type(engine) is Command, where
        assert engine.command == train["command"] and engine.resources.nodes == 2, where
        assert engine.resources.gpus_per_node == 8 and engine.converter.command[-2:] == ["{checkpoint}", "{output}"]
    # the same YAML against the JSON Schema Prefect checks deployment parameters with (oneOf: one member)
    import jsonschema

    from flows.cpt_refresh import cpt_refresh
    from flows.end_to_end import end_to_end
    from flows.sft import sft

    for flow in (end_to_end, cpt_refresh, sft):
        jsonschema.validate({"config": {"train": train}}, flow.parameters.model_dump())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"config": {"train": {**train, "hidden_size": 64}}}, end_to_end.parameters.model_dump())
    # an AutoModel section without `engine` is what it always was
    assert type(EndToEndConfig.model_validate({"train": {"max_steps": 30}}).train).__name__ == "AutoModel"
    with pytest.raises(Exception, match="hidden_size"):
        EndToEndConfig.model_validate({"train": {**train, "hidden_size": 64}})  # AutoModel's option on a command


@pytest.mark.slow
@pytest.mark.prefect
def test_end_to_end_then_cpt_refresh_train_with_a_users_command(prefect_server, work_dir, local_state, kjv_chapters):
    """Both pretraining flows with ``engine: command``, one lifecycle: end-to-end pretrains, serves and registers
    the script's model; a cpt-refresh continues it with the same script (NEMOFLOW_INIT_FROM), validates and
    compares the candidate on the registry's held-out set, promotes it and switches the server on its port."""
    from flows.cpt_refresh import CptRefreshConfig, cpt_refresh
    from flows.end_to_end import EndToEndConfig, end_to_end
    from infra import registry as reg
    from tests.cpt.conftest import completion_ok, write_shard

    train = {
        "engine": "command",
        "command": [sys.executable, str(HERE / "env_trainer.py")],
        "seq_length": 64,
        "cpus_per_task": 1,
    }
    serve = {"port": free_port(), "model_name": "e2e-command"}
    # 6 steps of a 64-wide model: below the untrained 10.4 is the point
    config = EndToEndConfig.model_validate({"train": train, "serve": serve, "validation_threshold": 10.2})
    summary = end_to_end(config)

    checkpoint = Path(summary["checkpoint"])
    run_dir = checkpoint.parents[3]
    assert run_dir.parent == work_dir / "runs" and run_dir.name.startswith("cmd-")  # the command engine's run
    mine = json.loads((run_dir / "my_config.json").read_text())  # the script's config, from the contract alone
    assert mine["data_prefix"] == summary["data_prefix"] and mine["seq_length"] == 64
    assert summary["val_loss"] < summary["untrained_loss"] and summary["answer"]
    state = reg.ModelRegistry(str(work_dir / "registry")).read()
    record = state.models[summary["registered_model"]]
    assert state.promoted == record.id and record.checkpoint == str(checkpoint)
    assert state.held_out.seq_length == 64  # as the command trained it (its checkpoint's meta.json)

    # cpt-refresh on a new shard: the same command continues the promoted model. A generous tolerance makes the
    # promotion certain (whether a candidate is better is tests/cpt/test_refresh.py's question), so the switch runs.
    write_shard(work_dir / "incoming" / "day1.jsonl.zst", kjv_chapters[:120])
    refresh = cpt_refresh(
        CptRefreshConfig.model_validate(
            {"train": train, "serve": serve, "validation_threshold": 10.2, "tolerance": 1.0}
        )
    )
    assert refresh["decision"] == "promoted", refresh
    assert refresh["new_sources"] == [str(work_dir / "incoming" / "day1.jsonl.zst")]
    state = reg.ModelRegistry(str(work_dir / "registry")).read()
    candidate = state.models[refresh["candidate"]]
    assert state.promoted == candidate.id and candidate.parent == record.id
    assert candidate.metrics["held_out_loss"] == refresh["candidate_loss"]  # compared on the held-out set
    cpt_run = Path(candidate.checkpoint).parents[3]
    assert cpt_run.parent == work_dir / "runs" and cpt_run.name.startswith("cmd-") and cpt_run != run_dir
    continued = json.loads((cpt_run / "my_config.json").read_text())  # the script saw the promoted model
    assert continued["init_from"] == str(checkpoint) and "init_from" not in mine
    assert continued["data_prefix"] != mine["data_prefix"]  # the new shard's dataset, not the first one
    assert state.serving.model == candidate.id and state.serving.port == serve["port"]  # switched, same port
    assert refresh["endpoint"] == summary["endpoint"] and completion_ok(refresh["endpoint"], serve["model_name"])


@pytest.mark.slow
@pytest.mark.prefect
def test_sft_fine_tunes_with_a_users_command_and_the_engine_decides_the_check(
    prefect_server, work_dir, mixtral_tokenizer_model, tmp_path
):
    """The sft flow, a real run, with ``engine: command``: the user's script (tests/command/sft_trainer.py)
    fine-tunes from the contract's variables alone, the stage finds its newest checkpoint, the held-out check
    runs with the options the command engine gives it (its sequence length; the demo run's for the rest), and
    the registry records the model with its parent."""
    from flows.sft import SftFlowConfig, sft
    from infra import registry as reg
    from tests.sft.conftest import make_base_model

    base = make_base_model(tmp_path / "base", mixtral_tokenizer_model)
    registry_uri = str(work_dir / "registry")
    reg.ModelRegistry(registry_uri).register(
        reg.ModelRecord(id="m-base", checkpoint=str(base), metrics={"steps": 12}), promote=True
    )
    train = {"engine": "command", "command": [sys.executable, str(HERE / "sft_trainer.py")], "seq_length": 128}
    config = SftFlowConfig.model_validate(
        {"train": {**train, "cpus_per_task": 1}, "data": {"demo_examples": 400, "demo_tasks": ["book"]}}
        | {"registry": registry_uri}
    )
    summary = sft(config)

    state = reg.ModelRegistry(registry_uri).read()
    record = state.model(summary["model"])
    assert record.parent == "m-base" and record.metrics["kind"] == "sft"
    assert record.metrics["held_out_chat_loss"] < record.metrics["parent_held_out_chat_loss"]
    checkpoint = Path(record.checkpoint)
    run_dir = checkpoint.parents[3]
    assert run_dir.parent == work_dir / "runs" and run_dir.name.startswith("cmd-")  # the command engine's run
    mine = json.loads((run_dir / "my_sft_config.json").read_text())  # the script's config, from the contract
    assert mine["init_from"] == str(base) and mine["seq_length"] == 128
    report = json.loads(next(work_dir.rglob("validation/*.json")).read_text())
    assert report["passed"] and report["answer_rate"] >= 0.5
