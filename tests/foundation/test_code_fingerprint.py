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
