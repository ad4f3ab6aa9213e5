"""``nemoflow render --backend k8s --out DIR``: write the manifests a run would submit, for review and kubectl."""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = """\
Write every Kubernetes object a pipeline run would create, one YAML file per
object named <kind>-<name>.yaml, plus the workspace PVC (apply it once):

  nemoflow render --backend k8s --out manifests/
  kubectl apply -f manifests/persistentvolumeclaim-nemo-workspace.yaml
  kubectl apply -f manifests/

--config FILE (YAML) sets the plan (image, nodes, gpus_per_node, file_groups,
tensor_parallel, ...) and, under `k8s:`, the cluster options (namespace,
pvc_name, scheduler_name, service_account, secret_name, training_kind,
inference_kind, ...). NEMOFLOW_K8S_* environment variables fill the rest.
Secrets are referenced by name (secretKeyRef), never written."""


def register(sub) -> None:
    parser = sub.add_parser(
        "render",
        help="write the manifests a run would submit (kubectl apply -f DIR)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backend", choices=["k8s"], default="k8s", help="target (only k8s renders manifests)")
    parser.add_argument("--out", required=True, help="directory to write the YAML files into (created)")
    parser.add_argument("--config", help="YAML file: plan keys and a `k8s:` section")
    parser.set_defaults(func=run)


def load_config(path: str | None) -> dict:
    if not path:
        return {}
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def run(args) -> int:
    from deployments.plan import planned_specs
    from infra.k8s.options import K8sOptions
    from infra.k8s.render import write_manifests

    config = load_config(args.config)
    options = K8sOptions.from_mapping(config.get("k8s"))
    written = write_manifests(planned_specs(config), options, args.out)
    for path in written:
        relative = os.path.relpath(path)
        print(path if relative.startswith("..") else relative)
    print(f"{len(written)} manifests in {args.out}; review, then: kubectl apply -f {args.out}", file=sys.stderr)
    return 0
