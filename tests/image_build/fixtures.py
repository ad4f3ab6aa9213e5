"""The CPU image, built once per test session (cached across sessions in ~/.cache/nemoflow-image and podman)."""

from __future__ import annotations

import functools
import sys

import pytest

from deployments.image.build import build

TEST_TAG = "localhost/nemoflow-test:cpu"


@functools.cache
def built_image() -> str:
    # The first build on a fresh machine bootstraps Debian and installs every wheel (minutes);
    # later ones reuse the base, the wheelhouse and the dependency layer (seconds).
    return build("cpu", [TEST_TAG], log=lambda line: print(line, file=sys.stderr)).tag


@pytest.fixture(scope="session")
def nemoflow_image() -> str:
    return built_image()
