"""A serving engine's own environment for a node without internet (devtools/engine_env.py): the closure
resolved by pip against the node's freeze list, big wheels cut into parts and joined + checked on the node,
one chunk per call, the node's torch reused. The engine here is a toy package (``toyengine``, a stand-in for
vLLM, whose wheels need CUDA): the resolution, download, split, join and install are real."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools import engine_env as ee
from devtools import wheelhouse as wh
from tests.install.nodes import make_node
from tests.install.test_wheelhouse import bundled, make_wheel, offline_env, pip_offline, setup_offline

TORCH = md.version("torch")
PACKAGING = md.version("packaging")


# -- parts and chunks ---------------------------------------------------------------------------


def test_split_and_join_give_back_the_same_bytes(tmp_path):
    data = os.urandom(250_000)
    src = tmp_path / "big.whl"
    src.write_bytes(data)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    parts = ee.split_file(src, parts_dir, 100_000)
    assert [p["size"] for p in parts] == [100_000, 100_000, 50_000]
    assert [p["file"] for p in parts] == ["big.whl.part-01", "big.whl.part-02", "big.whl.part-03"]
    out = ee.join_parts([parts_dir / p["file"] for p in parts], tmp_path / "joined.whl", ee.sha256_of(src))
    assert out.read_bytes() == data


def test_a_damaged_part_is_refused_and_nothing_half_joined_is_left(tmp_path):
    src = tmp_path / "big.whl"
    src.write_bytes(os.urandom(30_000))
    parts = ee.split_file(src, tmp_path, 10_000)
    second = tmp_path / parts[1]["file"]
    second.write_bytes(b"x" + second.read_bytes()[1:])
    with pytest.raises(ee.EngineEnvError, match=r"joined.whl: its 3 parts joined have sha256 .* copy its chunk again"):
        ee.join_parts([tmp_path / p["file"] for p in parts], tmp_path / "joined.whl", ee.sha256_of(src))
    assert not (tmp_path / "joined.whl").exists() and not list(tmp_path.glob("*.joining"))


def test_chunks_never_exceed_the_limit():
    sizes = {"a": 60, "b": 50, "c": 40, "d": 30, "e": 10, "f": 5}
    chunks = ee.pack_chunks(sizes, 64)
    assert sorted(f for c in chunks for f in c) == sorted(sizes)
    assert all(sum(sizes[f] for f in c) <= 64 for c in chunks)
    assert len(chunks) == 4  # 195 bytes need at least 4 chunks of 64
    with pytest.raises(ee.EngineEnvError, match=r"a \(0.0 MiB\) is bigger than a chunk"):
        ee.pack_chunks({"a": 65}, 64)


def test_strip_removes_the_member_and_its_record_line(tmp_path):
    whl = make_wheel(tmp_path, "fat", "1.0")
    with zipfile.ZipFile(whl, "a") as z:
        z.writestr("fat/_big_C.so", b"\0" * 1000)
        z.writestr("fat/_small_C.so", b"\0" * 10)
    with zipfile.ZipFile(whl) as z:  # make_wheel's RECORD is empty: give it lines to keep and to drop
        items = {i.filename: z.read(i) for i in z.infolist()}
    items["fat-1.0.dist-info/RECORD"] = b"fat/__init__.py,,\nfat/_big_C.so,,\nfat/_small_C.so,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)
    assert ee.strip_wheel(whl, ["fat/_big_*.so"]) == ["fat/_big_C.so"]
    with zipfile.ZipFile(whl) as z:
        assert "fat/_big_C.so" not in z.namelist() and "fat/_small_C.so" in z.namelist()
        assert z.read("fat-1.0.dist-info/RECORD").decode().splitlines() == ["fat/__init__.py,,", "fat/_small_C.so,,"]
    with pytest.raises(ee.EngineEnvError, match="nothing in fat-1.0-py3-none-any.whl matches"):
        ee.strip_wheel(whl, ["fat/_nothing.so"])


# -- a toy engine built, then installed one chunk per call --------------------------------------


def engine_wheel(index: Path, version: str, requires: list[str]) -> Path:
    whl = make_wheel(index, "toyengine", version, requires)
    with zipfile.ZipFile(whl, "a") as z:
        z.writestr(f"toyengine-{version}.dist-info/entry_points.txt", "[console_scripts]\ntoyengine = toyengine:main\n")
        z.writestr(
            "toyengine/cli.py",
            "import numbaish, packaging, torch\n"
            "def main():\n    print('toyengine', numbaish.VERSION, 'torch', torch.__version__)\n",
        )
    # the module's main, what the console script calls
    with zipfile.ZipFile(whl) as z:
        items = {i.filename: z.read(i) for i in z.infolist()}
    items["toyengine/__init__.py"] += b"\nfrom toyengine.cli import main\n"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)
    return whl


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local index: the toy engine (pins numbaish 0.65 where the node has 0.68, needs the node's torch and
    packaging, a big dependency that travels in parts, an optional one left out), and fake torches for pip's
    resolution (never downloaded: the node's is used)."""
    index = tmp_path / "index"
    index.mkdir()
    pip_whl = bundled("pip", tmp_path / "scratch")
    (index / pip_whl.name).write_bytes(pip_whl.read_bytes())
    monkeypatch.setenv("TOY_PIP_VERSION", pip_whl.name.split("-")[1])
    engine_wheel(index, "1.0", ["torch", f"packaging>={PACKAGING}", "numbaish==0.65", "bigdep", "optdep"])
    engine_wheel(index, "2.0", ["torch==9.9", "numbaish==0.65"])
    make_wheel(index, "torch", TORCH)
    make_wheel(index, "torch", "9.9")
    make_wheel(index, "packaging", PACKAGING)
    make_wheel(index, "numbaish", "0.65")
    make_wheel(index, "bigdep", "1.0", pad=5_000_000)
    make_wheel(index, "optdep", "1.0", ["optdep-only"])
    make_wheel(index, "optdep-only", "1.0")
    (tmp_path / "node-freeze.txt").write_text(f"torch=={TORCH}\npackaging=={PACKAGING}\nnumbaish==0.68\n")
    pip_offline(monkeypatch, index)
    return tmp_path


def build(root: Path, engine: str, *extra: str) -> int:
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    argv = ["build", "--engine", engine, "--out", str(root / "wh"), "--python-version", py]
    argv += ["--pip-version", os.environ["TOY_PIP_VERSION"]]
    return wh.main(argv + ["--have", str(root / "node-freeze.txt"), "--without", "optdep", *extra])


def test_the_closure_leaves_out_what_the_node_has_and_what_serving_does_not_import(index, capsys):
    assert build(index, "toyengine==1.0", "--split-mb", "2.1") == 0
    chunks = sorted((index / "wh").glob("chunk-*"))
    m = json.loads((chunks[0] / ee.MANIFEST).read_text())
    carried = {w["name"]: w for w in m["wheels"]}
    assert sorted(carried) == ["bigdep", "numbaish", "toyengine"]
    assert carried["numbaish"]["version"] == "0.65"  # the engine's pin, not the node's 0.68
    assert sorted(m["reused"]) == ["packaging", "torch"]
    assert m["left_out"] == {"optdep": "--without"} and m["left_out_with_them"] == ["optdep-only"]
    assert len(carried["bigdep"]["parts"]) == 3  # ~4.8 MiB in parts of 2.1 MiB
    limit = int(2.1 * ee.MIB)
    for chunk in chunks:
        assert sum(f.stat().st_size for f in chunk.iterdir() if f.name != ee.MANIFEST) <= limit
    assert "toyengine==1.0: 3 wheels" in capsys.readouterr().out


def test_an_engine_that_pins_another_torch_is_refused(index, capsys):
    assert build(index, "toyengine==2.0") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"error: toyengine requires torch==9.9; the node has torch {TORCH}: choose the toyengine version whose "
        "torch pin is the node's (a second torch does not travel)"
    )


def node_with_tfish_1_0(index) -> None:
    """tfish 1.0 (hubish < 2) and 1.1 (hubish >= 2), hubish 1.0 and 2.0 in the index; the node has tfish 1.0 and
    hubish 1.0 (transformers 5.17.0 and huggingface-hub 1.33.0 on the H200, in small)."""
    wheels = index / "index"
    make_wheel(wheels, "tfish", "1.0", ["hubish<2"])
    make_wheel(wheels, "tfish", "1.1", ["hubish>=2"])
    make_wheel(wheels, "hubish", "1.0")
    make_wheel(wheels, "hubish", "2.0")
    freeze = index / "node-freeze.txt"
    freeze.write_text(freeze.read_text() + "tfish==1.0\nhubish==1.0\n")


def test_a_package_the_node_supplies_brings_its_own_versions_requirements(index):
    """The node's copy of a package is what the engine imports, so its requirements (not the newest release's)
    decide the rest. Found on the H200: the node's transformers 5.17.0 (huggingface-hub <2.0) was reused while
    the closure was walked with transformers 5.25.0's (>= 2.4.0), so huggingface-hub 2.4.0 travelled, shadowed
    the node's 1.33.0, and vLLM's import of transformers failed."""
    wheels = index / "index"
    engine_wheel(wheels, "3.0", ["torch", "tfish>=1.0"])
    node_with_tfish_1_0(index)
    assert build(index, "toyengine==3.0") == 0
    m = json.loads((index / "wh" / ee.MANIFEST).read_text())
    assert [w["name"] for w in m["wheels"]] == ["toyengine"]
    assert m["reused"]["hubish"]["node_version"] == "1.0"
    assert m["reused"]["hubish"]["requires"] == ["tfish: hubish<2"]


def test_a_node_copy_that_rejects_what_the_engine_needs_travels_at_the_resolved_release(index, capsys):
    """The engine needs hubish >= 2; the node's tfish 1.0 wants hubish < 2: tfish 1.1 (which takes hubish 2)
    travels beside hubish 2.0 and the engine's venv imports both, never the node's tfish with the new hubish."""
    wheels = index / "index"
    engine_wheel(wheels, "4.0", ["torch", "tfish>=1.0", "hubish>=2"])
    node_with_tfish_1_0(index)
    assert build(index, "toyengine==4.0") == 0
    m = json.loads((index / "wh" / ee.MANIFEST).read_text())
    assert {w["name"]: w["version"] for w in m["wheels"]} == {"hubish": "2.0", "tfish": "1.1", "toyengine": "4.0"}
    assert "tfish" not in m["reused"] and "hubish" not in m["reused"]
    out = capsys.readouterr().out
    assert "the node's tfish 1.0 requires hubish<2; hubish 2.0 travels: tfish 1.1 travels too" in out


@pytest.mark.slow
def test_chunks_install_one_call_at_a_time_beside_the_nodes_torch(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as on the H200 node: imports write no .pyc
    assert build(index, "toyengine==1.0", "--split-mb", "2.1") == 0
    chunks = sorted((index / "wh").glob("chunk-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(chunks) >= 3
    node_python = make_node(tmp_path / "node", {"torch", "packaging"})
    venv = tmp_path / "engine-venv"

    def install(chunk: Path) -> subprocess.CompletedProcess:
        return setup_offline(str(chunk), "--engine-venv", str(venv), "--reuse-torch", str(node_python))

    with_part = next(c for c in chunks[1:] if list(c.glob("*.part-*")))
    # a chunk other than the first, first: no pip to install with yet
    proc = install(with_part)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {venv} has no pip yet and these directories carry none: install chunk-1 first"
    )
    proc = install(chunks[0])
    assert proc.returncode == 0 and "still to come" in proc.stdout, proc.stdout + proc.stderr
    # a damaged copy of one part is refused, naming it, before anything of it is used
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in with_part.iterdir():
        damaged.joinpath(f.name).write_bytes(f.read_bytes())
    part = next(damaged.glob("*.part-*"))
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    proc = install(damaged)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {part}: sha256 differs from the build's record (damaged): copy it again"
    )
    for i, chunk in enumerate(chunks[1:], start=1):
        proc = install(chunk)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if i < len(chunks) - 1:
            assert "still to come" in proc.stdout and "ready" not in proc.stdout
    assert "joined bigdep-1.0-py3-none-any.whl from 3 parts (sha256 verified)" in proc.stdout
    assert "==> byte-compiled " in proc.stdout  # later imports read .pyc files, even under PYTHONDONTWRITEBYTECODE
    site = next((venv / "lib").glob("python*/site-packages"))
    assert (site / "toyengine" / "__pycache__").is_dir() and list(
        (site / "toyengine" / "__pycache__").glob("cli.*.pyc")
    )
    assert "imported 1 of 1 modules" in proc.stdout and f"==> ready: {venv}/bin/toyengine" in proc.stdout
    # nothing staged is left but the pip that installs (a joined wheel's bytes are not kept twice)
    assert [p.name for p in (venv / ee.STATE).glob("*.whl")] == [bundled("pip", tmp_path / "scratch-pip").name]
    assert not list((venv / ee.STATE).glob("*.part-*"))
    # the engine's console script runs on the venv's Python: its pin wins, the node's torch is found
    env = {k: v for k, v in offline_env().items() if k != "PYTHONPATH"}
    run = subprocess.run([str(venv / "bin" / "toyengine")], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"toyengine 0.65 torch {TORCH}"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert str(venv) not in where.stdout  # the node's torch, not a copy


def test_setup_refuses_an_engine_venv_without_the_nodes_python(tmp_path):
    proc = setup_offline(str(tmp_path), "--engine-venv", str(tmp_path / "v"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --engine-venv needs --reuse-torch PYTHON (the node's Python whose torch it uses)"
    )


# -- the engine's one-time preparation --------------------------------------------------------------


def _fake_venv(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    return root


def test_prepare_runs_in_the_engine_venv_and_a_failure_is_one_warning(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path / "venv")
    marker = tmp_path / "prepared"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shadow"))  # a checkout on PYTHONPATH must not reach it
    lines: list[str] = []
    code = (
        f"import os; open({str(marker)!r}, 'w').write(os.environ.get('PYTHONPATH', 'unset'))\nprint('cached 2 in 0 s')"
    )
    assert ee.prepare(venv, code, lines.append) is True
    assert marker.read_text() == "unset"
    assert lines == ["    cached 2 in 0 s"]
    lines.clear()
    assert ee.prepare(venv, "raise SystemExit('the registry moved')", lines.append) is False
    assert lines == [
        "    warning: the engine's one-time preparation failed (the registry moved); its first start does that work"
    ]


def test_vllms_preparation_names_the_architectures_nemoflow_serves():
    """The registry cache is written for every architecture the pipeline's export writes (the demo's Llama, the
    seed's Mixtral)."""
    from workloads.checkpoint import ARCHITECTURES

    # the install finds it from what the build's manifest records: the requirement, not the bare name
    assert ee.engine_spec("vllm==0.26.0") is ee.ENGINES["vllm"]
    prepare = ee.engine_spec("vllm==0.26.0").prepare
    compile(prepare, "VLLM_PREPARE", "exec")  # it is Python
    for arch in ARCHITECTURES.values():
        assert f'"{arch}"' in prepare
