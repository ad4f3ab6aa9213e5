"""Mixtral on NeMo AutoModel's own MoE layers: grouped-GEMM experts, expert parallelism, HF Mixtral checkpoints.

The Hugging Face ``MixtralForCausalLM`` runs its experts one after another (a Python loop over
experts) and does not compile under FSDP2 (transformers' grouped_mm fallback backward guards on a
data-dependent size). NeMo AutoModel 0.7 has no Mixtral of its own, but its MiniMax-M2 model is a
Mixtral-style decoder built from its MoE components, and with the settings below it IS Mixtral:

* attention: q/k/v/o projections, GQA, rotary embeddings over the whole head (``rotary_dim = head_dim``),
  no q/k norm (``use_qk_norm=False``), SDPA;
* router (``nemo_automodel.components.moe.layers.Gate``): ``score_func="softmax"`` with
  ``softmax_before_topk`` (softmax over all experts, then top-k) and ``norm_topk_prob`` (the top-k
  weights renormalised to sum to 1), no router bias, no shared experts, no score-correction bias
  (MiniMax's DeepSeek-style bias balancing, ``gate_bias_update_factor``, is switched off);
* experts (``nemo_automodel.components.moe.experts.GroupedExperts``): SwiGLU, gate and up projections
  fused as ``gate_and_up_projs [E, hidden, 2 x ffn]`` and ``down_projs [E, ffn, hidden]``, computed with
  ``torch._grouped_mm`` over tokens sorted by expert (``backend.experts="torch_mm"``); with expert
  parallelism the parameters are DTensors sharded over the ``ep`` mesh and tokens are all-gathered /
  reduced across it (``dispatcher="torch"``: collectives that gloo also runs);
* checkpoints: ``MiniMaxM2StateDictAdapter`` converts to and from the original Mixtral layout
  (``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1/w2/w3.weight``), the layout
  Mistral's checkpoints use and transformers' ``MixtralForCausalLM`` loads (tests/train/test_moe.py
  checks the logits against it). The config written is the plain ``MixtralConfig``.

:func:`register` makes this class AutoModel's implementation of the ``MixtralForCausalLM``
architecture in the calling process (the trainer calls it when ``moe_impl`` resolves to ``grouped``);
``NeMoAutoModelForCausalLM.from_config`` / ``from_pretrained`` then build it for any Mixtral config,
and AutoModel's parallelizer shards it (FSDP2, plus expert parallel when ``ep_size > 1``).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from nemo_automodel.components.models.minimax_m2.model import MiniMaxM2ForCausalLM
from nemo_automodel.components.moe.experts import GroupedExperts

# Mixtral's routing on AutoModel's MoEConfig (the rest follows from the Mixtral config, see MiniMaxM2Model).
MIXTRAL_ROUTING = {
    "gate_bias_update_factor": 0.0,  # no DeepSeek-style score-correction bias updates
    "force_e_score_correction_bias": False,  # and no such buffer: Mixtral checkpoints have none
    "aux_loss_coeff": 0.0,  # load-balancing loss off unless asked for (moe_overrides, TrainConfig.moe_aux_loss_coeff)
}


def grouped_mm_available() -> bool:
    """``torch._grouped_mm`` exists (torch >= 2.8; on CUDA it needs bf16 and compute capability 9.0+ for speed)."""
    return hasattr(torch, "_grouped_mm")


class AutocastGroupedExperts(GroupedExperts):
    """GroupedExperts that follow ``torch.autocast`` and dispatch tokens without a device-to-host sync.

    Autocast: ``torch._grouped_mm`` is not on autocast's list, and GroupedExperts casts the expert weights to
    the input's dtype: under nemoflow's bf16-mixed on one GPU (fp32 master weights, bf16 autocast, no FSDP2
    cast) the residual stream arrives in fp32 and the experts would run in fp32. Casting the input to the
    autocast dtype makes them run in bf16 like every autocast linear; without autocast nothing changes.

    Dispatch: AutoModel's ``_permute_tokens_for_grouped_mm`` keeps the (token, expert) assignments of its
    local experts with boolean masks (``flat_indices[local_mask]``, ``local_mask.nonzero()``), whose result
    size the GPU must report to the host before the next kernel can be queued: 6 ``nonzero`` syncs a layer
    and step (the README's profile: 216 in 3 steps of the 12-layer moe-0.9b), which leave the GPU idle at
    small micro batches. Without expert parallelism every assignment is local, so their number is known
    on the host: tokens x top-k. :meth:`_forward_on_device` sorts all of them by expert, takes the
    grouped GEMM offsets from the sorted ids on the device (``searchsorted``: the cumulative counts,
    without ``bincount``, which sizes its output from the data), and gives a masked token's assignments
    the routing weight 0 instead of dropping them (its output and every gradient through it are exactly
    0, as when it is dropped; it costs its experts' FLOPs, and pretraining batches have no masked tokens).
    Every shape is static, so the per-layer compile sees one graph. The order of the sort, the offsets, the
    GEMMs and the scatter are those of AutoModel's path: the same numbers (tests/train/test_moe_sync.py).
    Expert parallelism (DTensor weights), expert biases, MXFP8 and ``apply_router_weight_after_down`` keep
    AutoModel's path.
    """

    def forward(self, x, token_mask, weights, indices):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        if self.dispatches_on_device():
            return self._forward_on_device(x, token_mask, weights, indices)
        return super().forward(x, token_mask, weights, indices)

    def dispatches_on_device(self) -> bool:
        """Whether this layer takes the sync-free path (see the class docstring for what keeps AutoModel's)."""
        from torch.distributed.tensor import DTensor

        return (
            self.use_torch_mm
            and not self.use_mxfp8
            and not self.expert_bias
            and not self.config.apply_router_weight_after_down
            and not isinstance(self.gate_and_up_projs, DTensor)
        )

    def _forward_on_device(self, x, token_mask, weights, indices):
        input_dtype = x.dtype
        num_tokens, top_k = indices.shape
        gate_and_up = self.gate_and_up_projs.to(x.dtype)
        down = self.down_projs.to(x.dtype)
        # Assignment s = token x top_k + j; stable, so a group keeps token order (as AutoModel's argsort).
        flat_experts = indices.reshape(-1)
        order = flat_experts.argsort(stable=True)
        sorted_experts = flat_experts[order]
        experts = torch.arange(self.n_routed_experts, device=indices.device, dtype=sorted_experts.dtype)
        offs = torch.searchsorted(sorted_experts, experts, right=True).to(torch.int32)
        token_ids = order // top_k
        probs = weights.float().masked_fill(~token_mask.unsqueeze(-1), 0.0).reshape(-1)[order].unsqueeze(-1)
        hidden = torch._grouped_mm(x[token_ids], gate_and_up, offs)
        hidden = self.expert_activation_grouped(hidden, probs)
        out = torch._grouped_mm(hidden, down, offs)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        y.scatter_add_(0, token_ids.unsqueeze(1).expand_as(out), out.float())
        return y.to(input_dtype)


def _minimax_view(config):
    """A copy of the Mixtral config with the attributes MiniMax-M2's constructor reads for Mixtral behaviour."""
    view = copy.deepcopy(config)
    view.scoring_func = "softmax"
    view.use_qk_norm = False
    if getattr(view, "head_dim", None) is None:
        view.head_dim = config.hidden_size // config.num_attention_heads
    return view


class MixtralForCausalLM(MiniMaxM2ForCausalLM):
    """transformers' ``MixtralForCausalLM``, rebuilt on AutoModel's MoE layers (see the module docstring)."""

    @classmethod
    def supports_config(cls, config) -> bool:
        """AutoModel's registry asks this before using the class for an architecture name."""
        return getattr(config, "model_type", None) == "mixtral"

    def __init__(self, config, moe_config=None, backend=None, **kwargs):
        if moe_config is None:
            kwargs["moe_overrides"] = {**MIXTRAL_ROUTING, **(kwargs.get("moe_overrides") or {})}
        super().__init__(_minimax_view(config), moe_config, backend, **kwargs)
        self.config = config  # the checkpoint's config.json: the plain MixtralConfig
        if getattr(self, "state_dict_adapter", None) is not None:
            self.state_dict_adapter.config = config
        for layer in self.model.layers.values():
            experts = layer.mlp.experts
            if type(experts) is GroupedExperts:
                experts.__class__ = AutocastGroupedExperts

    def _apply(self, fn, recurse=True):
        """Moves (``.cuda()``, ``.to(device)``, ``to_empty``) carry the rotary frequencies too, as they carry buffers.

        AutoModel's RotaryEmbedding is no buffer: it computes its frequencies once on ``rotary_emb.device`` (set at
        construction and by ``initialize_weights``) and caches them, so a model initialized on the CPU and then
        moved to a GPU copied them from host memory in every forward, a synchronizing copy (the H200's sync check
        at fc7500e). Where a move changes the device, the rotary embedding follows it and computes them again there.
        """
        moved = super()._apply(fn, recurse)
        rotary = getattr(getattr(self, "model", None), "rotary_emb", None)
        if rotary is not None:
            before = torch.device(rotary.device or "cpu")
            try:
                after = fn(torch.empty(0, device=before)).device
            except (RuntimeError, TypeError, ValueError, AttributeError):  # a function for parameters only (a sharding)
                after = before
            if after != before:
                rotary.device = after
                # a functools.cache on the method, shared by every instance: the others compute theirs again
                type(rotary)._compute_concentration_and_inv_freq.cache_clear()
        return moved


def register() -> None:
    """Make :class:`MixtralForCausalLM` AutoModel's ``MixtralForCausalLM`` in this process (idempotent)."""
    from nemo_automodel._transformers.registry import register_architecture

    register_architecture("MixtralForCausalLM", MixtralForCausalLM, exist_ok=True)


# ------------------------------------------------------------------------------------ checkpoint layouts
FUSED_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def checkpoint_keys(checkpoint: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint directory (from its index, else the file headers)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: list[str] = []
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            keys += list(fh.keys())
    return keys


def uses_fused_expert_layout(checkpoint: str | Path) -> bool:
    """True for transformers 5's in-memory Mixtral layout (``mlp.experts.gate_up_proj``), which transformers
    writes for a ``MixtralForCausalLM`` it trained (nemoflow's ``moe_impl='hf'`` checkpoints)."""
    return any(key.endswith(FUSED_SUFFIXES) for key in checkpoint_keys(Path(checkpoint)))


def _to_mixtral_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors as Mixtral's per-expert ones: gate_up_proj [E, 2F, H] -> w1 (gate) and w3 (up)
    [F, H] each, down_proj [E, H, F] -> w2 [H, F]; ``mlp.gate`` -> ``block_sparse_moe.gate``."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key.removesuffix(".mlp.experts.gate_up_proj") + ".block_sparse_moe.experts"
            ffn = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w1.weight"] = tensor[e, :ffn].contiguous()
                out[f"{base}.{e}.w3.weight"] = tensor[e, ffn:].contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            base = key.removesuffix(".mlp.experts.down_proj") + ".block_sparse_moe.experts"
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w2.weight"] = tensor[e].contiguous()
        elif key.endswith(".mlp.gate.weight"):
            out[key.removesuffix(".mlp.gate.weight") + ".block_sparse_moe.gate.weight"] = tensor
        else:
            out[key] = tensor
    return out


def mixtral_layout_checkpoint(checkpoint: str, cache: Path) -> str:
    """``checkpoint`` if its experts are in Mixtral's per-expert layout, else a converted copy under ``cache``.

    AutoModel's MoE model loads Mixtral's original layout (what Mistral publishes and this model writes); a
    checkpoint that transformers' own ``MixtralForCausalLM`` wrote (``moe_impl='hf'``) holds the fused layout,
    which AutoModel's multi-rank loader cannot read (``Missing key ... block_sparse_moe.experts.0.w1.weight``)
    and its one-process loader would skip. The copy is made once per node and source (named by the source's
    path, file sizes and modification times), under a file lock so the node's ranks share it, and atomically
    (a temporary directory renamed into place). Non-weight files (config, tokenizer, generation config) are
    copied as they are; nemoflow's manifest is not (it lists the source's files).
    """
    import hashlib
    import shutil

    from filelock import FileLock
    from safetensors.torch import load_file, save_file

    source = Path(checkpoint)
    if not uses_fused_expert_layout(source):
        return checkpoint
    stamp = [str(source.resolve())] + [
        f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(source.glob("*.safetensors"))
    ]
    target = cache / hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / ".lock"):
        if (target / "config.json").is_file():
            return str(target)
        work = cache / f".tmp-{target.name}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        weight_map: dict[str, str] = {}
        total = 0
        for file in sorted(source.glob("*.safetensors")):
            tensors = _to_mixtral_layout(load_file(str(file)))
            save_file(tensors, str(work / file.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for item in source.iterdir():
            if (
                item.is_file()
                and item.suffix != ".safetensors"
                and item.name
                not in (
                    "model.safetensors.index.json",
                    "MANIFEST.json",
                )
            ):
                shutil.copy2(item, work / item.name)
        work.rename(target)
    print(f"converted {checkpoint} to Mixtral's per-expert layout for moe_impl 'grouped': {target}", flush=True)
    return str(target)
