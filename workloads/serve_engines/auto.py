"""``auto``: not an engine but the choice of one, made on the node that serves (:func:`resolve_engine`):
vLLM where it is installed and a GPU is visible, else the built-in engine (on the GPU in bf16 when there is
one). It takes the options of both; a server job without GPUs is the built-in engine."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Literal

from workloads.serve_engines.base import ServeEngine
from workloads.serve_engines.builtin import Builtin
from workloads.serve_engines.vllm import Vllm, vllm_installed

log = logging.getLogger("nemoflow.serve")


class Auto(Vllm, Builtin):
    """vLLM or the built-in engine, decided where the server runs."""

    engine: Literal["auto"] = "auto"  # type: ignore[assignment] - the choice, not one engine

    def served_name(self) -> str:
        return "auto" if self.resources.gpus_per_node else "builtin"  # with GPUs the node decides

    def on_node(self, args: argparse.Namespace) -> ServeEngine:
        chosen = resolve_engine(self.engine, args.vllm_executable, getattr(args, "vllm_python", None))
        return {"vllm": Vllm, "builtin": Builtin}[chosen]()


def resolve_engine(engine: str, vllm_executable: str = "vllm", vllm_python: str | None = None) -> str:
    """``auto``: vLLM when this node has a GPU and vLLM is installed (its own environment: ``vllm_python`` or
    ``$NEMOFLOW_VLLM_PYTHON``; else on PATH or in this Python), else the built-in engine (which uses the GPU
    when there is one). Decided here, where the server runs, not where the flow runs."""
    if engine != "auto":
        return engine
    if not _gpu_visible():
        return "builtin"
    if vllm_installed(vllm_python, vllm_executable):
        return "vllm"
    log.info("no vLLM on this node: the built-in engine serves on the GPU")
    return "builtin"


def _gpu_visible() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
