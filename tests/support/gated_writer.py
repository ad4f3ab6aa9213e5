"""A file system that holds a checkpoint write until the test lets it go: torch's real FileSystemWriter whose
``write_data`` (run in torch.distributed.checkpoint's background writer process) first marks that it started
and then waits for a gate file. A slow disk, made deterministic: while the gate is closed the write is in
progress, however loaded the machine is, and the test decides when it ends.

It lives in a module (not in the test) because the writer process unpickles it by its import path.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter


class GatedWriter(FileSystemWriter):
    def __init__(self, path, gate: str, started: str, limit_s: float = 600.0, **kwargs):
        super().__init__(path, **kwargs)
        self.gate, self.started, self.limit_s = gate, started, limit_s

    def write_data(self, plan, planner):
        Path(self.started).touch()
        deadline = time.monotonic() + self.limit_s  # never hang a test run for good
        while not Path(self.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().write_data(plan, planner)
