"""SFT as a step of end-to-end: the model the run registered is fine-tuned and registered as its child
(NeMo AutoModel on CPU, the local executor, a real Prefect server)."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.sft.test_sft_flow import DATA, TINY_SFT
from tests.support.tiny import TINY_TRAIN


def test_sft_config_is_refused_with_unknown_keys_and_merges_over_the_demo_run():
    from pydantic import ValidationError

    from flows.cpt_refresh import CptRefreshConfig
    from flows.end_to_end import EndToEndConfig
    from tasks.sft import demo_sft_config

    assert EndToEndConfig().sft is None and CptRefreshConfig().sft is None  # off unless asked for
    config = EndToEndConfig(sft={"train": {"max_steps": 7}})
    assert config.sft.train.max_steps == 7
    assert config.sft.train.global_batch_size == demo_sft_config().global_batch_size
    with pytest.raises(ValidationError, match="max_step"):
        EndToEndConfig(sft={"train": {"max_step": 7}})


@pytest.mark.slow
@pytest.mark.prefect
def test_end_to_end_with_sft_registers_the_fine_tuned_model_as_the_child(prefect_server, work_dir, local_state):
    from flows.end_to_end import EndToEndConfig, end_to_end
    from infra import registry as reg

    config = EndToEndConfig(
        train={**TINY_TRAIN, "seq_length": 128},  # the SFT conversations are 128 tokens long
        serve={"port": free_port(), "model_name": "e2e-sft"},
        validation_threshold=9.5,
        # the answers' quality is test_sft_flow's (from a fresh base); a base pretrained for 12 steps on
        # KJV text keeps continuing verses after 120 SFT steps, so only the loss check is asked of it here
        sft={"train": {**TINY_SFT, "min_answer_rate": 0.0}, "data": DATA},
    )
    summary = end_to_end(config)

    state = reg.ModelRegistry(str(work_dir / "registry")).read()
    base, tuned = summary["registered_model"], summary["sft"]["model"]
    assert state.promoted == base  # the first model is promoted; the fine-tuned one only when asked
    assert state.models[tuned].parent == base
    assert state.models[tuned].checkpoint == summary["sft"]["checkpoint"] != state.models[base].checkpoint
    assert summary["sft"]["held_out_loss"] < summary["sft"]["base_held_out_loss"]
