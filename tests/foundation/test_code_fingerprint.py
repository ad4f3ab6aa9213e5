"""A stage's cache key hashes its job's code without importing it.

The training stage's key (``tasks.train.EngineCode``) fingerprints ``workloads.train`` and the engine's other
modules; ``code_fingerprint`` imported them to read their source, so every flow-run process imported torch (and
the trainer) before its training stage: 18 s and 3 s in two Slurm demo runs between the data stage's end and
the training job's submit in the Slurm demo (seen with py-spy: ``code_fingerprint`` -> ``import torch``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

CHECK = """
import hashlib, importlib, inspect, json, pathlib, sys
from flows.end_to_end import demo_train_config
from tasks.common import code_fingerprint
from tasks.train_engines import as_engine

# the training stage's modules, and a package (its modules count too)
modules = (*as_engine(demo_train_config(), "pretrain").modules, "tasks.train", "tasks.train_engines.base", "tasks.data")
before = "torch" in sys.modules
key = code_fingerprint(*modules)
imported = sorted(m for m in ("torch", "nemo_automodel", "workloads.train") if m in sys.modules)
# the key as it was computed from the imported modules' source (cached results keep their keys)
digest = hashlib.sha256()
for name in sorted(modules):
    module = importlib.import_module(name)
    digest.update(name.encode())
    digest.update(inspect.getsource(module).encode())
    if hasattr(module, "__path__"):
        init = pathlib.Path(module.__file__)
        for path in sorted(init.parent.rglob("*.py")):
            if path != init:
                digest.update(str(path.relative_to(init.parent)).encode())
                digest.update(path.read_bytes())
print(json.dumps({"before": before, "imported": imported, "key": key, "from_modules": digest.hexdigest()[:16]}))
"""


def test_the_training_stages_key_imports_neither_torch_nor_the_trainer():
    proc = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] is False  # the flow's own imports leave torch out
    assert out["imported"] == []
    assert out["key"] == out["from_modules"]


# Modules a training job imports that cannot change what it computes: a change to them keeps the cached result.
NOT_IN_THE_RESULT = {"workloads.wandb_run": "where the W&B run went, for the stage's artifact"}


def _workloads_imports(path) -> set[str]:
    """The ``workloads.*`` modules a file imports (by its text: the job's code is not imported here)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "workloads":
            found.update(
                f"{node.module}.{a.name}" if _file_of(f"{node.module}.{a.name}").exists() else node.module
                for a in node.names
            )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "workloads")
    return found


def _file_of(module: str):
    base = REPO / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def test_each_training_engines_key_covers_every_workloads_module_its_job_imports():
    """A cached training or SFT result is reused only while the code that computed it is the same: every module
    under workloads/ that the job's entry module imports, directly or through another, is in the engine's
    ``modules`` (a package covers all of its modules). SFT's trainer takes its recipe sections, metrics log and
    launch from workloads/train/, which its key did not cover; the trainer imports workloads/moe_model.py."""
    from tasks.train_engines.automodel import SFT_MODULES, TRAIN_MODULES

    for entry, modules in (("workloads.train", TRAIN_MODULES), ("workloads.sft", SFT_MODULES)):
        seen, todo = set(), [entry]
        while todo:
            module = todo.pop()
            if module in seen or module == "workloads":
                continue
            seen.add(module)
            path = _file_of(module)
            files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
            for file in files:
                todo.extend(_workloads_imports(file))
        covered = {m for m in seen if any(m == k or m.startswith(k + ".") for k in modules)}
        missing = sorted(seen - covered - set(NOT_IN_THE_RESULT) - {"workloads"})
        assert not missing, f"{entry}'s job imports {missing}, which its cache key ({modules}) does not hash"
