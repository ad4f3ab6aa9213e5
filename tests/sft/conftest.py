"""A registered base model for fine-tuning: a tiny Llama with Mixtral's tokenizer, promoted in a registry."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def make_base_model(directory: Path, tokenizer_model: Path, seed: int = 0) -> Path:
    """A 4M-parameter Llama (vocab 32000) saved in the Hugging Face layout, with its tokenizer.model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
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
    LlamaForCausalLM(config).save_pretrained(directory)
    shutil.copyfile(tokenizer_model, directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="session")
def base_model(tmp_path_factory, mixtral_tokenizer_model) -> Path:
    return make_base_model(tmp_path_factory.mktemp("sft-base") / "base", mixtral_tokenizer_model)


@pytest.fixture
def registry_with_base(work_dir, base_model):
    """<work_dir>/registry with ``base_model`` registered and promoted; returns (registry uri, model id)."""
    from infra import registry as reg

    uri = str(work_dir / "registry")
    record = reg.ModelRecord(id="m-base", checkpoint=str(base_model), metrics={"steps": 12}, note="test base")
    reg.ModelRegistry(uri).register(record, promote=True)
    return uri, record.id
