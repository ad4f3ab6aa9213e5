"""The seed's request byte for byte (NeMo's REST shape), and the official openai client's error types."""

from __future__ import annotations

import json

import httpx
import pytest
import sentencepiece

from tests.serve.conftest import MODEL_NAME
from workloads.serve_http import NemoRequest, nemo_sampling

PROMPT = "In the beginning God created"
CAP = 64  # the live server runs with --max-tokens-cap 64 and a 256-token context


def seed_bytes(prompt: str = PROMPT, model: str = MODEL_NAME) -> bytes:
    """Exactly what the seed's curl sends (key order, spacing, the odd values)."""
    return (
        '{"prompt": "' + prompt + '", "model": "' + model + '", "max-tokens": 2048, "top_p": 0, "top_k": 0.9, '
        '"temperature": 1.0}'
    ).encode()


def greedy(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_seed_request_byte_for_byte(live_server, tiny_checkpoint):
    response = httpx.post(
        live_server + "/v1/chat/completions/",
        content=seed_bytes(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"output"} and isinstance(body["output"], str) and body["output"].strip()
    # top_k 0.9 -> 0 and top_p 0 -> greedy (NeMo/TensorRT-LLM); 2048 tokens -> at most the server's cap
    assert body["output"] == greedy(live_server, PROMPT, CAP)
    # the continuation only, not the prompt
    assert not body["output"].startswith(PROMPT)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_checkpoint / "tokenizer.model"))
    assert len(sp.encode(body["output"])) <= CAP + 1


def test_nemo_rest_services_own_path_and_defaults(live_server):
    # NeMo's REST service path is /v1/completions/; its defaults are top_k=1 (greedy), max_tokens=512
    response = httpx.post(live_server + "/v1/completions/", json={"model": MODEL_NAME, "prompt": PROMPT}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json() == {"output": greedy(live_server, PROMPT, CAP)}
    # an explicit small max_tokens is honoured
    small = httpx.post(
        live_server + "/v1/completions/", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3}, timeout=60
    )
    assert small.json() == {"output": greedy(live_server, PROMPT, 3)}


def test_trailing_slash_chat_with_messages_is_openai_chat(live_server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
    response = httpx.post(live_server + "/v1/chat/completions/", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL_NAME}, 422, "prompt"),
        ({"model": MODEL_NAME, "prompt": "x", "top_k": "many"}, 422, "top_k"),
        ({"model": MODEL_NAME, "prompt": "x", "top_k": -1}, 422, "top_k"),
        ({"model": MODEL_NAME, "prompt": "x", "top_p": 1.5}, 422, "top_p"),
        ({"model": MODEL_NAME, "prompt": "x", "max-tokens": 5, "max_tokens": 6}, 422, "max_tokens"),
        ({"model": "other-model", "prompt": "x"}, 404, "model"),
    ],
)
def test_nemo_shape_errors(live_server, body, status, param):
    response = httpx.post(live_server + "/v1/chat/completions/", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature", "expected"),
    [
        (0.9, 0, 1.0, (1, 0.0)),  # the seed: int(0.9) = 0 and top_p 0 -> greedy (TensorRT-LLM)
        (0, 0.0, 1.0, (1, 0.0)),
        (1, 0.0, 1.0, (1, 1.0)),  # NeMo's defaults: greedy top-k 1
        (40, 0.0, 0.7, (40, 1.0)),  # top_p 0 with a top_k -> plain top-k
        (40.7, 0.5, 0.7, (40, 0.5)),
        (0, 0.9, 0.7, (0, 0.9)),  # nucleus only
    ],
)
def test_nemo_sampling_follows_tensorrt_llm(top_k, top_p, temperature, expected):
    sampling = nemo_sampling(NemoRequest(model="m", prompt="p", top_k=top_k, top_p=top_p, temperature=temperature))
    if expected[0] == 1:
        assert sampling.greedy and sampling.top_k == 1
    else:
        assert (sampling.top_k, sampling.top_p) == expected and not sampling.greedy


@pytest.fixture(scope="module")
def client(live_server):
    import openai

    return openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_error_classes(client):
    """400, 404 and 422 from this server surface as the openai client's own exception classes."""
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.get("/no-such-route", cast_to=object)
    # the NeMo route, called through the client's generic POST: a body NeMo's service refuses is a 422
    with pytest.raises(openai.UnprocessableEntityError) as unprocessable:
        client.post("/chat/completions/", body={"model": MODEL_NAME, "top_k": 0.9}, cast_to=object)
    assert unprocessable.value.status_code == 422 and unprocessable.value.body["param"] == "prompt"
    # and the seed's body through the same client answers {"output": ...}
    answer = client.post("/chat/completions/", body=json.loads(seed_bytes()), cast_to=object)
    assert set(answer) == {"output"} and answer["output"].strip()
