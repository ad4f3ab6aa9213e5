"""Extract NeMo-RL's DPO configuration schema (its TypedDicts and pydantic models) into infra/nemo_rl_dpo_schema.json.

    python -m devtools.nemo_rl_schema /path/to/NVIDIA-NeMo/RL [--out infra/nemo_rl_dpo_schema.json]

NeMo-RL (Python >= 3.13, CUDA) cannot be installed next to nemoflow, so the schema nemoflow's DPO
render is checked against (infra/nemo_rl.py ``check_config``) is read from NeMo-RL's source with
``ast``, never imported: for every class of the config modules, its fields, each field's annotation
(as written) and whether it is required (``NotRequired[...]`` and pydantic defaults are not). The
JSON records the commit it was read from; re-run this after upgrading the NeMo-RL version you launch.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

# The modules that define MasterConfig of nemo_rl/algorithms/dpo.py and the types it refers to.
MODULES = (
    "nemo_rl/algorithms/dpo.py",
    "nemo_rl/models/policy/__init__.py",
    "nemo_rl/data/__init__.py",
    "nemo_rl/utils/logger.py",
    "nemo_rl/utils/checkpoint.py",
    "nemo_rl/distributed/virtual_cluster.py",
    "nemo_rl/models/generation/interfaces.py",
)


def _kind(node: ast.ClassDef) -> str | None:
    names = {ast.unparse(base) for base in node.bases}
    if "TypedDict" in names or any(n.endswith(".TypedDict") for n in names):
        return "typeddict"
    if "BaseModel" in names or any(n.endswith(".BaseModel") for n in names):
        return "pydantic"
    return None


def _total(node: ast.ClassDef) -> bool:
    for keyword in node.keywords:
        if keyword.arg == "total" and isinstance(keyword.value, ast.Constant):
            return bool(keyword.value.value)
    return True


def classes_of(source: str) -> dict[str, dict]:
    """{class name: {"kind", "fields": {name: {"type", "required"}}}} of the TypedDicts and models in ``source``."""
    out: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            text = ast.unparse(node.value)
            if "[" in text or "|" in text:  # a type alias: SchedulerMilestones = dict[str, list[int]]
                aliases[node.targets[0].id] = text
        if not isinstance(node, ast.ClassDef) or (kind := _kind(node)) is None:
            continue
        fields = {}
        total = _total(node)
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
                continue
            annotation = ast.unparse(item.annotation)
            if kind == "typeddict":
                required = total and not annotation.startswith(("NotRequired[", "typing.NotRequired["))
            else:
                required = item.value is None
            if annotation.startswith(("NotRequired[", "Required[")):
                annotation = annotation[annotation.index("[") + 1 : -1]
            fields[item.target.id] = {"type": annotation, "required": required}
        out[node.name] = {"kind": kind, "fields": fields, "extra_allowed": kind == "pydantic" and _extra_allow(node)}
    for name, text in aliases.items():
        out.setdefault(name, {"kind": "alias", "type": text})
    return out


def _extra_allow(node: ast.ClassDef) -> bool:
    return any(
        k.arg == "extra" and isinstance(k.value, ast.Constant) and k.value.value == "allow" for k in node.keywords
    )


def extract(repo: Path) -> dict:
    classes: dict[str, dict] = {}
    for module in MODULES:
        for name, definition in classes_of((repo / module).read_text()).items():
            definition["module"] = module
            classes.setdefault(name, definition)
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"source": "NVIDIA-NeMo/RL", "commit": commit, "root": "MasterConfig", "classes": classes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.nemo_rl_schema", description=__doc__)
    parser.add_argument("repo", type=Path, help="a NeMo-RL checkout (git clone https://github.com/NVIDIA-NeMo/RL)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "infra" / "nemo_rl_dpo_schema.json"
    )
    args = parser.parse_args(argv)
    schema = extract(args.repo)
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"{len(schema['classes'])} classes from {schema['source']}@{schema['commit']} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
