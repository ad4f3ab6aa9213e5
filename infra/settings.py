"""One typed settings model for the whole project.

Every field can be set from the environment with the ``NEMOFLOW_`` prefix
(``NEMOFLOW_WORK_DIR=gs://bucket/nemoflow``) or from a ``.env`` file in the
current directory. Secrets are :class:`pydantic.SecretStr`: their ``repr`` and
``str`` print ``**********``, so a settings object can be logged safely. Use
:func:`secret_env` to hand secrets to a job's environment, never string
formatting.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = os.path.expanduser("~/.nemoflow")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="NEMOFLOW_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        populate_by_name=True,
    )

    work_dir: str = Field(
        default=os.path.join(DEFAULT_HOME, "work"),
        description="Root URI for every artifact a run writes (plain path, file://, or gs://).",
    )
    result_storage: str | None = Field(
        default=None,
        description="Where Prefect persists task results (defaults to <work_dir>/prefect-results).",
    )
    gcs_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("NEMOFLOW_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST"),
        description="GCS endpoint override (the emulator in tests); unset for real GCS.",
    )
    gcs_project: str | None = Field(default=None, description="GCP project for gcsfs.")
    executor: Literal["local", "slurm", "k8s"] = Field(
        default="local",
        description="Where a flow's jobs run when its config names no executor; the executor's options come "
        "from NEMOFLOW_SLURM_* / NEMOFLOW_K8S_* (nemoflow settings shows them).",
    )
    region: Literal["us", "europe", "asia"] = Field(
        default="us", description="Resolves the <region> placeholder in image and data URIs."
    )
    hf_token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("NEMOFLOW_HF_TOKEN", "HF_TOKEN"),
        description="Hugging Face token, sent as a bearer header to huggingface.co only.",
    )
    wandb_api_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("NEMOFLOW_WANDB_API_KEY", "WANDB_API_KEY"),
        description="Weights & Biases key; metrics go to W&B only when it is set.",
    )
    registry_user: SecretStr | None = Field(
        default=None,
        description="Container registry login for enroot imports (nvcr.io: defaults to $oauthtoken).",
    )
    registry_password: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("NEMOFLOW_REGISTRY_PASSWORD", "NGC_API_KEY"),
        description="Container registry password (nvcr.io: the NGC API key); only the import job sees it.",
    )

    @property
    def result_storage_uri(self) -> str:
        from infra import storage

        return self.result_storage or storage.join(self.work_dir, "prefect-results")

    def secret_env(self) -> dict[str, str]:
        """Secrets as environment variables for a job, with the names tools expect."""
        env: dict[str, str] = {}
        if self.hf_token is not None:
            env["HF_TOKEN"] = self.hf_token.get_secret_value()
        if self.wandb_api_key is not None:
            env["WANDB_API_KEY"] = self.wandb_api_key.get_secret_value()
        if self.registry_user is not None:
            env["NEMOFLOW_REGISTRY_USER"] = self.registry_user.get_secret_value()
        if self.registry_password is not None:
            env["NEMOFLOW_REGISTRY_PASSWORD"] = self.registry_password.get_secret_value()
        return env

    def secret_values(self) -> list[str]:
        """Every secret value, for redaction of text that leaves the process."""
        return [v for v in self.secret_env().values() if v]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reload_settings() -> Settings:
    """Drop the cached settings (tests change the environment)."""
    get_settings.cache_clear()
    return get_settings()


def redact(text: str, secrets: list[str] | None = None) -> str:
    """Replace every secret value in ``text`` with ``***``."""
    for value in secrets if secrets is not None else get_settings().secret_values():
        if value:
            text = text.replace(value, "***")
    return text
