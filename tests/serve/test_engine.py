"""The generation loop in-process: KV-cached decoding against full recomputation, sampling filters."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.tiny_models import save_tiny, tiny_mixtral_config
from workloads.serve_engines.builtin import Engine, SamplingParams


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory, mixtral_tokenizer_model):
    from transformers import MixtralForCausalLM

    config = tiny_mixtral_config(vocab_size=32000, max_position_embeddings=128)
    dest = tmp_path_factory.mktemp("ckpt") / "tiny-mixtral"
    return save_tiny(dest, mixtral_tokenizer_model, config, MixtralForCausalLM, seed=99)


@pytest.mark.parametrize("which", ["tiny_checkpoint", "tiny_mixtral"])
def test_cached_greedy_decoding_matches_full_recomputation(request, which):
    engine = Engine(request.getfixturevalue(which))
    engine.load()
    prompt = engine.encode_prompt("In the beginning God created the heaven and the earth.")
    result = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    # reference: no KV cache, the whole sequence through the model at every step
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            logits = engine.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            next_id = int(torch.argmax(logits))
            if next_id == engine.sp.eos_id():
                break
            ids.append(next_id)
    expected = engine.sp.decode(ids[len(prompt) - 1 :])[len(engine.sp.decode(ids[len(prompt) - 1 : len(prompt)])) :]
    assert result.text == expected
    assert result.prompt_tokens == len(prompt) and prompt[0] == engine.sp.bos_id() == 1


def test_completion_keeps_the_space_before_the_first_word(tiny_checkpoint):
    engine = Engine(tiny_checkpoint)
    engine.load()
    prompt = engine.encode_prompt("In the beginning")
    word = engine.sp.piece_to_id("▁God")
    assert engine._continuation(prompt, [word]) == " God"
    assert engine.sp.decode([word]) == "God"  # what a plain decode would have glued to the prompt


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    picks = {
        Engine._pick(logits, SamplingParams(max_tokens=1, temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
        for s in range(200)
    }
    assert picks == {1, 2}
    picks = {
        Engine._pick(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7), torch.Generator().manual_seed(s))
        for s in range(200)
    }
    assert picks == {1, 2}  # 0.5 < 0.7 <= 0.5 + 0.3
    picks = {
        Engine._pick(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.4), torch.Generator().manual_seed(s))
        for s in range(50)
    }
    assert picks == {1}  # the top token alone already covers 0.4
    unfiltered = {
        Engine._pick(logits, SamplingParams(max_tokens=1, temperature=1.0), torch.Generator().manual_seed(s))
        for s in range(400)
    }
    assert unfiltered == {0, 1, 2, 3}
    assert Engine._pick(logits, SamplingParams(max_tokens=1, temperature=0), None) == 1


def test_unfiltered_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[Engine._pick(torch.log(probs), SamplingParams(max_tokens=1, temperature=1.0), generator)] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03), counts / 4000
    # temperature sharpens: at 0.25 the most likely token dominates far beyond its 0.4
    cold = SamplingParams(max_tokens=1, temperature=0.25)
    sharp = [Engine._pick(torch.log(probs), cold, generator) for _ in range(400)]
    assert sharp.count(3) / 400 > 0.6


def test_top_p_beyond_the_first_1024_candidates_falls_back_to_a_full_sort():
    logits = torch.zeros(32000)  # uniform: 1024 tokens hold only 3% of the mass
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)
    picks = {Engine._pick(logits, params, torch.Generator().manual_seed(s)) for s in range(300)}
    first_candidates = set(torch.topk(torch.softmax(logits, -1), 1024).indices.tolist())
    # the nucleus holds 16000 tokens: most draws land outside the first 1024 candidates
    assert len(picks - first_candidates) > 200


def test_consolidated_hf_checkpoint_with_shards(tiny_checkpoint, tmp_path):
    """NeMo AutoModel's consolidated layout: sharded safetensors + index, and the dataset's tokenizer.model.

    (A checkpoint with only save_pretrained tokenizer files is served through HFTokenizer too, but one
    cannot be made here from the sentencepiece model: converting it needs protobuf 7, and NeMo
    AutoModel 0.7 pins protobuf below 7.)
    """
    import shutil

    from transformers import AutoModelForCausalLM

    from workloads.serve import check_checkpoint

    dest = tmp_path / "consolidated"
    AutoModelForCausalLM.from_pretrained(tiny_checkpoint).save_pretrained(dest, max_shard_size="2MB")
    shutil.copy(tiny_checkpoint / "tokenizer.model", dest / "tokenizer.model")
    assert len(list(dest.glob("model-*.safetensors"))) > 1 and (dest / "model.safetensors.index.json").exists()
    assert not (dest / "model.safetensors").exists()
    check_checkpoint(dest)

    reference, consolidated = Engine(tiny_checkpoint), Engine(dest)
    reference.load()
    consolidated.load()
    text = "In the beginning God created the heaven and the earth."
    assert consolidated.encode_prompt(text) == reference.encode_prompt(text)
    params = SamplingParams(max_tokens=10, temperature=0)
    ids = reference.encode_prompt(text)
    assert consolidated.generate(ids, params).text == reference.generate(ids, params).text


def test_checkpoint_without_a_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    from workloads.serve import check_checkpoint

    dest = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, dest)
    (dest / "tokenizer.model").unlink()
    with pytest.raises(SystemExit, match="lacks tokenizer.model"):
        check_checkpoint(dest)


def test_a_decoding_step_attends_without_cudnn_and_restores_the_flags(tiny_checkpoint):
    # cuDNN's attention builds a plan for every new shape, and each decoding step is a new length: on the H200
    # the first pass over the lengths took 82 ms a token, a repeat 18 ms (bench_builtin_decode at d1f5225)
    engine = Engine(tiny_checkpoint)
    engine.load()
    seen: list[bool] = []
    hook = engine.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        engine.generate(engine.encode_prompt("In the beginning"), SamplingParams(max_tokens=4, temperature=0))
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before is True
