"""`nemoflow demo --steps N`: a shorter CPU demo that keeps the deployment's own settings."""

from __future__ import annotations

import pytest

from flows.end_to_end import EndToEndConfig
from nemoflow.commands import demo


def test_the_shorter_demo_keeps_the_slurm_deployments_settings_and_validates():
    config = demo.demo_parameters("end-to-end/slurm", steps=20, gpus=0)["config"]
    parsed = EndToEndConfig.model_validate(config)  # what the flow does with the run's parameter
    assert parsed.executor.kind == "slurm" and parsed.train.cpus_per_task == 1  # prefect.yaml's, carried over
    assert (parsed.train.max_steps, parsed.train.ckpt_every_n_steps, parsed.train.val_check_interval) == (20, 20, 20)
    assert parsed.train.hidden_size == EndToEndConfig().train.hidden_size  # still the demo's model


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [(None, None, None), (12, None, 12), (None, "8", 8), (12, "8", 12)],
)
def test_steps_come_from_the_flag_else_the_environment(monkeypatch, flag, env, expected):
    if env is None:
        monkeypatch.delenv(demo.STEPS_ENV, raising=False)
    else:
        monkeypatch.setenv(demo.STEPS_ENV, env)
    assert demo.demo_steps(flag) == expected


@pytest.mark.parametrize(
    ("flag", "env", "message"), [(0, None, "at least 1"), (None, "ten", "NEMOFLOW_DEMO_STEPS='ten'")]
)
def test_bad_steps_are_refused_by_name(monkeypatch, flag, env, message):
    monkeypatch.delenv(demo.STEPS_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(demo.STEPS_ENV, env)
    with pytest.raises(ValueError, match=message):
        demo.demo_steps(flag)
