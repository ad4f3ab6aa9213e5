"""The image errors: each names its input; ``transient`` says whether the stage's retry may cure it."""

from __future__ import annotations


class ImageError(ValueError):
    """A problem with an image source, a copy or a conversion; the message names the input."""

    # True where trying again may succeed (a dropped connection, a corrupted
    # transfer); the Prefect task retries only those.
    transient = False


class ImageSourceError(ImageError):
    """The source cannot be read completely (a transfer problem: worth a retry)."""

    transient = True


class ImageNotFound(ImageSourceError):
    """The source does not exist."""

    transient = False


class ImageVerificationError(ImageError):
    """The file is not a usable squashfs image."""


class ImageCorrupted(ImageVerificationError):
    """A copy does not match its source (size or checksum): the transfer went wrong."""

    transient = True


class ImageDestinationError(ImageError):
    """The destination cannot take the image (not writable, not enough space)."""


class RegistryCredentialsError(ImageError):
    """A private registry needs credentials that are not set."""


class EnrootNotFound(ImageError):
    """The conversion job ran on a node without enroot."""
