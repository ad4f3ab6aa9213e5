"""What every serving engine is: one pydantic model of its options (the flow config's ``serve.engine`` and the
server's ``--engine ...`` flags, like vLLM's ``EngineArgs``) with the same small interface.

Pipeline side (the stage builds the service from it, never asking which engine it holds):

- ``resources``: the server job's resources (GPUs mean tensor parallel = GPUs for the GPU engines);
- :meth:`ServeEngine.server_args`: its flags of ``python -m workloads.serve``.

Node side (``python -m workloads.serve`` runs it, never asking which engine it holds):

- :meth:`ServeEngine.on_node`: the engine that serves on this node (``auto`` decides here);
- :meth:`ServeEngine.serve`: serve the checkpoint until stopped; the exit code.

A new engine is one module in this package and its line in ``SERVE_ENGINES`` (``__init__.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from infra.jobs import Resources

ENGINE_HOST = "127.0.0.1"  # where an engine behind the proxy listens

# The options every engine has; the rest of a model's fields are its own and become server flags.
COMMON = ("engine", "resources", "allow_unauthenticated")


class ServeEngine(BaseModel):
    """One inference engine's options (subclasses set ``engine`` and add their own)."""

    model_config = ConfigDict(extra="forbid")

    engine: str
    resources: Resources = Field(
        default_factory=lambda: Resources(cpus_per_task=1),
        description="of the server job; GPUs mean tensor parallel = GPUs for vllm and triton",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="serve on a cluster without an API key (NEMOFLOW_SERVE_API_KEY); the server logs a warning",
    )

    # Whether --tensor-parallel-size (= the job's GPUs) is passed: engines that shard over GPUs.
    tensor_parallel: ClassVar[bool] = False
    # Whether the engine can start on standby (``--standby``: random weights of the checkpoint's shape, while the
    # model trains) and load the checkpoint's weights in place later (``POST /nemoflow/load``).
    can_standby: ClassVar[bool] = False

    # ---------------------------------------------------------------- pipeline side

    def served_name(self) -> str:
        """The ``--engine`` value the server gets (``auto`` may decide before the node does)."""
        return self.engine

    def server_args(self) -> list[str]:
        """The engine's flags of ``python -m workloads.serve``: its name, tensor parallel, its options."""
        out = ["--engine", self.served_name()]
        if self.tensor_parallel and self.resources.gpus_per_node:
            out += ["--tensor-parallel-size", str(self.resources.gpus_per_node)]  # tensor parallel = the GPUs given
        return out + option_flags(self)

    # ---------------------------------------------------------------- node side

    def on_node(self, args: argparse.Namespace) -> ServeEngine:
        """The engine that serves on this node (itself; ``auto`` decides between engines here)."""
        return self

    def serve(self, args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
        """Serve ``checkpoint`` until stopped; the process's exit code."""
        raise NotImplementedError


def flag(name: str) -> str:
    """A field's server flag: ``max_input_len`` -> ``--max-input-len``; a list field is repeated in the
    singular (``engine_args`` -> ``--engine-arg=X`` once per value)."""
    if name.endswith("_args"):
        name = name[:-1]
    return "--" + name.replace("_", "-")


def option_flags(engine: BaseModel) -> list[str]:
    """The engine's own options (those set) as server flags; the server's parser has the same names."""
    out: list[str] = []
    for name in type(engine).model_fields:
        value: Any = getattr(engine, name)
        if name in COMMON or value is None:
            continue
        if isinstance(value, list):
            out += [f"{flag(name)}={item}" for item in value]
        elif isinstance(value, bool):
            out += [flag(name)] if value else []
        else:
            out += [flag(name), str(value)]
    return out


def visible_gpus(environ: dict[str, str] | None = None) -> int:
    """GPUs this process was given (Slurm and the NVIDIA device plugin set CUDA_VISIBLE_DEVICES)."""
    environ = os.environ if environ is None else environ
    devices = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not devices or devices in ("-1", "none", "void", "NoDevFiles"):
        return 0
    return len([d for d in devices.split(",") if d.strip()])
