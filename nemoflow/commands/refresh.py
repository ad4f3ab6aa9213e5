"""``nemoflow refresh``: start a cpt-refresh run now, optionally waiting until no other refresh holds the slot."""

from __future__ import annotations

import argparse
import time

from nemoflow.commands import add_command

DESCRIPTION = """\
Run a cpt-refresh deployment now and watch it (`prefect deployment run NAME --watch`).

Only one refresh runs at a time (the global concurrency limit 'cpt-refresh'). A refresh
started while another holds it ends Cancelled at once, its message naming the run that
holds the slot and when that frees. With --wait this command first waits until the slot
is free (printing who holds it: a live run until it ends; a dead one until its heartbeat
deadline, when the automation marks it Crashed, and its lease lapses), then starts the
run, and waits again should another refresh take the slot first.

  nemoflow refresh --wait
  nemoflow refresh --deployment cpt-refresh/nightly-slurm --wait --timeout 3600"""


def register(sub) -> None:
    parser = add_command(
        sub,
        "refresh",
        "run cpt-refresh now; --wait: wait for a running refresh to free the slot instead of being cancelled",
        DESCRIPTION,
    )
    parser.add_argument("--deployment", default="cpt-refresh/local", help="the deployment (default cpt-refresh/local)")
    parser.add_argument("--wait", action="store_true", help="wait until no other refresh holds the slot, then run")
    parser.add_argument(
        "--timeout", type=float, default=3600, help="with --wait: give up after this many seconds (default 3600)"
    )
    parser.add_argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def slot_status() -> tuple[list, int]:
    """(live runs holding or taking the refresh slot, slots the limit counts as taken)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.cpt_refresh import CONCURRENCY_LIMIT, HOLDER_VARIABLE
    from infra.run_slots import slot_holders

    with get_client(sync_client=True) as client:
        named = client.read_variable_by_name(HOLDER_VARIABLE)
        try:
            active = client.read_global_concurrency_limit_by_name(CONCURRENCY_LIMIT).active_slots
        except ObjectNotFound:
            active = 0
    ids = [str(named.value)] if named is not None and named.value else []
    return slot_holders("cpt-refresh", run_ids=ids), active


def wait_for_slot(deadline: float, poll: float, echo=print) -> None:
    """Return once no refresh is alive and the slot is free; UserError at ``deadline`` (monotonic)."""
    from flows.cpt_refresh import LOCK_LEASE_S
    from nemoflow.cli import UserError

    said = None
    while True:
        holders, active = slot_status()
        if not holders and active == 0:
            if said is not None:
                echo("the slot is free")
            return
        if holders:
            news = "waiting for the cpt-refresh slot: held by " + "; and ".join(h.describe() for h in holders)
        else:
            news = (
                "waiting for the cpt-refresh slot: no refresh is alive, the slot is a dead run's until its lease "
                f"lapses (within ~{LOCK_LEASE_S + 15} s of its death)"
            )
        if news != said:
            echo(news)
            said = news
        if time.monotonic() >= deadline:
            raise UserError(f"the cpt-refresh slot was still taken when --timeout ran out: {news.split(': ', 1)[1]}")
        time.sleep(poll)


def run(args) -> int:
    from devtools import prefect_local as pl
    from flows.cpt_refresh import REFUSED
    from nemoflow.cli import UserError

    try:
        api = pl.PrefectApi.from_settings()
    except pl.ControlPlaneError as exc:
        raise UserError(str(exc)) from None
    if not api.healthy():
        raise UserError(
            f"the Prefect API at {api.url} does not answer: start it (`nemoflow demo` or `nemoflow deploy`)"
        )
    deadline = time.monotonic() + args.timeout
    with api.settings():
        while True:
            if args.wait:
                wait_for_slot(deadline, args.poll)
            flow_run_id, code = pl.run_deployment(api, args.deployment)
            if flow_run_id is None:
                return code or 1
            from prefect import get_client

            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
            refused = state is not None and state.is_cancelled() and (state.message or "").startswith(REFUSED)
            if refused and args.wait and time.monotonic() < deadline:
                print("another refresh took the slot first; waiting again")
                continue
            return 0 if state is not None and state.is_completed() else (code or 1)
