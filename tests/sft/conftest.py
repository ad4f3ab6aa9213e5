"""A registered base model for fine-tuning: a tiny Llama with Mixtral's tokenizer, promoted in a registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import tiny_llama


def make_base_model(directory: Path, tokenizer_model: Path, seed: int = 0) -> Path:
    """A 4M-parameter Llama (vocab 32000) saved in the Hugging Face layout, with its tokenizer.model."""
    return tiny_llama(directory, tokenizer_model, seed)


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
