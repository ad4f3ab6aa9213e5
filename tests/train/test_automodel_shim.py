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


def test_a_save_does_not_wait_for_the_previous_write():
    """AutoModel's lock is held for a whole background write; its ``execute_save`` took the same lock on the
    training thread, so the optimizer's half of a save waited for the model's write (17-21 s per 1.1B save on
    the H200, in a profile of the saves). Once the writer process exists, a save starts while a write holds
    the lock; before it exists, the save still waits for the lock and creates the process once."""
    import threading
    import time

    import torch.distributed.checkpoint._async_process_executor as executor
    from nemo_automodel.components.checkpoint._torch_backports import apply_async_checkpoint_patch

    apply_async_checkpoint_patch()
    executor_class = executor._ProcessBasedAsyncCheckpointExecutor
    saved = (
        executor_class.execute_save,
        executor_class._nemo_orig_execute_save,
        executor._CHECKPOINT_PROCESS,
        executor._AsyncCheckpointProcess,
        executor._ProcessGroupInitInfo,
        getattr(executor_class, "_nemoflow_unlocked", False),
    )
    started = []
    created = []
    try:
        executor_class._nemo_orig_execute_save = lambda self, *args, **kwargs: started.append(time.monotonic())
        executor._AsyncCheckpointProcess = lambda pg_init_info: created.append(pg_init_info) or "process"
        executor._ProcessGroupInitInfo = lambda group: ("init", group)
        executor_class._nemoflow_unlocked = False
        executor._CHECKPOINT_PROCESS = "process"

        def write_holding_the_lock(seconds: float) -> threading.Thread:
            held = threading.Event()

            def hold():
                with executor._NEMO_CREATE_LOCK:
                    held.set()
                    time.sleep(seconds)

            thread = threading.Thread(target=hold)
            thread.start()
            held.wait()
            return thread

        # AutoModel's execute_save, as it is: the save waits for the write
        writer = write_holding_the_lock(1.0)
        begin = time.monotonic()
        executor_class.execute_save(object(), process_group=None)
        assert started[-1] - begin >= 0.9
        writer.join()

        automodel_shim.unlock_started_saves()
        writer = write_holding_the_lock(1.0)
        begin = time.monotonic()
        executor_class.execute_save(object(), process_group=None)
        assert started[-1] - begin < 0.5, "the save waited for the previous write"
        writer.join()
        assert created == []

        executor._CHECKPOINT_PROCESS = None  # no writer process yet: wait for the lock, create it once
        writer = write_holding_the_lock(0.5)
        begin = time.monotonic()
        executor_class.execute_save(object(), process_group="group")
        executor_class.execute_save(object(), process_group="group")
        writer.join()
        assert started[-2] - begin >= 0.4
        assert created == [("init", "group")] and executor._CHECKPOINT_PROCESS == "process"
    finally:
        (
            executor_class.execute_save,
            executor_class._nemo_orig_execute_save,
            executor._CHECKPOINT_PROCESS,
            executor._AsyncCheckpointProcess,
            executor._ProcessGroupInitInfo,
            executor_class._nemoflow_unlocked,
        ) = saved
