"""Which MoE implementation a Mixtral run trains with, and its AutoModel backend (no torch import here).

``TrainConfig.moe_impl``:

* ``grouped`` (and ``auto``): NeMo AutoModel's own MoE layers, the Mixtral of workloads/moe_model.py:
  experts as ``torch._grouped_mm`` over tokens sorted by expert, expert parallelism
  (``expert_model_parallel_size``), checkpoints in the Hugging Face Mixtral layout;
* ``hf``: transformers' ``MixtralForCausalLM`` as it is (``force_hf``), sharded by FSDP2: its experts run
  one after another, it has no expert parallelism and it does not compile (see train._engine_limits).
"""

from __future__ import annotations

from typing import Literal

MoEImpl = Literal["grouped", "hf"]
MOE_IMPLS = ("auto", "grouped", "hf")


def resolve_moe_impl(arch: str, moe_impl: str) -> MoEImpl | None:
    """The implementation a run uses: None for a dense model, ``grouped`` for ``auto``."""
    if arch != "mixtral":
        return None
    return "hf" if moe_impl == "hf" else "grouped"


def backend_config(cuda: bool) -> dict:
    """AutoModel ``BackendConfig`` (the recipe's ``model.backend``) for the grouped Mixtral.

    Pure-PyTorch kernels, since neither Transformer Engine nor DeepEP is part of nemoflow's install:
    SDPA attention, torch linears, ``torch._grouped_mm`` experts (``torch_mm``), the all-gather token
    dispatcher (``torch``: expert parallelism over NCCL or gloo); RMSNorm in fp32 on GPUs (AutoModel's
    compiled ``torch_fp32``, as HF Mixtral upcasts), plain ``torch`` on CPU, where everything is fp32.
    """
    return {
        "attn": "sdpa",
        "linear": "torch",
        "rms_norm": "torch_fp32" if cuda else "torch",
        "rope_fusion": False,
        "experts": "torch_mm",
        "dispatcher": "torch",
        "enable_hf_state_dict_adapter": True,
    }
