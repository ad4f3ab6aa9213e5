"""A flow that holds the ``cpt-refresh`` slot until told to let go (tests/cpt/test_refresh_slot.py deploys it).

It takes the slot with :func:`flows.cpt_refresh.refresh_lock`, the refresh's own code, records its pid,
and waits for the file ``release``. (Not named ``flows.py``: Prefect imports an entrypoint file under its
own name, and a module ``flows`` would shadow the ``flows`` package.)
"""

from __future__ import annotations

import os
import pathlib
import time

from prefect import flow

from flows.cpt_refresh import refresh_lock


@flow(name="holds-the-refresh-slot")
def holds_the_refresh_slot(directory: str) -> str:
    d = pathlib.Path(directory)
    with refresh_lock(2):
        (d / f"flow-{os.environ.get('PREFECT__FLOW_RUN_ID', 'x')}.pid").write_text(str(os.getpid()))
        while not (d / "release").exists():
            time.sleep(0.2)
    return "released"
