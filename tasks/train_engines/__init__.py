"""Training engines: one module each, one value in the flow's config (``train:``).

=========  ==========================================================================================
automodel  (default) NVIDIA NeMo AutoModel's recipes run by nemoflow's trainers (automodel.py): the
           flat ``train:`` section with NeMo's names, as it always was
command    your own command in the image under nemoflow's environment contract (command.py)
=========  ==========================================================================================

Each stage has its list: a CPT refresh takes AutoModel's budget and schedule (the model's shape is the
promoted checkpoint's), fine-tuning AutoModel's SFT options; ``command`` serves all three. Every engine is a
:class:`~tasks.train_engines.base.TrainEngine` and the stages call its interface, never its name
(tests/foundation/test_engine_contract.py). A new engine: one module here and its line in the lists below.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from infra.unions import tagged_union
from tasks.train_engines.automodel import AutoModel, AutoModelCpt, AutoModelSft
from tasks.train_engines.base import TrainEngine, TrainInputs, over_default
from tasks.train_engines.command import Command

DEFAULT = "automodel"  # a train section without `engine` (every config written before engines were values)

PRETRAIN_ENGINES: dict[str, type[TrainEngine]] = {"automodel": AutoModel, "command": Command}
CPT_ENGINES: dict[str, type[TrainEngine]] = {"automodel": AutoModelCpt, "command": Command}
SFT_ENGINES: dict[str, type[TrainEngine]] = {"automodel": AutoModelSft, "command": Command}


def engine_union(engines: dict[str, type[TrainEngine]], what: str) -> Any:
    return tagged_union(
        engines,
        tag="engine",
        default=DEFAULT,
        description=f"{what}: the training engine (engine: "
        + " or ".join(engines)
        + "; default automodel) and its options",
    )


PretrainEngine = engine_union(PRETRAIN_ENGINES, "pretraining")
CptEngine = engine_union(CPT_ENGINES, "a CPT refresh's training run")
SftEngine = engine_union(SFT_ENGINES, "fine-tuning")

_ADAPTERS = {name: TypeAdapter(union) for name, union in (("pretrain", PretrainEngine), ("sft", SftEngine))}


def as_engine(value: Any, stage: str) -> TrainEngine:
    """An engine of ``stage`` ("pretrain" or "sft") from an engine, a mapping or a plain options model (a
    :class:`~infra.configs.train.TrainConfig` handed to ``pretrain`` is the AutoModel engine's options)."""
    if isinstance(value, TrainEngine):
        return value
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return _ADAPTERS[stage].validate_python(value)


__all__ = [
    "CPT_ENGINES",
    "PRETRAIN_ENGINES",
    "SFT_ENGINES",
    "AutoModel",
    "AutoModelCpt",
    "AutoModelSft",
    "Command",
    "CptEngine",
    "PretrainEngine",
    "SftEngine",
    "TrainEngine",
    "TrainInputs",
    "as_engine",
    "engine_union",
    "over_default",
]
