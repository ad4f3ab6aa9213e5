"""One typed settings model for the whole project.

Every field can be set from the environment with the ``NEMOFLOW_`` prefix
(``NEMOFLOW_WORK_DIR=gs://bucket/nemoflow``) or from a ``.env`` file in the
current directory. Secrets are :class:`pydantic.SecretStr`: their ``repr`` and
``str`` print ``**********``, so a settings object can be logged safely. Use
:func:`secret_env` to hand secrets to a job's environment, never string
formatting.

An invalid value fails where settings are first read (:func:`get_settings`) with a
:class:`SettingsError` whose message is one line naming the variable and what it
accepts (``NEMOFLOW_REGION='mars' is invalid: input should be 'us', 'europe' or
'asia'``); the CLI prints it and exits 2.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = os.path.expanduser("~/.nemoflow")


class SettingsError(ValueError):
    """A setting from the environment or ``.env`` is invalid; the message is one line naming it."""

    @classmethod
    def from_validation_error(cls, exc: ValidationError, model: type[BaseSettings]) -> SettingsError:
        """One line for every problem pydantic found, named as the user set it (the variable).

        Works for any settings model with an ``env_prefix`` (NEMOFLOW_SLURM_*, NEMOFLOW_K8S_* too).
        Values of secret fields are never repeated.
        """
        prefix = model.model_config.get("env_prefix", "")
        problems = []
        for error in exc.errors():
            loc = [str(part) for part in error["loc"]]
            field = model.model_fields.get(loc[0]) if loc else None
            # A field name becomes PREFIX_NAME; an alias (HF_TOKEN, STORAGE_EMULATOR_HOST) is the variable itself.
            variable = (prefix + loc[0]).upper() if field is not None else (loc[0].upper() if loc else "?")
            if len(loc) > 1:
                variable += "__" + "__".join(part.upper() for part in loc[1:])
            secret = field is not None and "SecretStr" in str(field.annotation)
            shown = "" if secret or "input" not in error or error["type"] == "missing" else f"={error['input']!r}"
            message = error["msg"][:1].lower() + error["msg"][1:]
            problems.append(f"{variable}{shown} is invalid: {message}")
        return cls("; ".join(problems) + " (set in the environment or .env)")


DEFAULT_UMASK = 0o027


class PermissionPolicyError(ValueError):
    """NEMOFLOW_UMASK / NEMOFLOW_GROUP is invalid or cannot be applied; the message is one line."""


def parse_umask(text: str | int) -> int:
    """``"027"`` / ``"0o027"`` / ``23`` -> 0o027; refuses a umask that leaves files world-writable.

    >>> oct(parse_umask("007"))
    '0o7'
    """
    if isinstance(text, int):
        value = text
    else:
        digits = str(text).strip().lower().removeprefix("0o")
        if not digits or len(digits) > 4 or any(c not in "01234567" for c in digits):
            raise PermissionPolicyError(f"{text!r} is not an octal umask such as 027 or 007")
        value = int(digits, 8)
    if not 0 <= value <= 0o777:
        raise PermissionPolicyError(f"{oct(value)} is not a umask (000 to 777)")
    if not value & 0o002:
        raise PermissionPolicyError(
            f"umask {value:03o} would make files world-writable: the last digit must be 2, 3, 6 or 7 "
            "(027: group reads; 007: group reads and writes)"
        )
    if value & 0o600:
        raise PermissionPolicyError(f"umask {value:03o} would stop nemoflow from reading or writing its own files")
    return value


def group_id(name: str | int) -> int:
    """The gid of a group name (or number) on this machine."""
    import grp

    text = str(name).strip()
    try:
        return grp.getgrgid(int(text)).gr_gid if text.isdigit() else grp.getgrnam(text).gr_gid
    except KeyError:
        raise PermissionPolicyError(f"no group {text!r} on this machine") from None


# The variable that holds the endpoints' API key, in the flow run and in the server job alike.
SERVE_API_KEY_ENV = "NEMOFLOW_SERVE_API_KEY"


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
    # A name of infra/executors.py's EXECUTORS, checked where it becomes an executor (as_executor: one line
    # naming the value and the choices); that module imports this one, so the list is not repeated here.
    executor: str = Field(
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
    serve_api_key: SecretStr | None = Field(
        default=None,
        description="API key of the inference endpoints nemoflow deploys (clients send 'Authorization: Bearer "
        "<key>'); it reaches the server by name only (a Kubernetes Secret key, sbatch's environment).",
    )

    umask: str = Field(
        default="027",
        description="umask of every nemoflow process and job, and the mode of the files and directories nemoflow "
        "writes on shared storage: 027 = files 0640, directories 0750; a team sharing a work dir sets 007. "
        "Files must stay not world-writable (infra/permissions.py).",
    )
    group: str | None = Field(
        default=None,
        description="group (name or gid) of the directories nemoflow creates, with the setgid bit so everything "
        "written below them belongs to it; unset = the process's group.",
    )

    @field_validator("umask", mode="before")
    @classmethod
    def _check_umask(cls, value: object) -> str:
        return f"{parse_umask(value if isinstance(value, int) else str(value)):03o}"

    @field_validator("group")
    @classmethod
    def _check_group(cls, value: str | None) -> str | None:
        if value is not None and value.strip():
            group_id(value)
            return value.strip()
        return None

    @property
    def umask_value(self) -> int:
        return int(self.umask, 8)

    @property
    def result_storage_uri(self) -> str:
        """``result_storage``, else ``<work_dir>/prefect-results``.

        Joined here as ``infra.storage.join`` would (a test checks they agree): storage
        imports this module, so importing storage back would make a cycle.
        """
        if self.result_storage:
            return self.result_storage
        work_dir = self.work_dir
        if "://" in work_dir and not work_dir.startswith("file://"):
            return work_dir.rstrip("/") + "/prefect-results"
        local = os.path.abspath(os.path.expanduser(work_dir.removeprefix("file://")))
        return os.path.join(local, "prefect-results")

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
        if self.serve_api_key is not None:
            env[SERVE_API_KEY_ENV] = self.serve_api_key.get_secret_value()
        return env

    def secret_values(self) -> list[str]:
        """Every secret value, for redaction of text that leaves the process."""
        return [v for v in self.secret_env().values() if v]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings, read once; an invalid value raises :class:`SettingsError` (one line)."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError.from_validation_error(exc, Settings) from None


def reload_settings() -> Settings:
    """Drop the cached settings (tests change the environment)."""
    get_settings.cache_clear()
    return get_settings()


def redact(text: str, secrets: list[str] | None = None) -> str:
    """Replace every secret value in ``text`` with ``***``.

    Besides ``secrets`` (default: the settings' secrets), the values that infra.secrets resolved
    from ``<secret:NAME>`` / ``<env:NAME>`` references in this process are hidden too.
    """
    from infra.secrets import resolved_values

    values = list(secrets if secrets is not None else get_settings().secret_values())
    for value in values + resolved_values():
        if value:
            text = text.replace(value, "***")
    return text
