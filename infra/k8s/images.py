"""Container image references, checked before anything is submitted.

A typo in an image name otherwise surfaces minutes later as ImagePullBackOff;
the grammar is Docker's reference grammar (distribution/reference), the one
definition in :mod:`infra.images`: ``[registry[:port]/]path[:tag][@sha256:<64 hex>]``.
"""

from __future__ import annotations

import re

from infra.images import DIGEST, REFERENCE


class InvalidImageReference(ValueError):
    pass


def validate_image_reference(image: str) -> str:
    """Return ``image`` if it is a valid reference, else raise naming what is wrong.

    >>> validate_image_reference("nvcr.io/nvidia/nemo:25.02")
    'nvcr.io/nvidia/nemo:25.02'
    """
    if not image or image != image.strip():
        raise InvalidImageReference(f"image reference {image!r} is empty or has surrounding spaces")
    if len(image) > 4096:
        raise InvalidImageReference("image reference is longer than 4096 characters")
    if image.endswith(".sqsh") or image.startswith(("/", "./")):
        raise InvalidImageReference(
            f"image {image!r} is a file (an enroot .sqsh?); Kubernetes needs a registry reference "
            "like nvcr.io/nvidia/nemo:25.02"
        )
    if "://" in image:
        raise InvalidImageReference(f"image {image!r} must not have a scheme; write e.g. nvcr.io/nvidia/nemo:25.02")
    match = REFERENCE.match(image)
    if not match:
        hint = ""
        if "@" in image and not re.search(rf"@{DIGEST}$", image):
            hint = " (a digest is @sha256: followed by 64 lowercase hex digits)"
        elif image.lower() != image and "/" not in image.split(":")[0]:
            hint = " (repository names are lowercase)"
        raise InvalidImageReference(
            f"image reference {image!r} is not [registry/]repository[:tag][@sha256:digest]{hint}"
        )
    return image
