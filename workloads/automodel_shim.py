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
