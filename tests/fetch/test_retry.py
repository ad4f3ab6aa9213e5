"""infra.retry: what is transient, waits (backoff, Retry-After, immediate), budgets, brief failures.

Exceptions come from the real clients (requests against the fault server and a closed port,
aiohttp's resolver on a ``.invalid`` name) or are the clients' own exception classes built the
way the clients build them (kubernetes ApiException, openai's status errors on httpx responses).
"""

from __future__ import annotations

import asyncio
import email.utils
import socket
import time

import pytest
import requests

from infra.retry import RetryPolicy, Transient, describe, http_status, is_brief, is_transient, parse_retry_after
from tests.conftest import free_port
from tests.support import fault_ledger
from tests.support.fault_server import Fault

from .conftest import SHARD


def run(policy: RetryPolicy, outcomes: list, **kwargs) -> tuple[list[float], int, object]:
    """Run a block that fails with each of ``outcomes`` (exceptions) in turn, then returns "ok"."""
    waits: list[float] = []
    calls = 0
    result = None
    for attempt in policy.retrying(sleep=waits.append, **kwargs):
        with attempt:
            calls += 1
            if calls <= len(outcomes):
                raise outcomes[calls - 1]
            result = "ok"
    return waits, calls, result


# --------------------------------------------------------------------------- classification


@pytest.mark.faults
def test_real_client_failures_are_classified(server):
    row = fault_ledger.open_row("http timeout/503 classified by the retry policy")
    row.injected_from(server.injected_count)
    with pytest.raises(requests.ConnectionError) as refused:
        requests.get(f"http://127.0.0.1:{free_port()}/x", timeout=2)
    server.add_faults(SHARD, Fault(delay=2.0))
    with pytest.raises(requests.Timeout) as slow:
        requests.get(server.url(SHARD), timeout=0.5)
    server.add_faults(SHARD, Fault(status=503, retry_after="7"))
    unavailable = requests.get(server.url(SHARD), timeout=5)
    with pytest.raises(requests.HTTPError) as err_503:
        unavailable.raise_for_status()
    with pytest.raises(requests.HTTPError) as err_404:
        requests.get(server.url("/nope"), timeout=5).raise_for_status()
    assert is_transient(refused.value) and is_transient(slow.value) and is_transient(err_503.value)
    assert http_status(err_503.value) == 503 and http_status(err_404.value) == 404
    assert not is_transient(err_404.value)
    from infra.retry import retry_after

    assert retry_after(err_503.value) == 7.0


def test_unresolvable_host_is_transient_but_brief():
    import aiohttp

    async def resolve():
        async with aiohttp.ClientSession() as session:
            await session.get("http://nemoflow-test.invalid/x")

    with pytest.raises(aiohttp.ClientError) as err:
        asyncio.run(resolve())
    assert is_transient(err.value) and is_brief(err.value)
    with pytest.raises(socket.gaierror) as gai:
        socket.getaddrinfo("nemoflow-test.invalid", 80)
    assert is_brief(gai.value) and not is_brief(ConnectionRefusedError())


def test_other_clients_status_errors():
    import httpx
    import openai
    from kubernetes.client.exceptions import ApiException

    request = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    limited = openai.RateLimitError(
        "slow down", response=httpx.Response(429, headers={"retry-after": "3"}, request=request), body=None
    )
    bad = openai.BadRequestError("no", response=httpx.Response(400, request=request), body=None)
    assert is_transient(limited) and http_status(limited) == 429
    assert not is_transient(bad)
    assert is_transient(openai.APIConnectionError(request=request))
    assert is_transient(httpx.ConnectError("refused")) and is_transient(httpx.ReadTimeout("slow"))
    assert is_transient(ApiException(status=503)) and is_transient(ApiException(status=429))
    assert not is_transient(ApiException(status=409)) and not is_transient(ApiException(status=403))
    from infra.retry import retry_after

    assert retry_after(limited) == 3.0


def test_own_verdicts_and_plain_errors():
    assert is_transient(Transient("truncated body"))
    assert not is_transient(ValueError("bad input")) and not is_transient(FileNotFoundError("x"))
    assert not is_transient(KeyboardInterrupt())

    class Flaky(RuntimeError):
        transient = True

    class Final(ConnectionError):
        transient = False  # a type's own verdict wins over its base class

    assert is_transient(Flaky()) and not is_transient(Final())
    assert describe(Transient("HTTP 503 Service Unavailable")) == "HTTP 503 Service Unavailable"
    assert describe(ValueError("two\n  lines")) == "two lines"


def test_parse_retry_after():
    assert parse_retry_after("120") == 120.0
    soon = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= parse_retry_after(soon) <= 31
    assert parse_retry_after(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


# --------------------------------------------------------------------------- the policy


def test_backoff_grows_with_full_jitter_and_a_cap():
    policy = RetryPolicy(attempts=6, initial=1.0, maximum=3.0, budget=None)
    waits, calls, result = run(policy, [Transient("x")] * 5)
    assert (calls, result) == (6, "ok")
    bounds = [1, 2, 3, 3, 3]  # initial * 2**n, capped at maximum
    assert all(0 <= w <= b for w, b in zip(waits, bounds)), waits


def test_retry_after_replaces_backoff_but_not_the_cap_and_immediate_waits_nothing():
    policy = RetryPolicy(attempts=5, initial=10.0, maximum=2.0, budget=None)
    waits, _, _ = run(
        policy,
        [Transient("429", retry_after=0.5), Transient("429", retry_after=3600), Transient("restart", immediate=True)],
    )
    assert waits == [0.5, 2.0, 0.0]


def test_permanent_failures_are_raised_at_once_unchanged():
    policy = RetryPolicy(attempts=5, initial=0)
    with pytest.raises(FileNotFoundError):
        run(policy, [FileNotFoundError("gone")])
    calls = 0

    def flaky():
        nonlocal calls
        calls += 1
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):  # the last error itself, never tenacity's RetryError
        RetryPolicy(attempts=3, initial=0).call(flaky)
    assert calls == 3


def test_unresolvable_host_gets_only_brief_attempts():
    policy = RetryPolicy(attempts=10, initial=0, brief_attempts=3)
    failures = [socket.gaierror(-2, "Name or service not known")] * 9
    with pytest.raises(socket.gaierror):
        run(policy, failures)
    waits, calls, _ = run(policy, failures[:2])  # two failures, then it resolves: fine
    assert calls == 3


def test_budget_stops_before_a_wait_that_would_exceed_it():
    policy = RetryPolicy(attempts=10, initial=0, maximum=60, budget=5)
    with pytest.raises(Transient):
        run(policy, [Transient("busy", retry_after=2)] * 2 + [Transient("busy", retry_after=10)] * 3)
    # In real time: 0.2 s waits under a 0.5 s budget allow three attempts, not ten.
    calls = 0

    def busy():
        nonlocal calls
        calls += 1
        raise Transient("busy", retry_after=0.2)

    started = time.monotonic()
    with pytest.raises(Transient):
        RetryPolicy(attempts=10, maximum=1, budget=0.5).call(busy)
    assert calls == 3 and time.monotonic() - started < 0.6


def test_budget_counts_from_the_last_progress():
    """A copy that keeps advancing between failures is never cut off; one that stalls is."""
    policy = RetryPolicy(attempts=8, initial=0, budget=0.35)

    def attempts_made(progressing: bool) -> int:
        last = [time.monotonic()]  # when bytes last arrived
        calls = 0
        with pytest.raises(Transient):
            for attempt in policy.retrying(progress=lambda: last[0]):
                with attempt:
                    calls += 1
                    time.sleep(0.1)  # some bytes arrive, then the connection drops
                    if progressing:
                        last[0] = time.monotonic()
                    raise Transient("connection broken")
        return calls

    assert attempts_made(progressing=True) == 8  # only the attempt limit stops it
    assert attempts_made(progressing=False) <= 4  # 0.1 s per attempt: the 0.35 s budget is spent


def test_log_lines_and_on_retry():
    lines: list[str] = []
    seen: list[tuple[str, int]] = []
    run(
        RetryPolicy(attempts=3, initial=0),
        [Transient("HTTP 503 Service Unavailable")],
        what="create Job train-1",
        log=lines.append,
        on_retry=lambda exc, attempt, sleep: seen.append((type(exc).__name__, attempt)),
    )
    assert lines == ["create Job train-1: attempt 1 failed (HTTP 503 Service Unavailable); retrying in 0.0s"]
    assert seen == [("Transient", 1)]


@pytest.mark.faults
def test_against_a_real_server(server, corpus):
    row = fault_ledger.open_row("http 503/429 retried by the retry policy")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, Fault(status=503, retry_after="0"), Fault(status=429, retry_after="0"))
    policy = RetryPolicy(attempts=4, initial=0.01)

    def get(url: str) -> bytes:
        response = requests.get(url, timeout=5)
        response.raise_for_status()
        return response.content

    assert policy.call(get, server.url(SHARD)) == (corpus / SHARD.lstrip("/")).read_bytes()
    assert server.count(SHARD) == 3
    with pytest.raises(requests.HTTPError, match="404"):
        policy.call(get, server.url("/missing"))
    assert server.count("/missing") == 1


@pytest.mark.faults
def test_async_policy(server):
    row = fault_ledger.open_row("http 502 retried by the async retry policy")
    row.injected_from(server.injected_count)
    import httpx

    server.add_faults(SHARD, Fault(status=502))
    policy = RetryPolicy(attempts=3, initial=0.01)

    async def fetch() -> int:
        async with httpx.AsyncClient() as client:
            response = await client.get(server.url(SHARD))
            response.raise_for_status()
            return response.status_code

    assert asyncio.run(policy.acall(fetch)) == 200
    assert server.count(SHARD) == 2


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="must not be negative"):
        RetryPolicy(initial=-1)
    assert RetryPolicy().replace(attempts=2).attempts == 2
