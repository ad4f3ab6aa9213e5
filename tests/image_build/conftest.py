from tests.image_build.fixtures import nemoflow_image  # noqa: F401 - a fixture, used by name
