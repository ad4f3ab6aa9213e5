"""Extract NeMo-RL's DPO configuration schema (its TypedDicts and pydantic models) into infra/nemo_rl_dpo_schema.json.

    python -m devtools.nemo_rl_schema /path/to/NVIDIA-NeMo/RL [--out infra/nemo_rl_dpo_schema.json]

NeMo-RL (Python >= 3.13, CUDA) cannot be installed next to nemoflow, so the schema nemoflow's DPO
render is checked against (infra/nemo_rl.py ``check_config``) is read from NeMo-RL's source with
``ast``, never imported: for every class of the config modules, its fields, each field's annotation
(as written) and whether it is required (``NotRequired[...]`` and pydantic defaults are not). The
JSON records the commit it was read from; re-run this after upgrading the NeMo-RL version you launch.

From that record it also writes the same schema as a JSON Schema (``--json-schema``, default
infra/nemo_rl_dpo.schema.json; ``--from-record`` rebuilds it from the record alone), which
``check_config`` validates with ``jsonschema``: one ``$defs`` entry per class, no keys beyond the
class's fields, its required fields required, each annotation as a JSON Schema type. Every
schema node carries its annotation as written (``x-annotation``) and every class its name
(``title``), so an error can name what NeMo-RL expected.
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


# Annotations by name; the rest are NeMo-RL classes and aliases ($ref) or typing's generics (below).
_SIMPLE: dict[str, dict] = {
    "int": {"type": "integer"},  # a Python int (check_config's validator refuses 8.0 as NeMo-RL's int)
    "float": {"type": "number"},
    "str": {"type": "string"},
    "bool": {"type": "boolean"},
    "PathLike": {"type": "string"},  # os.PathLike in a YAML config is its path
    "Any": {},
    "None": {"type": "null"},
    "Tensor": {"not": {}},  # torch.Tensor: no YAML value is one
}


def _type_schema(node: ast.expr, classes: dict[str, dict]) -> dict:
    """The JSON Schema of one annotation (parsed), with the annotation itself under ``x-annotation``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a forward reference: 'os.PathLike[Any]'
        return _type_schema(ast.parse(node.value, mode="eval").body, classes)
    schema = _bare_schema(node, classes)
    return {**schema, "x-annotation": ast.unparse(node)}


def _bare_schema(node: ast.expr, classes: dict[str, dict]) -> dict:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return {"anyOf": [_type_schema(node.left, classes), _type_schema(node.right, classes)]}
    if isinstance(node, ast.Constant) and node.value is None:
        return {"type": "null"}
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).rsplit(".", 1)[-1]
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Literal":
            return {"enum": [ast.literal_eval(a) for a in args]}
        if head == "Union":
            return {"anyOf": [_type_schema(a, classes) for a in args]}
        if head == "Optional":
            return {"anyOf": [_type_schema(args[0], classes), {"type": "null", "x-annotation": "None"}]}
        if head in ("list", "List", "Sequence"):
            return {"type": "array", "items": _type_schema(args[0], classes)}
        if head in ("dict", "Dict", "Mapping"):
            return {
                "type": "object",
                "propertyNames": _type_schema(args[0], classes),
                "additionalProperties": _type_schema(args[1], classes),
            }
        if head == "PathLike":
            return dict(_SIMPLE["PathLike"])
        raise ValueError(f"cannot express NeMo-RL's annotation {ast.unparse(node)} as a JSON Schema")
    name = ast.unparse(node).rsplit(".", 1)[-1]
    if name in _SIMPLE:
        return dict(_SIMPLE[name])
    if name not in classes:
        raise ValueError(f"NeMo-RL type {name} is not among the extracted classes")
    return {"$ref": f"#/$defs/{name}"}


def json_schema(record: dict) -> dict:
    """The JSON Schema (draft 2020-12) of the DPO MasterConfig, from what :func:`extract` recorded."""
    classes = record["classes"]
    defs: dict[str, dict] = {}
    for name, definition in sorted(classes.items()):
        if definition["kind"] == "alias":
            defs[name] = _type_schema(ast.parse(definition["type"], mode="eval").body, classes)
            continue
        fields = definition["fields"]
        defs[name] = {
            "title": name,
            "x-annotation": name,
            "type": "object",
            "properties": {
                key: {**_type_schema(ast.parse(f["type"], mode="eval").body, classes), "x-annotation": f["type"]}
                for key, f in fields.items()
            },
            "required": [key for key, f in fields.items() if f["required"]],
            # NeMo-RL's TypedDicts take no other keys; a model with extra='allow' would, but a key nemoflow
            # writes that NeMo-RL does not name is a typo either way.
            "additionalProperties": False,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:nemoflow:nemo-rl-dpo:{record['commit']}",
        "description": f"NeMo-RL's DPO MasterConfig, from {record['source']}@{record['commit']} (devtools/nemo_rl_schema.py)",
        "x-source": record["source"],
        "x-commit": record["commit"],
        "$ref": f"#/$defs/{record['root']}",
        "$defs": defs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.nemo_rl_schema", description=__doc__)
    infra = Path(__file__).resolve().parents[1] / "infra"
    parser.add_argument(
        "repo", type=Path, nargs="?", help="a NeMo-RL checkout (git clone https://github.com/NVIDIA-NeMo/RL)"
    )
    parser.add_argument("--out", type=Path, default=infra / "nemo_rl_dpo_schema.json", help="the extracted record")
    parser.add_argument("--json-schema", type=Path, default=infra / "nemo_rl_dpo.schema.json")
    parser.add_argument(
        "--from-record", action="store_true", help="rebuild the JSON Schema from --out without a NeMo-RL checkout"
    )
    args = parser.parse_args(argv)
    if args.from_record:
        schema = json.loads(args.out.read_text())
    elif args.repo is None:
        parser.error("give a NeMo-RL checkout, or --from-record")
    else:
        schema = extract(args.repo)
        args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"{len(schema['classes'])} classes from {schema['source']}@{schema['commit']} -> {args.out}")
    args.json_schema.write_text(json.dumps(json_schema(schema), indent=1) + "\n")
    print(f"JSON Schema -> {args.json_schema}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
