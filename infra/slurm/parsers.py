"""Pure parsers for the text Slurm's commands print. No subprocesses here.

Every function takes the exact output of one command line (documented on the
function) and returns plain data, so it can be tested on captured output of a
real cluster (tests/slurm/data/) and works on any Slurm version that prints
the same columns. We never use ``--json``: on 22.05 ``sacct --json`` reports
SUCCESS for a job that exited 3.
"""

from __future__ import annotations

import dataclasses
import re

from infra.jobs import parse_time_limit
from infra.slurm.states import SlurmState

# sacct -X -n --parsable2 -o <SACCT_FIELDS> -j IDS
SACCT_FIELDS = "JobID,JobIDRaw,State,ExitCode,Reason,NodeList"
# squeue -h -o <SQUEUE_FORMAT> -j IDS  (%i: 123 or 123_4 or 123_[5-9%2])
SQUEUE_FORMAT = "%i|%T|%r|%N"
# sinfo -h -o <SINFO_FORMAT>  (one line per partition and node configuration)
SINFO_FORMAT = "%P|%a|%l|%D|%c|%m|%G|%T"


def parse_job_id(sbatch_parsable_output: str) -> str:
    """The job id from ``sbatch --parsable`` output (``ID`` or ``ID;CLUSTER``).

    >>> parse_job_id("4242\\n")
    '4242'
    >>> parse_job_id("4242;nemoflow")
    '4242'
    """
    lines = [line.strip() for line in sbatch_parsable_output.splitlines() if line.strip()]
    # sbatch can print warnings before the id; the id is the last line.
    if not lines:
        raise ValueError("sbatch printed no job id")
    job_id = lines[-1].split(";", 1)[0]
    if not re.fullmatch(r"\d+", job_id):
        raise ValueError(f"sbatch printed {lines[-1]!r}, not a job id")
    return job_id


@dataclasses.dataclass(frozen=True)
class JobId:
    """One row's job id: ``123`` (plain), ``123_4`` (array task), ``123_[5-9%2]`` (pending tasks)."""

    base: str
    task: int | None = None
    pending_tasks: str | None = None

    @classmethod
    def parse(cls, text: str) -> JobId:
        """
        >>> JobId.parse("123_4")
        JobId(base='123', task=4, pending_tasks=None)
        >>> JobId.parse("123_[5-9%2]").pending_tasks
        '5-9%2'
        """
        match = re.fullmatch(r"(\d+)(?:_(\d+)|_\[([^\]]+)\])?(?:\+\d+)?(?:\.\S+)?", text.strip())
        if not match:
            raise ValueError(f"not a Slurm job id: {text!r}")
        base, task, pending = match.groups()
        return cls(base, int(task) if task is not None else None, pending)


@dataclasses.dataclass(frozen=True)
class JobRow:
    """What one of sacct/squeue/scontrol says about a job or an array task."""

    job_id: JobId
    state: SlurmState
    raw_state: str
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    nodes: str | None = None
    restarts: int = 0
    source: str = "sacct"


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """sacct/scontrol ``ExitCode`` ``CODE:SIGNAL`` to ``(code, signal)``.

    >>> parse_exit_code("3:0")
    (3, 0)
    >>> parse_exit_code("0:9")
    (0, 9)
    """
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not match:
        return None, None
    return int(match.group(1)), int(match.group(2))


def _reason(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)") else text


def parse_sacct(output: str) -> list[JobRow]:
    """Rows of ``sacct -X -n --parsable2 -o JobID,JobIDRaw,State,ExitCode,Reason,NodeList``.

    >>> parse_sacct("7|7|FAILED|3:0|None|vm")[0].exit_code
    3
    >>> parse_sacct("9_1|10|CANCELLED by 0|0:15|None|vm")[0].state
    <SlurmState.CANCELLED: 'CANCELLED'>
    """
    rows = []
    for line in output.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 4:
            raise ValueError(f"unexpected sacct line {line!r}")
        job_id, _raw, state, exit_code = parts[:4]
        reason = parts[4] if len(parts) > 4 else ""
        nodes = parts[5] if len(parts) > 5 else ""
        restarts = parts[6] if len(parts) > 6 else "0"
        code, sig = parse_exit_code(exit_code)
        rows.append(
            JobRow(
                job_id=JobId.parse(job_id),
                state=SlurmState.parse(state),
                raw_state=state,
                exit_code=code,
                signal=sig,
                reason=_reason(reason),
                nodes=_reason(nodes) if nodes != "None assigned" else None,
                restarts=int(restarts) if restarts.strip().isdigit() else 0,
            )
        )
    return rows


def parse_squeue(output: str) -> list[JobRow]:
    """Rows of ``squeue -h -o '%i|%T|%r|%N'`` (no exit codes: squeue shows live jobs).

    >>> parse_squeue("12_[1-3%2]|PENDING|JobArrayTaskLimit|")[0].job_id.pending_tasks
    '1-3%2'
    """
    rows = []
    for line in output.splitlines():
        if not line.strip():
            continue
        job_id, state, reason, nodes = (line.split("|") + ["", "", ""])[:4]
        rows.append(
            JobRow(
                job_id=JobId.parse(job_id),
                state=SlurmState.parse(state),
                raw_state=state,
                reason=_reason(reason),
                nodes=_reason(nodes),
                source="squeue",
            )
        )
    return rows


_SCONTROL_PAIR = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9:/_]*)=(\S*)")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol -o show ...`` line to a dict (values with spaces are cut at the space).

    >>> parse_scontrol_record("JobId=5 JobState=FAILED ExitCode=3:0")["ExitCode"]
    '3:0'
    """
    return {key: value for key, value in _SCONTROL_PAIR.findall(line)}


def parse_scontrol_jobs(output: str) -> list[JobRow]:
    """Rows of ``scontrol -o show job [ID]`` (one line per job or array task).

    >>> parse_scontrol_jobs("JobId=6 ArrayJobId=5 ArrayTaskId=1 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15")[0].job_id
    JobId(base='5', task=1, pending_tasks=None)
    """
    rows = []
    for line in output.splitlines():
        if "JobId=" not in line:
            continue
        rec = parse_scontrol_record(line)
        base = rec.get("ArrayJobId") or rec["JobId"]
        task = rec.get("ArrayTaskId")
        if task is None or task in ("", "N/A"):
            job_id = JobId(base)
        elif task.isdigit():
            job_id = JobId(base, int(task))
        else:
            job_id = JobId(base, None, task)
        code, sig = parse_exit_code(rec.get("ExitCode", ""))
        state = rec.get("JobState", "UNKNOWN")
        rows.append(
            JobRow(
                job_id=job_id,
                state=SlurmState.parse(state),
                raw_state=state,
                exit_code=code,
                signal=sig,
                reason=_reason(rec.get("Reason", "")),
                nodes=_reason(rec.get("NodeList", "")),
                restarts=int(rec.get("Restarts", "0") or 0),
                source="scontrol",
            )
        )
    return rows


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_memory_mb(text: str) -> int:
    """sbatch/sinfo memory (``16G``, ``500M``, ``23081`` = MB) to MB.

    >>> parse_memory_mb("16G")
    16384
    >>> parse_memory_mb("23081")
    23081
    """
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", text.strip().upper())
    if not match:
        raise ValueError(f"memory {text!r} is not a number with an optional K/M/G/T unit")
    return int(float(match.group(1)) * _MEM_UNITS[match.group(2) or "M"])


def parse_gpu_count(gres: str) -> int:
    """GPUs in a sinfo ``%G`` string (``gpu:4``, ``gpu:h100:8(S:0-1)``, ``(null)``).

    >>> parse_gpu_count("gpu:h100:8(S:0-1),nic:1")
    8
    >>> parse_gpu_count("(null)")
    0
    """
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        item = re.sub(r"\(.*\)", "", item.strip())
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_time_or_none(text: str) -> int | None:
    """sinfo ``%l`` (``4:00:00``, ``1-00:00:00``, ``infinite``) to seconds; None when unlimited.

    >>> parse_time_or_none("infinite") is None
    True
    >>> parse_time_or_none("4:00:00")
    14400
    """
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    if re.fullmatch(r"\d+-\d{1,2}", text):  # D-HH
        days, hours = text.split("-")
        return int(days) * 86400 + int(hours) * 3600
    if re.fullmatch(r"\d+-\d{1,2}:\d{2}", text):  # D-HH:MM
        days, rest = text.split("-")
        hours, minutes = rest.split(":")
        return int(days) * 86400 + int(hours) * 3600 + int(minutes) * 60
    return parse_time_limit(text)


@dataclasses.dataclass
class Partition:
    """A partition as sinfo reports it; per-node figures are the largest node's."""

    name: str
    default: bool
    available: str
    max_time_s: int | None
    nodes: int
    cpus_per_node: int
    mem_per_node_mb: int
    gpus_per_node: int
    node_states: list[str]


def parse_sinfo(output: str) -> dict[str, Partition]:
    """Partitions from ``sinfo -h -o '%P|%a|%l|%D|%c|%m|%G|%T'``, merging node groups.

    >>> parts = parse_sinfo("cpu*|up|4:00:00|1|2|23081|gpu:4|idle")
    >>> parts["cpu"].default, parts["cpu"].gpus_per_node
    (True, 4)
    """
    partitions: dict[str, Partition] = {}
    for line in output.splitlines():
        if not line.strip():
            continue
        name, avail, limit, nodes, cpus, mem, gres, state = (line.split("|") + [""] * 8)[:8]
        default = name.endswith("*")
        name = name.rstrip("*")
        cpus_n = int(re.sub(r"\D.*", "", cpus) or 0)
        mem_n = parse_memory_mb(mem.rstrip("+")) if mem.strip().rstrip("+") else 0
        part = partitions.get(name)
        if part is None:
            partitions[name] = Partition(
                name,
                default,
                avail,
                parse_time_or_none(limit),
                int(nodes or 0),
                cpus_n,
                mem_n,
                parse_gpu_count(gres),
                [state] if state else [],
            )
        else:
            part.nodes += int(nodes or 0)
            part.cpus_per_node = max(part.cpus_per_node, cpus_n)
            part.mem_per_node_mb = max(part.mem_per_node_mb, mem_n)
            part.gpus_per_node = max(part.gpus_per_node, parse_gpu_count(gres))
            if state:
                part.node_states.append(state)
    return partitions
