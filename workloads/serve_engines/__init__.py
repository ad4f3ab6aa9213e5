"""Serving engines: one module each, one value in the flow's config (``serve.engine``).

    serve:
      engine: {engine: vllm, max_input_len: 4096, max_output_len: 1024, resources: {gpus_per_node: 4}}

=========  ==========================================================================================
auto       (default) vLLM where installed and a GPU is visible, else built-in; decided on the node
builtin    nemoflow's own server (workloads/serve.py): CPU, or one GPU in bf16
vllm       vLLM's OpenAI server behind the proxy (workloads/serve_engines/proxy.py), tensor parallel
triton     NeMo's Triton deploy script behind the proxy (in the NeMo container)
=========  ==========================================================================================

Every engine is a :class:`~workloads.serve_engines.base.ServeEngine`: its options (one pydantic model, from
which the flow config and the server's flags both come) and the same interface; the stage
(tasks/serve.py) and the server (workloads/serve.py) call that interface and never ask which engine they
hold (tests/foundation/test_engine_contract.py). A new engine: one module here and its line in
:data:`SERVE_ENGINES`.
"""

from __future__ import annotations

from infra.unions import tagged_union
from workloads.serve_engines.auto import Auto
from workloads.serve_engines.base import ServeEngine
from workloads.serve_engines.builtin import Builtin
from workloads.serve_engines.triton import Triton
from workloads.serve_engines.vllm import Vllm

SERVE_ENGINES: tuple[type[ServeEngine], ...] = (Auto, Builtin, Vllm, Triton)
ENGINES: dict[str, type[ServeEngine]] = {cls.model_fields["engine"].default: cls for cls in SERVE_ENGINES}
DEFAULT = "auto"


# The flow config's type: the engines by their `engine` value; a config without one means auto.
ServeEngineConfig = tagged_union(
    ENGINES,
    tag="engine",
    default=DEFAULT,
    description="the inference engine and its options (engine: " + ", ".join(ENGINES) + "; default auto)",
)


def engine_named(name: str) -> ServeEngine:
    """The engine called ``name`` with its default options; one line naming the choices otherwise."""
    if name not in ENGINES:
        raise ValueError(f"unknown serving engine {name!r}; choose one of {', '.join(ENGINES)}")
    return ENGINES[name]()


__all__ = ["ENGINES", "SERVE_ENGINES", "Auto", "Builtin", "ServeEngine", "ServeEngineConfig", "Triton", "Vllm"]
