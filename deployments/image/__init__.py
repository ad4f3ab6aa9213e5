"""The nemoflow container image: Containerfiles, the podman build (``build``) and podman's host flags (``podman``)."""
