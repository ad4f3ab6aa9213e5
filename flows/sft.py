"""Flow ``sft``: supervised fine-tuning of a registered model on chat data.

    stage image -> chat data (any URI, or the KJV demo set) -> fine-tune (NeMo AutoModel, or your command) ->
    check on held-out chat (loss below the base's, answers) -> register with its parent

Started by ``prefect deployment run sft/local`` (``sft/slurm``, ``sft/k8s``), or in Python:
``sft(SftFlowConfig(data={"source": "gs://bucket/chat.jsonl"}))``. The base model is the
registry's promoted model (``end-to-end`` registers and promotes its checkpoint) unless
``base_model`` names another. The fine-tuned model is registered with the base as its parent;
it is promoted only with ``promote: true``. The end-to-end and CPT flows include the same stage
(:func:`tasks.sft.run_sft`).
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra import registry as reg
from infra import storage
from infra.executors import Executor, default_executor
from infra.settings import get_settings
from tasks.common import result_storage
from tasks.image import ImageConfig, stage_image
from tasks.sft import ChatDataConfig, demo_sft_config, run_sft, train_over_demo_defaults
from tasks.train_engines import SftEngine


class SftFlowConfig(BaseModel):
    """The sft flow's single parameter."""

    model_config = ConfigDict(extra="forbid")

    executor: Executor = Field(default_factory=default_executor, description="where the jobs run (as in end-to-end)")
    image: ImageConfig = Field(default_factory=ImageConfig, description="what the jobs run in")
    data: ChatDataConfig = Field(default_factory=ChatDataConfig, description="the chat data (default: KJV demo set)")
    train: SftEngine = Field(
        default_factory=demo_sft_config, description="the fine-tuning run (engine: automodel, the default, or command)"
    )
    registry: str | None = Field(None, description="model registry URI (default <work_dir>/registry)")
    base_model: str | None = Field(None, description="registry id of the model to fine-tune (default: the promoted)")
    promote: bool = Field(False, description="promote the fine-tuned model once it passed its checks")

    @field_validator("train", mode="before")
    @classmethod
    def _train_over_demo_defaults(cls, value):
        return train_over_demo_defaults(value)

    def registry_uri(self) -> str:
        return storage.normalize(self.registry) if self.registry else storage.join(get_settings().work_dir, "registry")


class NoBaseModel(RuntimeError):
    pass


def base_record(registry_uri: str, model_id: str | None) -> reg.ModelRecord:
    """The model to fine-tune: ``model_id``, else the promoted one; the error says how to get one."""
    state = reg.ModelRegistry(registry_uri).read()
    if model_id:
        return state.model(model_id)
    promoted = state.promoted_model()
    if promoted is None:
        raise NoBaseModel(
            f"the model registry {registry_uri} has no promoted model to fine-tune; run "
            "`prefect deployment run end-to-end/local` once (it registers and promotes its checkpoint), "
            "or set base_model to a registered id"
        )
    return promoted


@flow(name="sft", log_prints=True)
def sft(config: SftFlowConfig | None = None) -> dict:
    config = config or SftFlowConfig()
    registry_uri = config.registry_uri()
    base = base_record(registry_uri, config.base_model)
    image = stage_image.with_options(result_storage=result_storage())(
        config.image.source, config.image.dest, config.executor, config.image.convert
    )
    return run_sft(config.train, config.data, base, registry_uri, config.executor, image, config.promote)
