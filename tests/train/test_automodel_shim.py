"""The CPU shim patches exactly the AutoModel code it was written against, and nothing on GPUs."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

from workloads import automodel_shim

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def test_automodel_version_is_the_one_the_shim_was_written_for():
    assert importlib.metadata.version("nemo-automodel") == automodel_shim.AUTOMODEL_VERSION


@pytest.mark.parametrize(
    "patched", automodel_shim.PATCHED + automodel_shim.STAGING, ids=lambda p: p.qualname.split(":")[1]
)
def test_patched_functions_are_unchanged(patched):
    """Fails when an AutoModel upgrade changes a function the shim works around: re-check the shim, then
    update the fingerprint (or delete the workaround when the CUDA call is gone)."""
    source = inspect.getsource(automodel_shim.resolve(patched.qualname))
    assert patched.needle in source, f"{patched.qualname} no longer calls {patched.needle}: is the shim still needed?"
    assert automodel_shim.source_sha256(patched.qualname) == patched.sha256, (
        f"{patched.qualname} changed since nemo-automodel {automodel_shim.AUTOMODEL_VERSION}; re-check the shim"
    )


def test_apply_builds_a_cpu_model_through_automodel():
    """The shim's two device hooks in action: AutoModel's from_config builds a CPU model without CUDA."""
    import torch

    if torch.cuda.is_available():
        assert automodel_shim.apply() is False  # nothing is patched where CUDA exists
        return
    from transformers import LlamaConfig

    assert automodel_shim.apply() is True
    torch.cuda.reset_peak_memory_stats()  # a no-op now instead of an AttributeError on a CPU build
    from nemo_automodel import NeMoAutoModelForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = NeMoAutoModelForCausalLM.from_config(config, torch_dtype="float32")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


def test_kept_stagers_survive_the_close_torch_2_11_calls_after_each_save():
    """torch 2.11's async_save closes the stager it is given after each save (a closed stager has cleared its
    deep-copy table: the next save failed on the H200 with KeyError: <class 'type'>). The stager nemoflow
    gives AutoModel stages the same state again after a close(), into the same buffers."""
    import nemo_automodel.components.checkpoint.checkpointing as checkpointing
    import torch

    saved = (checkpointing.DefaultStager, checkpointing.Checkpointer._release_async_stager)
    try:
        automodel_shim.keep_staging_buffers(cuda=False)
        stager = checkpointing.DefaultStager()
        stager._state_dict_stager._deepcopy_dispatch.pop(type)  # torch 2.11's table: no entry for classes
        state = {"weight": torch.arange(4.0), "kind": torch.nn.Linear, "groups": [{"lr": 0.1}]}
        first = stager.stage(state).result()
        stager.close()  # what a torch version may do after the save
        stager._state_dict_stager.close()  # and what torch 2.11 did to the inner stager (its table emptied)
        state["weight"] += 1
        second = stager.stage(state).result()
        assert second["kind"] is torch.nn.Linear and second["groups"] == [{"lr": 0.1}]
        assert torch.equal(second["weight"], state["weight"])
        assert second["weight"].untyped_storage().data_ptr() == first["weight"].untyped_storage().data_ptr()
    finally:
        checkpointing.DefaultStager, checkpointing.Checkpointer._release_async_stager = saved


def test_staging_never_copies_a_class_where_the_table_lacks_type():
    """The failure on the H200 (torch 2.11): a class in the state met a stager whose deep-copy table had no
    ``type`` entry. Without the entry (removed here), the state still stages, classes kept as they are."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )
    state = {"weight": torch.ones(3), "kind": torch.nn.Linear, "nested": [("adamw", torch.optim.AdamW)]}
    bare = DefaultStager(options)
    bare._state_dict_stager._deepcopy_dispatch.pop(type)
    with pytest.raises(KeyError):
        bare.stage(state)
    fixed = automodel_shim.with_atomic_copies(DefaultStager(options))
    fixed._state_dict_stager._deepcopy_dispatch.pop(type)
    staged = fixed.stage(state)
    assert staged["kind"] is torch.nn.Linear and staged["nested"][0][1] is torch.optim.AdamW
    assert torch.equal(staged["weight"], state["weight"]) and staged["weight"] is not state["weight"]


# The trainer's save path for real: a gloo group, AutoModel's patch, the shim's start_checkpoint_process (what
# workloads/train/ calls), torch's background writer process, and two async_save calls (a save's model and
# optimizer halves). The disk is slow on purpose: tests.support.gated_writer holds the first write inside
# the writer process until the gate file exists, so "the write is still running" is a fact, not a sleep.
SAVE_TWICE = """
import json, sys, threading, time
from pathlib import Path


def main():
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from nemo_automodel.components.checkpoint._torch_backports import apply_async_checkpoint_patch
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from tests.support.gated_writer import GatedWriter
    from workloads import automodel_shim

    out, port = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    apply_async_checkpoint_patch()
    automodel_shim.start_checkpoint_process(None).join()
    gate, started = out / "gate", out / "started"

    def save(name, state):
        writer = GatedWriter(str(out / name), gate=str(gate), started=str(started))
        return dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    model = {"w": torch.arange(1000, dtype=torch.float32)}
    optim = {"m": torch.arange(500, dtype=torch.float32) * 2}
    first = save("model", model)
    while not started.exists():  # the writer process is inside the first write, holding AutoModel's lock
        time.sleep(0.02)
    second = {}

    def save_optimizer():
        second["future"] = save("optim", optim)
        second["gate_was_open"] = gate.exists()

    thread = threading.Thread(target=save_optimizer, daemon=True)
    thread.start()
    thread.join(float(sys.argv[3]))  # only broken code waits this long: the call returns at once otherwise
    returned = "future" in second and not second["gate_was_open"]
    gate.touch()  # the slow disk finishes the first write
    thread.join(600)
    first.result()
    second["future"].result()
    loaded = {"w": torch.zeros(1000)}, {"m": torch.zeros(500)}
    dcp.load(loaded[0], checkpoint_id=str(out / "model"))
    dcp.load(loaded[1], checkpoint_id=str(out / "optim"))
    same = torch.equal(loaded[0]["w"], model["w"]) and torch.equal(loaded[1]["m"], optim["m"])
    print(json.dumps({"returned_while_first_write_blocked": returned, "both_saves_load_back": same}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # the writer process is spawned: it imports this file again
    main()
"""


@pytest.mark.slow
def test_a_save_does_not_wait_for_the_previous_write(tmp_path):
    """AutoModel's lock is held for a whole background write; its ``execute_save`` took the same lock on the
    training thread, so the optimizer's half of a save waited for the model's write (17-21 s per 1.1B save on
    the H200, in a profile of the saves). With the shim's writer process started, the second ``async_save``
    returns while the first write is held on the slow disk, and both checkpoints load back whole."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, free_port

    script = tmp_path / "save_twice.py"
    script.write_text(SAVE_TWICE)
    (tmp_path / "out").mkdir()
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), str(free_port()), "60"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))),
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and results, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(results[-1])
    assert result["both_saves_load_back"], result
    assert result["returned_while_first_write_blocked"], "the optimizer's save waited for the model's write"
