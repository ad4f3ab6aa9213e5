"""The serving proxy's pass-through of the OpenAI routes (workloads/serve_engines/proxy.py, ``Relay``), against
a real streaming engine on a real port.

The engine here is an OpenAI-shaped ASGI app served by uvicorn that streams one SSE event per token, as vLLM
does, and records what it saw (the path with its query, whether its client went away and after how many
events). The proxy is ``create_proxy_app`` served by uvicorn with an API key, as ``run_engine`` serves it. The
clients are the real ``openai`` client and httpx.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.conftest import free_port
from workloads.serve_engines.proxy import EngineTarget, ProxyState, create_proxy_app

MODEL = "relay-model"
KEY = "sk-relay-" + "0" * 16


class Engine:
    """A streaming OpenAI engine: ``tokens`` events a request, one every ``tpot_s``; what it saw, recorded."""

    def __init__(self, tokens: int, tpot_s: float):
        self.tokens, self.tpot_s = tokens, tpot_s
        self.seen: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        record = {"path": scope["path"], "query": scope["query_string"].decode(), "sent": 0, "gone": False}
        record["headers"] = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.seen.append(record)
        if scope["path"] == "/v1/models":
            await send({"type": "http.response.start", "status": 404, "headers": [(b"x-engine", b"yes")]})
            await send({"type": "http.response.body", "body": b'{"error": "no models here"}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        gone = asyncio.ensure_future(self._gone(receive))
        for i in range(self.tokens):
            if gone.done():
                record["gone"] = True
                return
            choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}
            event = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice]}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": True}
            )
            record["sent"] = i + 1
            record["last_sent_at"] = time.monotonic()
            await asyncio.sleep(self.tpot_s)
        gone.cancel()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @staticmethod
    async def _gone(receive):
        while (await receive())["type"] != "http.disconnect":
            pass


class Served:
    """An ASGI app served by uvicorn on a free port, in a thread of its own with its own event loop."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def _no_nemo(*args):
    return ""


def proxy_for(base_url: str) -> Served:
    target = EngineTarget(
        kind="relay",
        argv=[],
        env={},
        base_url=base_url,
        health_path="/health",
        model_name=MODEL,
        nemo=_no_nemo,
        openai=True,
    )
    state = ProxyState(target=target, api_key=KEY, warmed=True)
    state.engine_alive.set()
    return Served(create_proxy_app(state))


@pytest.fixture
def engine_and_proxy():
    engine = Engine(tokens=400, tpot_s=0.005)
    served = Served(engine)
    proxy = proxy_for(served.url)
    yield engine, proxy
    proxy.stop()
    served.stop()


def test_a_stream_is_relayed_event_by_event_as_the_engine_sends_it(engine_and_proxy):
    import openai

    engine, proxy = engine_and_proxy
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=400, stream=True)
    texts, first_at = [], None
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        first_at = first_at or time.monotonic()
    assert "".join(texts) == "".join(f" t{i}" for i in range(400))
    # streamed, not gathered: the first event reached the client while the engine still had most of 2 s to go
    assert first_at < engine.seen[-1]["last_sent_at"] - 1.0
    assert engine.seen[-1]["gone"] is False


def test_the_query_the_status_and_the_headers_pass_through(engine_and_proxy):
    engine, proxy = engine_and_proxy
    answer = httpx.get(proxy.url + "/v1/models?limit=2&after=a%20b", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 404 and answer.json() == {"error": "no models here"}
    assert answer.headers["x-engine"] == "yes"
    assert engine.seen[-1]["path"] == "/v1/models" and engine.seen[-1]["query"] == "limit=2&after=a%20b"
    # the request's own headers, and no encoding the client did not ask for (the body comes back as sent)
    raw = httpx.get(
        proxy.url + "/v1/models",
        headers={"Authorization": f"Bearer {KEY}", "X-Trace": "t1", "Accept-Encoding": "identity"},
    )
    assert raw.status_code == 404
    assert engine.seen[-1]["headers"]["x-trace"] == "t1" and engine.seen[-1]["headers"]["accept-encoding"] == "identity"
    plain = httpx.Client(headers={}).build_request("GET", proxy.url + "/v1/models")
    del plain.headers["accept-encoding"]
    plain.headers["Authorization"] = f"Bearer {KEY}"
    assert httpx.Client().send(plain).status_code == 404
    assert "accept-encoding" not in engine.seen[-1]["headers"], engine.seen[-1]["headers"]
    # the key is the proxy's to check: a wrong one never reaches the engine
    before = len(engine.seen)
    assert httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert len(engine.seen) == before


def test_a_client_that_goes_away_stops_the_engine_generating_for_it(engine_and_proxy):
    engine, proxy = engine_and_proxy
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers=headers, timeout=30) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    left_at = time.monotonic()
    deadline = left_at + 5
    while time.monotonic() < deadline and not engine.seen[-1]["gone"]:
        time.sleep(0.05)
    seen = engine.seen[-1]
    assert seen["gone"], seen  # the proxy closed the engine's connection when its client closed its own
    assert seen["sent"] < 400 and seen["last_sent_at"] < left_at + 1.0


def test_an_engine_that_is_not_listening_is_a_503_that_says_so():
    proxy = proxy_for(f"http://127.0.0.1:{free_port()}")
    try:
        answer = httpx.post(
            proxy.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hi"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
    finally:
        proxy.stop()
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "engine_unavailable"
    assert "the relay engine is not answering" in answer.json()["error"]["message"]


def test_health_reports_where_the_engines_start_went_once_warm():
    """The deploy stage itemises a served engine's start from the proxy's /health (tasks/gpu_time.py): the proxy's
    own start and imports, the engine's start (until its health answers), the warm-up generation; frozen once warm.
    With vLLM the stage said "not itemised" (H200, f1327a3: 105.7 s of the cold demo's 273)."""
    from infra import phases

    async def health_app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def slow_warm_up(*args):
        await asyncio.sleep(0.3)
        return "warm"

    engine = Served(health_app)
    timer = phases.Timer(age_s=0.0)
    time.sleep(0.1)  # the proxy's start and imports
    timer.switch(phases.SERVER_START)  # as run_engine does when it launches the engine
    target = EngineTarget("relay", [], {}, engine.url, "/health", MODEL, nemo=slow_warm_up, openai=True)
    state = ProxyState(target=target, api_key=KEY, timer=timer)
    proxy = Served(create_proxy_app(state))
    try:
        time.sleep(0.2)  # the engine's start
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503  # not alive yet: no phases
        state.engine_alive.set()
        first = httpx.get(proxy.url + "/health", timeout=10)
        assert first.status_code == 200, first.text
        seconds = first.json()["phases"]["seconds"]
        assert list(seconds) == [phases.START, phases.SERVER_START, phases.GENERATION]
        assert (
            seconds[phases.START] >= 0.1 and seconds[phases.SERVER_START] >= 0.2 and seconds[phases.GENERATION] >= 0.3
        )
        time.sleep(0.2)
        again = httpx.get(proxy.url + "/health", timeout=10).json()["phases"]
        assert again == first.json()["phases"]  # stopped when warm: serving time is not the start's
    finally:
        proxy.stop()
        engine.stop()
