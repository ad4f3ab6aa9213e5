"""Tiny real Hugging Face checkpoints (random weights, Mixtral's tokenizer) for the serving and fine-tuning tests."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_tiny(dest: Path, tokenizer_model: Path, config, model_class, seed: int) -> Path:
    """``model_class(config)`` with weights from ``seed`` (fixed: greedy outputs are reproducible across runs),
    saved with save_pretrained in ``dest`` next to a copy of ``tokenizer_model``."""
    import torch

    torch.manual_seed(seed)
    model_class(config).save_pretrained(dest)
    shutil.copyfile(tokenizer_model, dest / "tokenizer.model")
    return dest


def tiny_llama(dest: Path, tokenizer_model: Path, seed: int, **overrides) -> Path:
    """A 4M-parameter Llama (vocab 32000, untied embeddings) in the trainer's layout; ``overrides``: other
    config values (a wider one whose attention heads GPU kernels take, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**{**values, **overrides})
    return save_tiny(dest, tokenizer_model, config, LlamaForCausalLM, seed)


def tiny_mixtral_config(**overrides):
    """A Mixtral of 2 layers, 4 experts (2 a token) and hidden size 64; ``overrides``: vocabulary, length, ..."""
    from transformers import MixtralConfig

    values = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return MixtralConfig(**{**values, **overrides})
