"""Registry credentials for an enroot import: from the settings, checked before a job is submitted, by name in the job."""

from __future__ import annotations

from pydantic import SecretStr

from infra.images.errors import RegistryCredentialsError
from infra.images.references import DockerRef
from infra.settings import get_settings

# Registries that refuse anonymous pulls of the images we care about; others
# are tried anonymously when no credentials are set.
LOGIN_REQUIRED = {"nvcr.io": "$oauthtoken"}
# Hosts enroot's curl talks to while pulling from a registry: the token
# service lives elsewhere for Docker Hub and NGC, and needs the same login.
NETRC_HOSTS = {
    "nvcr.io": ["nvcr.io", "authn.nvidia.com"],
    "docker.io": ["registry-1.docker.io", "auth.docker.io"],
}


USER_ENV = "NEMOFLOW_REGISTRY_USER"
PASSWORD_ENV = "NEMOFLOW_REGISTRY_PASSWORD"


def registry_login(ref: DockerRef) -> tuple[str, SecretStr] | None:
    """(user, password) for ``ref``'s registry from the settings; None for an anonymous pull.

    Raises :class:`RegistryCredentialsError` before anything is submitted when
    the registry needs a login that is not configured.
    """
    settings = get_settings()
    default_user = LOGIN_REQUIRED.get(ref.registry)
    user = settings.registry_user.get_secret_value() if settings.registry_user else default_user
    password = settings.registry_password
    if password is None:
        if ref.registry in LOGIN_REQUIRED:
            raise RegistryCredentialsError(
                f"{ref.registry} needs credentials to pull {ref.canonical}: set {PASSWORD_ENV} (for nvcr.io, "
                f"your NGC API key; the user defaults to {default_user})"
            )
        if settings.registry_user is not None:
            raise RegistryCredentialsError(f"{USER_ENV} is set but {PASSWORD_ENV} is not")
        return None
    if not user:
        raise RegistryCredentialsError(f"{PASSWORD_ENV} is set but {USER_ENV} is not (registry {ref.registry})")
    for label, value in (("user", user), ("password", password.get_secret_value())):
        if not value or any(c.isspace() for c in value) or '"' in value:
            # netrc separates tokens by white space; such a value cannot be written safely.
            raise RegistryCredentialsError(
                f"registry {label} for {ref.registry} is empty or contains white space or quotes"
            )
    return user, password


def netrc_hosts(registry: str) -> list[str]:
    return NETRC_HOSTS.get(registry, [registry.split(":", 1)[0]])
