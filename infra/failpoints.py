"""Named failpoints: test fault injection through one registry, off unless named in the environment.

    NEMOFLOW_FAILPOINTS="train.crash_in_save_at_step=8,consolidate.crash_before_manifest" python -m workloads.train ...

Production code carries one line per point (``if failpoints.at("train.oom_at_step", step): ...``);
tests build the variable with :func:`env` and can list what they may inject (:data:`KNOWN`).
Modelled on etcd/TiKV's failpoints: a point that is not enabled costs a dictionary lookup of the
already-parsed variable. An unknown name is an error, so a typo in a test cannot silently inject nothing.
"""

from __future__ import annotations

import functools
import os

ENV = "NEMOFLOW_FAILPOINTS"

# name -> what enabling it does (the value, where one is taken, is a step number or a delay)
KNOWN: dict[str, str] = {
    "train.oom_at_step": "raise torch.OutOfMemoryError at optimizer step N (the trainer then exits 75)",
    "train.pause_after_step": "after logging step N, wait up to 120 s for a stop signal (SIGTERM/SIGUSR1)",
    "train.crash_in_save_at_step": "SIGKILL the trainer inside the save of step N: weights written, optimizer not",
    "train.log_samples": "every rank prints a hash of every sample it trains on",
    "train.crash_after_save_at_step": "SIGKILL the trainer right after the save of step N was handed to the "
    "background writer (before it can be published)",
    "train.fail_checkpoint_write_at_step": "the background checkpoint writer fails the save of step N with an I/O "
    "error after writing part of a file ('N+': every save from step N on)",
    "train.kill_checkpoint_writer_at_step": "the background checkpoint writer process SIGKILLs itself half-way "
    "through writing the save of step N",
    "train.slow_checkpoint_write_at_step": "the snapshot writer (ckpt_snapshots) pauses 4 s half-way through "
    "persisting the snapshot of step N ('N+': every snapshot from step N on), so later snapshots replace the one "
    "waiting",
    "train.slow_background_write_at_step": "the background checkpoint writer process waits 6 s before writing the "
    "save of step N ('N+': every save from step N on), so later saves find it still being written "
    "(ckpt_while_writing)",
    "train.kill_trainer_during_write_at_step": "the background checkpoint writer process SIGKILLs the trainer "
    "when it receives the optimizer part of the save of step N, then writes it (ckpt_while_writing: replace: the "
    "next run publishes it)",
    "consolidate.crash_before_manifest": "SIGKILL the export after its weights are written, before MANIFEST.json",
    "consolidate.pause_before_manifest": "the export sleeps 120 s after writing its weights, before MANIFEST.json",
    "serve.step_delay_ms": "the built-in engine sleeps N ms before each token it generates (a slow model: "
    "a burst then overflows the queue however slowly the clients arrive)",
}


@functools.cache
def _parse(spec: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in KNOWN:
            raise KeyError(f"{ENV} names unknown failpoint {name!r}; known: {', '.join(sorted(KNOWN))}")
        points[name] = value
    return points


def value(name: str) -> str | None:
    """The failpoint's value ('' when enabled without one), or None when it is off."""
    if name not in KNOWN:
        raise KeyError(f"unknown failpoint {name!r}")
    return _parse(os.environ.get(ENV, "")).get(name)


def enabled(name: str) -> bool:
    return value(name) is not None


def at(name: str, step: int) -> bool:
    """True when failpoint ``name`` is enabled for step ``step``."""
    configured = value(name)
    return configured is not None and configured != "" and int(configured) == step


def hits(name: str, step: int) -> bool:
    """True when failpoint ``name`` is enabled for step ``step``: its value ``N`` (that step) or ``N+`` (that step
    and every later one: faults that repeat, such as a storage that keeps failing)."""
    configured = value(name)
    if not configured:
        return False
    if configured.endswith("+"):
        return step >= int(configured[:-1])
    return int(configured) == step


def env(**points: int | str | bool) -> dict[str, str]:
    """``{ENV: "a=1,b"}`` for a subprocess; names use ``__`` for the dot (``train__oom_at_step=3``)."""
    items = []
    for key, val in points.items():
        name = key.replace("__", ".")
        if name not in KNOWN:
            raise KeyError(f"unknown failpoint {name!r}; known: {', '.join(sorted(KNOWN))}")
        items.append(name if val is True else f"{name}={val}")
    return {ENV: ",".join(items)}
