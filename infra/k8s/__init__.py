"""Kubernetes: typed manifests (manifests.py), options (options.py), image checks (images.py),
API configuration (config.py), failure reasons (reasons.py), manifest files (render.py).
The backend that submits them is infra/backends/k8s.py."""
