"""Slurm's commands (sbatch, squeue, sacct, scancel, sinfo, scontrol) behind one small class.

Only the command line is used, never slurmrestd: it works on every Slurm
version and needs nothing but the client tools and munge on this machine.
Transient controller errors (a busy slurmctld) are retried a few times, as
submitit does, under a :class:`infra.retry.RetryPolicy` (tenacity, growing jittered waits); anything else raises :class:`SlurmCommandError` with the
command's own message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping

from infra.retry import RetryPolicy
from infra.slurm import parsers

_TRANSIENT = (
    "Socket timed out",
    "Unable to contact slurm controller",
    "Slurm temporarily unable",
    "Transport endpoint is not connected",
    "Resource temporarily unavailable",
)


def _busy(exc: BaseException) -> bool:
    """The retry predicate: a busy or unreachable controller (stderr above) or a command that did not answer.

    A private mark rather than the ``transient`` attribute :func:`infra.retry.is_transient` reads: once these
    retries are spent the error is final, and a task's own retries should not start over.
    """
    return getattr(exc, "_busy", False) is True


class SlurmUnavailable(RuntimeError):
    """Slurm's client tools are missing or the controller cannot be reached."""


class SlurmCommandError(RuntimeError):
    def __init__(self, argv: list[str], returncode: int, stderr: str):
        self.argv, self.returncode, self.stderr = argv, returncode, stderr.strip()
        super().__init__(f"`{' '.join(argv[:2])} ...` failed (exit {returncode}): {self.stderr}")


class SlurmCLI:
    """Runs Slurm commands. ``SLURM_CONF`` etc. come from the environment as usual."""

    def __init__(self, retries: int = 3, retry_delay_s: float = 2.0, timeout_s: float = 60.0):
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.timeout_s = timeout_s

    def run(self, argv: list[str], env: Mapping[str, str] | None = None, input: str | None = None) -> str:  # noqa: A002 - subprocess.run's name
        if shutil.which(argv[0], path=(env or os.environ).get("PATH")) is None:
            raise SlurmUnavailable(
                f"`{argv[0]}` is not on PATH: install Slurm's client tools (Debian: slurm-client) "
                "or run on a login node of the cluster"
            )
        policy = RetryPolicy(
            attempts=self.retries + 1,
            initial=self.retry_delay_s,
            maximum=max(self.retry_delay_s, 10.0),
            budget=None,
            transient=_busy,
        )
        return policy.call(self._once, argv, env, input)

    def _once(self, argv: list[str], env: Mapping[str, str] | None, input: str | None) -> str:  # noqa: A002 - subprocess.run's own keyword
        """One attempt; a failure that another attempt may cure is marked ``_busy`` (see :func:`_busy`)."""
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=dict(env) if env is not None else None,
                input=input,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            error: Exception = SlurmUnavailable(f"`{argv[0]}` did not answer within {self.timeout_s:.0f}s")
            error._busy = True
            raise error from exc
        if proc.returncode == 0:
            return proc.stdout
        if any(t in proc.stderr for t in _TRANSIENT[:2]):
            error = SlurmUnavailable(f"the Slurm controller is unreachable: {proc.stderr.strip()}")
        else:
            error = SlurmCommandError(argv, proc.returncode, proc.stderr)
        error._busy = any(t in proc.stderr for t in _TRANSIENT)
        raise error

    # ------------------------------------------------------------------ commands

    def sbatch(self, script_path: str, env: Mapping[str, str], extra_args: Iterable[str] = ()) -> str:
        """Submit ``script_path``; returns the job id. ``env`` is sbatch's whole environment."""
        out = self.run(["sbatch", "--parsable", *extra_args, script_path], env=env)
        return parsers.parse_job_id(out)

    def sacct(self, job_ids: Iterable[str]) -> list[parsers.JobRow]:
        ids = ",".join(job_ids)
        if not ids:
            return []
        out = self.run(["sacct", "-X", "-n", "--parsable2", "-o", parsers.SACCT_FIELDS, "-j", ids])
        return parsers.parse_sacct(out)

    def squeue(self, job_ids: Iterable[str]) -> list[parsers.JobRow]:
        ids = ",".join(job_ids)
        if not ids:
            return []
        try:
            out = self.run(["squeue", "-h", "-r", "-o", parsers.SQUEUE_FORMAT, "-j", ids])
        except SlurmCommandError as exc:
            # squeue fails outright when every listed job has left the queue.
            if "Invalid job id" in exc.stderr:
                return []
            raise
        return parsers.parse_squeue(out)

    def scontrol_job(self, job_id: str) -> list[parsers.JobRow]:
        try:
            out = self.run(["scontrol", "-o", "show", "job", job_id])
        except SlurmCommandError as exc:
            if "Invalid job id" in exc.stderr:
                return []
            raise
        return parsers.parse_scontrol_jobs(out)

    def scancel(self, job_ids: Iterable[str], signal: str | None = None, batch: bool = False) -> None:
        """Cancel jobs; with ``signal``, only signal them (``batch``: the batch step alone).

        Slurm turns ``--signal=KILL`` into a plain cancel (SIGTERM, then SIGKILL after KillWait)
        unless ``--batch`` is given: only then does the batch step get SIGKILL itself.
        """
        ids = list(job_ids)
        if not ids:
            return
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        self.run(argv + ids)

    def partitions(self) -> dict[str, parsers.Partition]:
        return parsers.parse_sinfo(self.run(["sinfo", "-h", "-o", parsers.SINFO_FORMAT]))
