"""AdmissionGate and GatedStream in-process: limits, order, refusals with Retry-After, no leaked slot."""

from __future__ import annotations

import asyncio
import gc

import pytest

from workloads.serve_http import AdmissionGate, GatedStream, Overloaded


def test_slots_then_queue_then_refusal_with_retry_after():
    async def scenario():
        gate = AdmissionGate(max_active=2, max_waiting=2)
        await gate.acquire()
        await gate.acquire()
        assert gate.stats() == {"active": 2, "waiting": 0, "refused": 0}
        order: list[str] = []

        async def wait(name: str) -> None:
            await gate.acquire()
            order.append(name)

        first = asyncio.create_task(wait("first"))
        second = asyncio.create_task(wait("second"))
        await asyncio.sleep(0)
        assert gate.stats()["waiting"] == 2
        with pytest.raises(Overloaded) as refused:
            await gate.acquire()
        assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
        assert refused.value.body()["error"]["type"] == "rate_limit_error"
        gate.release()
        gate.release()
        await asyncio.gather(first, second)
        assert order == ["first", "second"]  # first come, first served
        assert gate.stats() == {"active": 2, "waiting": 0, "refused": 1}
        gate.release()
        gate.release()
        assert gate.stats()["active"] == 0

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaks_nothing():
    async def scenario():
        gate = AdmissionGate(max_active=1, max_waiting=4)
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        waiter.cancel()  # the client disconnected while queued
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.stats()["waiting"] == 0
        gate.release()
        assert gate.stats()["active"] == 0
        # handed a slot and cancelled in the same tick: the slot comes back
        await gate.acquire()
        late = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        gate.release()  # hands the slot to `late`
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert gate.stats()["active"] == 0

    asyncio.run(scenario())


def test_retry_after_grows_with_the_queue():
    async def scenario():
        gate = AdmissionGate(max_active=1, max_waiting=0)
        granted = await gate.acquire()
        gate._mean_s = 4.0
        with pytest.raises(Overloaded) as busy:
            await gate.acquire()
        assert busy.value.headers["Retry-After"] == "4"
        gate.release(granted)

    asyncio.run(scenario())


def test_gated_stream_releases_when_done_failed_closed_or_dropped():
    async def body(n: int, fail: bool = False):
        for i in range(n):
            yield f"chunk {i}"
        if fail:
            raise RuntimeError("engine broke")

    async def scenario():
        gate = AdmissionGate(max_active=4, max_waiting=0)
        # read to the end
        stream = GatedStream(body(2), gate, await gate.acquire())
        assert [c async for c in stream] == ["chunk 0", "chunk 1"]
        # fails half-way
        stream = GatedStream(body(2, fail=True), gate, await gate.acquire())
        with pytest.raises(RuntimeError):
            async for _ in stream:
                pass
        # closed early (client gone mid-stream)
        stream = GatedStream(body(5), gate, await gate.acquire())
        await stream.__anext__()
        await stream.aclose()
        assert gate.stats()["active"] == 0
        # never read at all, then dropped (client gone before the first byte)
        stream = GatedStream(body(5), gate, await gate.acquire())
        assert gate.stats()["active"] == 1
        del stream
        gc.collect()
        await asyncio.sleep(0)
        assert gate.stats()["active"] == 0

    asyncio.run(scenario())
