"""Let NeMo AutoModel's pretraining recipe run on machines without CUDA (the CPU demo and CI).

AutoModel 0.7.0 trains on CPU with the gloo backend except for a few calls that
assume a GPU. This module is the ONLY place that works around them; it changes
nothing when CUDA is available. Each workaround names the AutoModel function whose
source it depends on, with a fingerprint of that source (:data:`PATCHED`):
``tests/train/test_automodel_shim.py`` fails when an AutoModel upgrade changes one of
them, so the shim is re-checked (or deleted) rather than silently patching code
that no longer does what it assumed.

The calls, as of 0.7.0:

* ``TrainFinetuneRecipeForNextTokenPrediction.setup`` and ``.log_train_metrics``
  call ``torch.cuda.reset_peak_memory_stats()`` unconditionally; a CPU build of
  torch raises (no ``_cuda_resetPeakMemoryStats``). Replaced by a no-op that still
  forwards to the real function whenever CUDA is available.
* ``NeMoAutoModelForCausalLM.from_config`` / ``.from_pretrained`` build the model's
  device as ``torch.device("cuda", torch.cuda.current_device())`` and hand it to
  ``instantiate_infrastructure`` and ``apply_model_infrastructure``, which move the
  model there. The two names, as imported into ``nemo_automodel._transformers.auto_model``,
  are wrapped to receive the CPU device instead, and ``current_device`` as seen by
  that module answers 0 instead of raising.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from dataclasses import dataclass

import torch

# AutoModel version the fingerprints below were taken from.
AUTOMODEL_VERSION = "0.7.0"


@dataclass(frozen=True)
class Patched:
    """One AutoModel function whose hard-coded CUDA assumption the shim works around."""

    qualname: str  # "module:Object.attr"
    needle: str  # the CUDA call the function must still contain for the shim to be needed
    sha256: str  # fingerprint of the function's source at AUTOMODEL_VERSION


PATCHED = (
    Patched(
        "nemo_automodel.recipes.llm.train_ft:TrainFinetuneRecipeForNextTokenPrediction.setup",
        "torch.cuda.reset_peak_memory_stats()",
        "778234fc20a7f259ea78387308dfaaa74dfd145474ee8f012a244446a4089787",
    ),
    Patched(
        "nemo_automodel.recipes.llm.train_ft:TrainFinetuneRecipeForNextTokenPrediction.log_train_metrics",
        "torch.cuda.reset_peak_memory_stats()",
        "aff089209f6b6572d82e95122eda8af1ee52e26c54b864df3975c92405454d52",
    ),
    Patched(
        "nemo_automodel._transformers.auto_model:_BaseNeMoAutoModelClass.from_config",
        'device=torch.device("cuda", torch.cuda.current_device())',
        "5d9a0cad45c5f481d19711061dae1d19b7b64e047ed0bce72249c115ef2678ff",
    ),
    Patched(
        "nemo_automodel._transformers.auto_model:_BaseNeMoAutoModelClass.from_pretrained",
        'device=torch.device("cuda", torch.cuda.current_device())',
        "50b898440ad3201723048f1bed0be8540b27212276b17593754c5f7d27768832",
    ),
)


def resolve(qualname: str):
    """The function ``module:Object.attr`` names (unwrapped from classmethod)."""
    import importlib

    module_name, _, path = qualname.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(getattr(obj, "__func__", obj))


def source_sha256(qualname: str) -> str:
    return hashlib.sha256(inspect.getsource(resolve(qualname)).encode()).hexdigest()


_applied = False


def apply() -> bool:
    """Install the CPU workarounds when CUDA is unavailable; returns whether anything was patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import nemo_automodel._transformers.auto_model as auto_model

    real_reset = torch.cuda.reset_peak_memory_stats

    def reset_peak_memory_stats(device=None) -> None:
        if torch.cuda.is_available():
            real_reset(device)

    torch.cuda.reset_peak_memory_stats = reset_peak_memory_stats

    cpu = torch.device("cpu")
    real_instantiate = auto_model.instantiate_infrastructure
    real_apply = auto_model.apply_model_infrastructure

    def instantiate_infrastructure(*args, **kwargs):
        kwargs["device"] = cpu
        return real_instantiate(*args, **kwargs)

    def apply_model_infrastructure(*args, **kwargs):
        kwargs["device"] = cpu
        return real_apply(*args, **kwargs)

    auto_model.instantiate_infrastructure = instantiate_infrastructure
    auto_model.apply_model_infrastructure = apply_model_infrastructure
    # `torch` as auto_model sees it: a proxy whose cuda.current_device() answers 0 (the device is replaced above).
    auto_model.torch = _TorchWithCpuCurrentDevice()
    _applied = True
    return True


class _CudaView:
    def __getattr__(self, name):
        if name == "current_device":
            return _zero
        return getattr(torch.cuda, name)


def _zero() -> int:
    return 0


class _TorchWithCpuCurrentDevice:
    """``torch`` for one AutoModel module, except that ``torch.cuda.current_device()`` returns 0 on CPU."""

    cuda = _CudaView()

    def __getattr__(self, name):
        return getattr(torch, name)


# ---------------------------------------------------------------------------------------- the dataset helper
def pin_ninja() -> str | None:
    """Put this environment's ``ninja`` (constraints.txt pins it) first on PATH; returns its path, or None.

    AutoModel compiles its Megatron dataset helper with whichever ``ninja`` PATH finds, into one cache
    directory per user and environment (``compile_helper``). Ninja versions hash command lines differently
    in ``.ninja_log`` (1.11's and 1.13's disagree), so a build by the system's ninja (a shell without the
    venv on PATH: ``scripts/setup.sh`` did this) and the next by the venv's rebuild the helper each time:
    35 s or more of a CPU demo's first training. Called before AutoModel builds its datasets.
    """
    import os
    import shutil
    import sys

    here = os.path.dirname(sys.executable)  # the venv's bin (sys.executable is not resolved through links)
    ninja = os.path.join(here, "ninja")
    if not os.access(ninja, os.X_OK):
        return None
    if shutil.which("ninja") != ninja:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return ninja


def build_dataset_helper() -> None:
    """Compile (or find cached) AutoModel's dataset helper with this environment's ninja: the install
    (``scripts/setup.sh``, the offline install) builds it here so the first training run does not."""
    pin_ninja()
    from nemo_automodel.components.datasets.llm.megatron.megatron_utils import compile_helper

    compile_helper()


# ---------------------------------------------------------------------------------------- asynchronous saves
# AutoModel functions keep_staging_buffers relies on (checked like PATCHED by tests/train/test_automodel_shim.py).
STAGING = (
    Patched(
        "nemo_automodel.components.checkpoint.checkpointing:Checkpointer._release_async_stager",
        "context.stager.close()",
        "4ec08af048b0475e12e9d7db811e9b338157dce7c8704a2ef990742b2c74ad6d",
    ),
    Patched(
        "nemo_automodel.components.checkpoint.checkpointing:Checkpointer._do_save",
        "ctx.stager = DefaultStager()",
        "8c9b09865e9f7378b6742388c7d56b68806c6a916403e3568ea269946dd454d2",
    ),
    Patched(
        "nemo_automodel.components.checkpoint._torch_backports:apply_async_checkpoint_patch",
        "ape_mod._CHECKPOINT_PROCESS = AsyncCheckpointProcess(pg_init_info=pg_init_info)",
        "5e6119962650a5ad8e59f4d8bbf09919f1c560ee7fe889802fb3eeb32d777a8e",
    ),
    Patched(  # publish_written_save (workloads/train/loop.py) reads the pending save and the save futures
        "nemo_automodel.components.checkpoint.lifecycle:CheckpointLifecycle.defer_publication",
        "self._pending_checkpoint_dir = path",
        "b1a71c4d23059aea6ffe2ba329f405d43d9c8a82367369b0ac21b4362886e57e",
    ),
    Patched(
        "nemo_automodel.components.checkpoint.checkpointing:Checkpointer.async_wait",
        "self._model_ctx.future.upload_completion.result()",
        "f4204eef023314158d8fe6ae1f6b1ec0af2140e0ee79ff79e3fb7f8953345fc8",
    ),
    Patched(  # parallel_writes wraps it: _do_save hands it every save's storage writer
        "nemo_automodel.components.checkpoint.checkpointing:_maybe_msc_writer",
        "return storage_writer",
        "909fd457e418b47e21a0e7a2ac2ba5de70d683464ff242a9de85ed6b271ee9b6",
    ),
    Patched(
        "nemo_automodel.components.checkpoint.checkpointing:Checkpointer.__init__",
        "self._model_ctx.stager = DefaultStager()",
        "8b25750490cc0aa63bdb156892bee6d62577184e135475cd5d2333a5ae6cde09",
    ),
)


def keep_staging_buffers(cuda: bool) -> None:
    """Asynchronous saves whose host-memory staging buffers live for the whole run (GPU and CPU).

    AutoModel 0.7 saves asynchronously with torch.distributed.checkpoint: a ``DefaultStager`` copies the
    state into pinned, shared host memory on a side CUDA stream (the loop waits for it only before the next
    optimizer step), and a background process writes it to disk. But it closes its stagers after every save
    (``Checkpointer._release_async_stager``), so every save pins and shares a fresh copy of the whole state
    (~13 GB for a 1.1B model under bf16-mixed): most of the ~21 s each save blocked on an H200 (README).
    The stager caches its buffers per source storage, and the weights and optimizer moments keep their
    storage for the whole run, so one stager per state (AutoModel keeps one for the model and one for the
    optimizer) copies into the same buffers every time, as torchtitan does. They are closed with the
    checkpointer (``Checkpointer.close``).

    On CPU (the demo, the test suite) the same path runs with what a CPU has: no pinned memory, no CUDA
    stream, the copy in the stager's background thread.
    """
    import nemo_automodel.components.checkpoint.checkpointing as checkpointing
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=cuda
    )

    class KeptStager(DefaultStager):
        """A stager that outlives ``close()`` calls made after each save.

        torch 2.11's ``async_save`` closes the stager it is handed once a save is written (2.13 closes only
        stagers it created itself); a closed StateDictStager has cleared its deep-copy table and shut its
        thread down, so the next save failed (``KeyError: <class 'type'>``, seen on the H200). The buffers
        are freed with the process, right after training and the export.
        """

        def close(self) -> None:
            return None

    checkpointing.DefaultStager = lambda: with_atomic_copies(KeptStager(options))
    checkpointing.Checkpointer._release_async_stager = staticmethod(_keep_stager)


def with_atomic_copies(stager):
    """The stager never deep-copies classes, functions, ranges or properties: they are kept as they are, as
    Python's ``copy`` and torch 2.13's stager do. torch 2.11's stager failed on a state that holds a class
    (reached through an object's ``__reduce_ex__``) with ``KeyError: <class 'type'>`` (seen on the H200): its
    deep-copy table had no entry for it. The entries are added where missing, and the copy itself returns such
    objects at once, whatever the table holds (the recursive calls go through the instance attribute, so every
    level of the state passes through it)."""
    import types
    import weakref

    atomic = (type, range, types.BuiltinFunctionType, types.FunctionType, types.CodeType, weakref.ref, property)
    inner = getattr(stager, "_state_dict_stager", None)
    dispatch = getattr(inner, "_deepcopy_dispatch", None)
    if dispatch is not None:
        for kind in atomic:
            dispatch.setdefault(kind, _atomic)
    if inner is not None and dispatch is not None:
        # torch 2.11 clears the inner stager after a save (its close() empties the table: the next save then
        # recursed without end on the H200); it serves every save of the run, so it is never closed.
        inner.close = lambda: None
    copy = getattr(inner, "deepcopy_with_tensor_offload", None)
    if copy is not None:

        def deepcopy_with_tensor_offload(x, memo=None, _nil=[], non_blocking=False):  # noqa: B006 - torch's signature
            if isinstance(x, atomic):
                return x
            return copy(x, memo, _nil, non_blocking=non_blocking)

        inner.deepcopy_with_tensor_offload = deepcopy_with_tensor_offload
    return stager


def _atomic(x, memo, non_blocking=False):
    return x


def _keep_stager(context) -> None:
    """Replaces ``Checkpointer._release_async_stager``: the stager (and its buffers) serve the next save too."""


def start_checkpoint_process(process_group) -> threading.Thread:
    """Start torch.distributed.checkpoint's background writer process now, in a thread, not in the first save.

    AutoModel makes the writer's start synchronous inside the first asynchronous save
    (``apply_async_checkpoint_patch``: a lock around the creation of the global process, so that all ranks
    agree on it); a process start (a Python with torch, a gloo group) blocked that save for seconds. This
    creates it the same way, under AutoModel's lock, while the model compiles and the first steps run; the
    first save finds it ready, or waits on the lock for what is left. Every rank calls it at the same point
    (after the recipe's setup) with the checkpointer's own gloo group, which nothing else uses meanwhile.
    """
    import torch.distributed.checkpoint._async_process_executor as executor

    def create() -> None:
        with executor._NEMO_CREATE_LOCK:
            if executor._CHECKPOINT_PROCESS is None:
                init = executor._ProcessGroupInitInfo(process_group)
                executor._CHECKPOINT_PROCESS = executor._AsyncCheckpointProcess(pg_init_info=init)

    unlock_started_saves()
    thread = threading.Thread(target=create, name="nemoflow-dcp-process", daemon=True)
    thread.start()
    return thread


def unlock_started_saves() -> None:
    """A save no longer waits for the previous save's write to finish.

    AutoModel's patch (``apply_async_checkpoint_patch``) takes one lock in two places: around the whole
    background write (``_execute_save_impl``: waiting for the staged copy, sending it to the writer process,
    waiting for its answer) and, on the training thread, in ``execute_save``, to check whether the writer
    process exists. A save is two ``async_save`` calls (the model, then the optimizer), so the optimizer's call
    waited on the training thread for the model's whole write: 17-21 s blocked per save of the 1.1B model on
    an H200, found by profiling the saves (``NEMOFLOW_PROFILE_SAVES``). Here the training thread takes the
    lock only while the process does not exist yet (the first save, if the process started by
    ``start_checkpoint_process`` is not ready); the writes themselves stay one after another under the lock.
    """
    import torch.distributed.checkpoint._async_process_executor as executor

    executor_class = getattr(executor, "_ProcessBasedAsyncCheckpointExecutor", None)
    original = getattr(executor_class, "_nemo_orig_execute_save", None)
    if original is None or getattr(executor_class, "_nemoflow_unlocked", False):
        return

    def execute_save(self, *args, **kwargs):
        if executor._CHECKPOINT_PROCESS is None:
            with executor._NEMO_CREATE_LOCK:
                if executor._CHECKPOINT_PROCESS is None:
                    init = executor._ProcessGroupInitInfo(kwargs.get("process_group"))
                    executor._CHECKPOINT_PROCESS = executor._AsyncCheckpointProcess(pg_init_info=init)
        return original(self, *args, **kwargs)

    executor_class.execute_save = execute_save
    executor_class._nemoflow_unlocked = True


def parallel_writes(threads: int, keep_writing: bool = False) -> None:
    """Every checkpoint save writes ``threads`` files per rank at once (workloads/checkpoint_writers.py).

    AutoModel's ``_do_save`` passes each save's storage writer through ``_maybe_msc_writer`` (None for the
    optimizer state: DCP then builds a one-file-per-rank ``FileSystemWriter``; AutoModel's safetensors writer for
    the weights); the wrapper returns the parallel writers instead. Synchronous saves use them too.
    ``keep_writing`` (``ckpt_while_writing: replace``): a save the writer process received outlives the trainer.
    """
    import nemo_automodel.components.checkpoint.checkpointing as checkpointing

    from workloads import checkpoint_writers

    real = getattr(checkpointing._maybe_msc_writer, "__wrapped__", checkpointing._maybe_msc_writer)

    def maybe_msc_writer(path, storage_writer):
        return checkpoint_writers.parallel(real(path, storage_writer), path, threads, keep_writing)

    maybe_msc_writer.__wrapped__ = real
    checkpointing._maybe_msc_writer = maybe_msc_writer


def writer_alive() -> bool:
    """Whether torch.distributed.checkpoint's background writer process of this rank is running (or not started)."""
    import torch.distributed.checkpoint._async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    return process is None or process._save_process.is_alive()


def writer_exit_code() -> int | None:
    """The exit code of this rank's writer process if it died (-9: SIGKILL), else None. torch's own error may say
    "Exit code: None": it saw the pipe close before the process was reaped; this waits for the reaping."""
    import torch.distributed.checkpoint._async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is None or process._save_process.is_alive():
        return None
    process._save_process.join(timeout=10)
    return process._save_process.exitcode


def replace_writer(process_group) -> threading.Thread:
    """Drop this rank's writer process (dead, or alive in a group with a dead peer) and start a new one in the
    background, as at setup. Every rank calls it at the same point: the new processes form a new gloo group."""
    import torch.distributed.checkpoint._async_process_executor as executor

    with executor._NEMO_CREATE_LOCK:
        old, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if old is not None and old._save_process.is_alive():
        old._save_process.kill()
        old._save_process.join(timeout=30)
    return start_checkpoint_process(process_group)


class Prestage:
    """The staging buffers of the first save allocated, pinned and shared in the background, before that save.

    The first asynchronous save after start-up blocked 5.6-8.9 s on an H200 (issue 34): its stagers allocated a
    shared, pinned host copy of every tensor of the state (13 GB for a 1.1B model). Here each stager stages every
    tensor it will be handed once, in a background thread: the model's weights at once (while the first step
    compiles), the optimizer's state after the first optimizer step creates it (AdamW's moments do not exist
    before). The buffers are cached per source storage (``keep_staging_buffers``), so the first save copies into
    them like every later one. On a GPU the copies run on a side stream (their contents are overwritten by the
    save; only the allocation and the pinning matter); on a CPU there is no pinning and it is the allocation.
    The first save joins the thread (the time it still waited is on record in ``checkpoint_save_s``).
    """

    def __init__(self, model_stager, model_tensors, cuda: bool):
        self.cuda = cuda
        # this rank's GPU: a new thread's current device is GPU 0, whatever the rank set on its main thread
        self.device = torch.cuda.current_device() if cuda else None
        self.optimizer_ready = threading.Event()
        self.optimizer_work: tuple | None = None
        self.bytes = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(model_stager, model_tensors), name="nemoflow-prestage", daemon=True
        )
        self.thread.start()

    def optimizer(self, stager, tensors) -> None:
        """The optimizer's state exists now (after the first optimizer step): stage it too."""
        if not self.optimizer_ready.is_set():
            self.optimizer_work = (stager, list(tensors))
            self.optimizer_ready.set()

    def join(self) -> None:
        self.optimizer_ready.set()  # a save before any optimizer step: only the weights are staged
        self.thread.join()

    def _run(self, model_stager, model_tensors) -> None:
        import contextlib
        import time

        started = time.perf_counter()
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream() if self.cuda else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.bytes += _stage_storages(model_stager, model_tensors, self.cuda)
                self.optimizer_ready.wait()
                if self.optimizer_work is not None:
                    self.bytes += _stage_storages(*self.optimizer_work, self.cuda)
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - the save then allocates its buffers itself, as before
            self.error = exc
        self.seconds = time.perf_counter() - started


def _stage_storages(stager, tensors, cuda: bool) -> int:
    """Stage each tensor's storage once through ``stager`` (allocating its cached buffer); the bytes staged."""
    inner = stager._state_dict_stager
    staged = 0
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor (FSDP2): its shard is what is staged
        if not isinstance(local, torch.Tensor) or local.data_ptr() == 0:
            continue
        storage = local.untyped_storage()
        if storage in inner._cached_storage_mapping:
            continue
        try:
            buffer = inner._stage_untyped_storage(storage, non_blocking=cuda)
        except TypeError:  # a torch whose stager has no non_blocking argument
            buffer = inner._stage_untyped_storage(storage)
        staged += buffer.nbytes()
    return staged


def staged_bytes(stager) -> int:
    """The bytes of host buffers ``stager`` holds (cached per source storage)."""
    return sum(s.nbytes() for s in stager._state_dict_stager._cached_storage_mapping.values())


def optimizer_tensors(optimizers) -> list:
    """Every tensor of the optimizers' state (AdamW: step, exp_avg, exp_avg_sq per parameter)."""
    return [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
