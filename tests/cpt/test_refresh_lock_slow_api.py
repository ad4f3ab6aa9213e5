"""A free refresh slot is taken even when the Prefect API answers slower than ``lock_timeout_s``.

Seen in the suite at 7e887fc (a loaded 2-core machine): a refresh with ``lock_timeout_s=2`` found the slot
free, but the server answered its acquisition after more than 2 s; the client gave up, the server had
granted the slot to that request (a lease nobody renews), and the run refused itself: "another cpt-refresh
holds the 'cpt-refresh' concurrency limit: no cpt-refresh run is alive; the slot is a dead run's". Here a
real reverse proxy in front of a real Prefect server holds the acquisition request 3 s before passing it on.
"""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.support import fault_ledger
from tests.support.fault_proxy import FaultProxy
from tests.support.fault_server import Fault

pytestmark = [pytest.mark.prefect, pytest.mark.faults]

ACQUIRE = r"^POST /api/v2/concurrency_limits/increment"


def _active_slots(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_a_free_slot_is_taken_through_an_api_slower_than_the_lock_timeout(prefect_server, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.cpt_refresh as refresh

    name = f"cpt-refresh-slow-api-{free_port()}"  # this test's own limit on the session's server
    monkeypatch.setattr(refresh, "CONCURRENCY_LIMIT", name)
    upstream = prefect_server.removesuffix("/api")
    row = fault_ledger.open_row("Prefect API answers a free refresh slot's acquisition 3 s late (timeout 2 s)")
    with FaultProxy(upstream) as proxy, temporary_settings(updates={PREFECT_API_URL: proxy.url + "/api"}):
        row.injected_from(proxy.injected_count)
        proxy.add_faults(ACQUIRE, Fault(delay=3))
        with refresh.refresh_lock(2):
            assert _active_slots(name) == 1  # held by this run
        assert proxy.injected_count() == 1  # the slow answer was the one that took the slot
    assert _active_slots(name) == 0  # and let go: no lease left behind
