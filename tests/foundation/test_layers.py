"""The import graph of the first-party packages: no cycles, and every layer imports only downwards.

    workloads/  code that runs inside jobs          -> infra only (and the standard/third-party libraries)
    infra/      talks to the outside                -> workloads (job formats), not the pipeline above it
    infra/configs/  the config models all of them share -> infra only, and no torch (flows import them)
    tasks/      the stages                          -> infra, workloads
    flows/      chain stages                        -> tasks, infra, workloads
    nemoflow/   the CLI                             -> anything
    devtools/   local Slurm, the demo's control plane -> infra (never the pipeline)

Every ``import`` counts, at module level and inside functions alike: a function-level
import is a deferred edge, not a missing one (the settings <-> storage cycle was one).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("nemoflow", "flows", "tasks", "infra", "workloads", "deployments", "devtools")

# importer package -> packages it must never import
FORBIDDEN = {
    "workloads": {"tasks", "flows", "nemoflow", "devtools", "deployments"},
    "infra": {"tasks", "flows", "nemoflow", "devtools"},
    "tasks": {"flows", "nemoflow", "devtools"},
    "flows": {"nemoflow", "devtools"},
    "devtools": {"tasks", "flows", "nemoflow"},
}

# infra/configs/ sits below workloads/: the job imports the models from there, so they import no job code
CONFIGS = "infra.configs"
CONFIGS_FORBIDDEN = {"workloads"}
# ... and no training or tokenizer stack: a flow or the CLI imports a config without loading one
HEAVY_MODULES = ("torch", "transformers", "nemo_automodel", "megatron", "numpy", "sentencepiece")

ENTRY_POINT = "runs as a job entry point (python -m): job code lives in workloads/"

# Violations being removed right now (issue #10). Each entry must still exist: the test
# fails when one is gone, so whoever fixes it deletes its line here.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def first_party_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules that ``name`` imports anywhere in its source (module level or in functions)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from a import b`: the module a.b when it is one, else the attribute b of module a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]  # `import a.b.c` of a non-module name: its nearest module
            if target and target.split(".")[0] in PACKAGES and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = first_party_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def job_entry_points(modules: dict[str, Path]) -> set[str]:
    """First-party modules that pipeline code launches as jobs: ``[..., "-m", "pkg.module", ...]`` literals,
    and the module argument of the job builders (``workload_job(name, "pkg.module", ...)``)."""
    found = set()
    for name, path in modules.items():
        if name.split(".")[0] not in ("tasks", "flows", "infra", "deployments"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("workload_job", "workload_service"):
                module = node.args[1] if len(node.args) > 1 else None
                if isinstance(module, ast.Constant) and module.value in modules:
                    found.add(module.value)
            if isinstance(node, ast.List | ast.Tuple):
                values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                for flag, target in zip(values, values[1:]):
                    if flag == "-m" and isinstance(target, str) and target in modules:
                        found.add(target)
    return found


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for importer, targets in graph.items():
        forbidden = FORBIDDEN.get(importer.split(".")[0], set())
        bad |= {(importer, target) for target in targets if target.split(".")[0] in forbidden}
        if importer == CONFIGS or importer.startswith(CONFIGS + "."):
            bad |= {(importer, target) for target in targets if target.split(".")[0] in CONFIGS_FORBIDDEN}
    modules = first_party_modules()
    bad |= {(module, ENTRY_POINT) for module in job_entry_points(modules) if not module.startswith("workloads.")}
    return bad


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    # module level: `from infra.settings import get_settings` in infra/storage.py
    assert "infra.settings" in graph["infra.storage"]
    # function level: nemoflow/commands/demo.py imports the control plane inside run()
    assert "devtools.prefect_local" in graph["nemoflow.commands.demo"]
    # `from infra import storage` is an edge to the module infra.storage, not to the package
    assert "infra.storage" in graph["infra.services"]


def test_entry_points_are_found_where_jobs_are_built():
    entry_points = job_entry_points(first_party_modules())
    assert "workloads.train" in entry_points  # tasks/train_engines/automodel.py: [python, "-m", "workloads.train", ...]
    assert "workloads.tokenize_array" in entry_points


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_import_only_downwards():
    violations = layer_violations(import_graph())
    new = sorted(violations - KNOWN_VIOLATIONS)
    assert new == [], "against the layering:\n" + "\n".join(f"  {a}: {b}" for a, b in new)


def test_known_violations_still_exist():
    """An allowlisted violation that was fixed must leave KNOWN_VIOLATIONS (so it cannot come back unseen)."""
    gone = sorted(KNOWN_VIOLATIONS - layer_violations(import_graph()))
    assert gone == [], "fixed, remove from KNOWN_VIOLATIONS: " + ", ".join(f"{a} -> {b}" for a, b in gone)


def test_config_models_import_no_job_code():
    """A config model imported from workloads/ by infra/configs/ is found (the rule can fail)."""
    assert ("infra.configs.train", "workloads.moe_model") in layer_violations(
        {"infra.configs.train": {"workloads.moe_model", "infra.jobs"}}
    )
    assert "infra.configs.moe" in import_graph()["infra.configs.train"]


def test_config_models_load_no_training_stack():
    """Importing every shared config model (and running a check of each kind) loads no torch, numpy, ..."""
    import subprocess
    import sys

    names = sorted(name for name in first_party_modules() if name.startswith(CONFIGS + "."))
    assert {"infra.configs.train", "infra.configs.sft", "infra.configs.memory_plan"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "from infra.configs.train import TrainConfig, check_parallelism\n"
        "from infra.configs.memory_plan import plan_memory\n"
        "config = TrainConfig(max_steps=1)\n"
        "check_parallelism(config)\n"
        "plan_memory(config, gpu_memory_gib=80.0)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY_MODULES!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
