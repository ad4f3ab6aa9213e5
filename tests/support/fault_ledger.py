"""What the faults suite injected and what came of it, printed as one table at the end of a run.

    from tests.support import fault_ledger
    fault_ledger.record("gcs 503 during a shard download", injected=2, survived=2)

``survived`` counts faults after which the run told the truth: the work finished verified, or
ended with a clear one-line error and nothing half-written under a final name. ``data_lost``
counts bytes-level losses (a corrupt or half-written file under a final name): always 0 when
the code is right, and a test asserts it before recording.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class Row:
    fault: str
    test: str
    injected: int
    survived: int
    data_lost: int = 0
    stuck: int = 0


ROWS: list[Row] = []
_printed = False


def record(fault: str, *, injected: int, survived: int, data_lost: int = 0, stuck: int = 0) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].rsplit("::", 1)[-1]
    ROWS.append(Row(fault, test, injected, survived, data_lost, stuck))


def table() -> str:
    header = ("fault", "injected", "survived", "data lost", "stuck runs")
    rows = [(r.fault, str(r.injected), str(r.survived), str(r.data_lost), str(r.stuck)) for r in ROWS]
    total = ("total", *(str(sum(int(row[i]) for row in rows)) for i in range(1, 5)))
    widths = [max(len(line[i]) for line in [header, *rows, total]) for i in range(5)]

    def fmt(line) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, rows), rule, fmt(total)])


def terminal_summary(terminalreporter) -> None:
    """Print the table once per session (several conftests may call this hook)."""
    global _printed
    if ROWS and not _printed:
        _printed = True
        terminalreporter.write_sep("=", "faults injected / survived")
        terminalreporter.write_line(table())
