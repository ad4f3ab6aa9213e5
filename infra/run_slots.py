"""Who holds a one-at-a-time slot, read from the Prefect API (the API cannot list a limit's holders).

    holders = slot_holders("cpt-refresh", run_ids=[recorded_holder])
    holders[0].describe()   # "run 'x' (id), Running since ...; last heartbeat ...; ... Crashed at ..."

A holder is a live (Pending, Running, Cancelling) flow run; when its process dies it stays Running
until the heartbeat automation (:data:`ZOMBIE_AUTOMATION`, created by ``nemoflow deploy`` / ``demo``,
devtools/prefect_local.py) marks it Crashed, a fixed time after its last heartbeat: that time is
when a dead holder's slot frees at the latest, and what a refused run tells the user.
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid

ZOMBIE_AUTOMATION = "nemoflow: crash flow runs whose heartbeats stopped"


@dataclasses.dataclass(frozen=True)
class SlotHolder:
    """A flow run that holds (or is about to hold) a one-at-a-time slot, as the API sees it."""

    id: str
    name: str
    state: str
    since: datetime.datetime | None
    last_heartbeat: datetime.datetime | None
    crash_after_s: float | None  # the zombie automation's window; None when no automation watches

    @property
    def deadline(self) -> datetime.datetime | None:
        """When it is marked Crashed if no heartbeat comes any more (its process died); None if nothing will."""
        if self.crash_after_s is None:
            return None
        start = self.last_heartbeat or self.since
        return start + datetime.timedelta(seconds=self.crash_after_s) if start else None

    def describe(self) -> str:
        """One line: which run, since when, and when its slot frees if it is dead."""
        since = f" since {_clock(self.since)}" if self.since else ""
        beat = f"last heartbeat {_clock(self.last_heartbeat)}" if self.last_heartbeat else "no heartbeat yet"
        if self.deadline is not None:
            frees = (
                f"if its process died it is marked Crashed at {_clock(self.deadline)} (heartbeat deadline: "
                f"{self.crash_after_s:g} s without one) and its slot frees then at the latest"
            )
        else:
            frees = f"no automation marks it Crashed if its process died: run `nemoflow deploy` (it creates {ZOMBIE_AUTOMATION!r})"
        return f"run '{self.name}' ({self.id}), {self.state}{since}; {beat}; {frees}"


def _clock(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%H:%M:%S UTC")


def slot_holders(
    flow_name: str | None = None, run_ids: list[str] | None = None, exclude: str | None = None
) -> list[SlotHolder]:
    """The live (Pending, Running, Cancelling) runs among ``run_ids`` and the runs of flow ``flow_name``,
    except ``exclude``, oldest first, each with its last heartbeat (``prefect.flow-run.heartbeat`` events)
    and the zombie automation's window. Uses the Prefect API of the current settings."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    live = FlowRunFilterState(
        type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])
    )
    with get_client(sync_client=True) as client:
        runs = {}
        if run_ids:
            ids = FlowRunFilterId(any_=[uuid.UUID(str(i)) for i in run_ids])
            runs.update({r.id: r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=ids, state=live))})
        if flow_name:
            found = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])), flow_run_filter=FlowRunFilter(state=live)
            )
            runs.update({r.id: r for r in found})
        automations = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        window = automations[0].trigger.within.total_seconds() if automations and automations[0].enabled else None
        holders = []
        for run in runs.values():
            if exclude is not None and str(run.id) == str(exclude):
                continue
            page = client.read_events(
                filter=EventFilter(
                    event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                    resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
                ),
                limit=1,
            )
            holders.append(
                SlotHolder(
                    id=str(run.id),
                    name=run.name,
                    state=run.state.name if run.state else "?",
                    since=run.start_time or run.expected_start_time,
                    last_heartbeat=page.events[0].occurred if page.events else None,
                    crash_after_s=window,
                )
            )
    return sorted(holders, key=lambda h: h.since or datetime.datetime.max.replace(tzinfo=datetime.UTC))
