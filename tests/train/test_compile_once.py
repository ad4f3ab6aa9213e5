"""A compiled run (enable_compile: one compiled region per decoder layer) compiles each graph once: its training
forward builds no KV cache (run.py without_kv_cache), so every layer shares one compiled graph, and validation
runs eager (loop.py), so no_grad compiles nothing again. Checked on a real compiled CPU run with torch's own
recompilation log (TORCH_LOGS=recompiles): before, each layer after the first recompiled in the first step
(guarded on the cache's state) and again in the first validation (grad mode)."""

from __future__ import annotations

import json

import pytest

from tests.train.helpers import read_metrics, run_trainer, tiny_config_file


@pytest.mark.slow
def test_a_compiled_run_compiles_its_layers_once_and_validates_without_compiling(tmp_path, train_dataset):
    run_dir = tmp_path / "run"
    config = tiny_config_file(
        train_dataset,
        run_dir,
        tmp_path / "config.json",
        num_layers=3,
        enable_compile=True,
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        ckpt_every_n_steps=100,
        ckpt_async_min_mib=256,
    )
    done = run_trainer(config, timeout=600, TORCH_LOGS="recompiles", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Recompiling function" not in out, [line for line in out.splitlines() if "guard failure" in line][:5]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4]  # the validations ran, eager
    # the runtime change only: the exported model still asks for a KV cache when it generates
    exported = json.loads((run_dir / "checkpoints" / "LATEST" / "model" / "consolidated" / "config.json").read_text())
    assert exported.get("use_cache", True) is True
