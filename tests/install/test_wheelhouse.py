"""The wheelhouse's plan: what is carried, what the node supplies, what is left out, how it is cut.

The walk runs for real (pip downloads from a local find-links directory of small wheels made
here, with no index), so the decisions are pip's files and our rules, not a stub's answers.
"""

from __future__ import annotations

import ensurepip
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from devtools import wheelhouse as wh
from tests.install.nodes import make_node

REPO = Path(__file__).resolve().parents[2]
BUNDLED = Path(ensurepip.__file__).parent / "_bundled"


def make_wheel(index: Path, name: str, version: str, requires=(), pad: int = 0) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = index / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
        z.writestr(f"{name.replace('-', '_')}/__init__.py", f"VERSION = {version!r}\n" + "#" * pad)
    return path


def bundled(name: str, scratch: Path) -> Path:
    """ensurepip's wheel of ``name``, or (Python 3.12+ bundles no setuptools) a wheel of the installed one."""
    found = sorted(BUNDLED.glob(f"{name}-*.whl"))
    if found:
        return found[-1]
    return wheel_of_installed(name, scratch)


def wheel_of_installed(name: str, out: Path) -> Path:
    """The installed distribution ``name`` packed back into a py3-none-any wheel (its files as installed, a
    fresh RECORD with their hashes): the real package, for an index that must offer it."""
    import base64
    import hashlib
    import importlib.metadata

    from tests.support.require import need

    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    need(dist, f"{name} installed in this venv", "pip install -c constraints.txt -e .[test]")
    version = dist.version
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for file in dist.files or []:
            parts = Path(file).parts
            if parts[0] == ".." or "__pycache__" in parts or parts[0].endswith(".dist-info"):
                continue  # scripts outside site-packages, bytecode, and the old metadata (rewritten below)
            data = Path(dist.locate_file(file)).read_bytes()
            z.writestr(str(file), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{file},sha256={digest},{len(data)}")
        for meta in ("METADATA", "entry_points.txt", "top_level.txt"):
            text = dist.read_text(meta)
            if text is not None:
                z.writestr(f"{info}/{meta}", text)
                record.append(f"{info}/{meta},,")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/WHEEL,,", f"{info}/RECORD,,", ""]))
    return path


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A toy project, its pins, a local index with its wheels, and pip pointed at nothing else."""
    index = tmp_path / "index"
    index.mkdir()
    pip_whl, st_whl = bundled("pip", tmp_path / "repacked"), bundled("setuptools", tmp_path / "repacked")
    shutil.copy(pip_whl, index)
    shutil.copy(st_whl, index)
    pip_v, st_v = pip_whl.name.split("-")[1], st_whl.name.split("-")[1]
    make_wheel(
        index,
        "app-core",
        "1.0",
        ["numpyish>=1.5", "torch>=2.0", "helper", "web[fast]", "six<1.0", "smallpkg>=1", "bigpkg"],
    )
    make_wheel(index, "smallpkg", "1.0")
    make_wheel(index, "bigpkg", "1.0", ["bigdep"], pad=8000)
    make_wheel(index, "web", "3.0", ["helper>=1.1", 'extra-dep==1.0; extra == "fast"', 'never; extra == "slow"'])
    make_wheel(index, "helper", "1.1")
    make_wheel(index, "heavy", "1.0", ["heavy-dep"], pad=3000)
    make_wheel(index, "heavy-dep", "1.0")
    make_wheel(index, "data-only", "1.0", ["audio", "numpyish<1.9"])
    make_wheel(index, "numpyish", "2.0", pad=3000)
    make_wheel(index, "extra-dep", "1.0")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "toy"\nversion = "0"\n'
        'dependencies = ["app-core==1.0", "heavy==1.0", "data-only==1.0", "torch==2.13.0"]\n'
    )
    (tmp_path / "constraints.txt").write_text(
        "app-core==1.0\nweb==3.0\nhelper==1.1\nheavy==1.0\nheavy-dep==1.0\ndata-only==1.0\nnumpyish==2.0\n"
        f"extra-dep==1.0\ntorch==2.13.0\nsix==0.9\nsmallpkg==1.0\nbigpkg==1.0\npip=={pip_v}\nsetuptools=={st_v}\n"
    )
    # The node: its torch, a numpyish that every requirement accepts, a helper too old for web, an
    # extra-dep of unknown version (web pins it exactly), six at a version that app-core accepts,
    # and two more of unknown version: a small one (ours is carried) and a big one (the node's is used).
    (tmp_path / "node-freeze.txt").write_text(
        "# pip list --format=freeze\ntorch==2.11.0+cu130\nnumpyish==2.5\nhelper==1.0\nextra-dep\nsix==0.9\n"
        "smallpkg\nbigpkg\n"
    )
    pip_offline(monkeypatch, index)
    return tmp_path


def pip_offline(monkeypatch, index: Path) -> None:
    """pip in this test finds packages in ``index`` only: no configured index, constraints or config file."""
    for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))


def build(toy: Path, *extra: str, out: str = "wh") -> dict:
    argv = [
        "build",
        "--out",
        str(toy / out),
        "--constraints",
        str(toy / "constraints.txt"),
        "--pyproject",
        str(toy / "pyproject.toml"),
        "--have",
        str(toy / "node-freeze.txt"),
        "--without",
        "heavy",
        "--files-only",
        "data-only",
        "--unknown-max-mb",
        "0.005",  # 5 kB: the toy's small wheels are under it, bigpkg is over
        *extra,
    ]
    assert wh.main(argv) == 0
    manifests = sorted((toy / out).glob(f"**/{wh.MANIFEST}"))
    assert manifests
    return json.loads(manifests[0].read_text())


def test_the_walk_carries_what_the_node_lacks_and_reuses_what_it_has(toy):
    m = build(toy)
    carried = {w["name"]: w["version"] for w in m["wheels"]}
    assert carried == {
        "pip": m["wheels"][[w["name"] for w in m["wheels"]].index("pip")]["version"],
        "setuptools": carried["setuptools"],
        "app-core": "1.0",
        "web": "3.0",
        "helper": "1.1",  # the node's 1.0 fails web's helper>=1.1
        "extra-dep": "1.0",  # web[fast] pins it exactly; the node's version is unknown
        "data-only": "1.0",  # carried, but its requirements (audio, numpyish<1.9) are not
        "smallpkg": "1.0",  # the node's version is unknown and ours is small: ours, not a bet
    }
    assert set(m["reused"]) == {
        "torch",
        "numpyish",
        "six",
        "bigpkg",
    }  # bigpkg's requirement bigdep: the node's business
    assert m["reused"]["bigpkg"]["node_version"] is None
    assert "over --unknown-max-mb" in m["reused"]["bigpkg"]["why"]
    assert m["carried_over_unknown"] == ["extra-dep", "smallpkg"]
    assert m["reused"]["numpyish"]["node_version"] == "2.5"
    assert m["reused"]["numpyish"]["requires"] == ["app-core: numpyish>=1.5"]
    assert m["torch"] == {"source": "node", "required": ["app-core: torch>=2.0"]}
    assert m["left_out"] == ["heavy"]
    assert m["files_only"] == ["data-only"]
    assert "left out heavy (--without) although nemoflow requires it" in m["warnings"]
    assert all(not (toy / "wh" / n).exists() for n in ("heavy-1.0-py3-none-any.whl", "never"))


def test_prefer_ours_carries_our_pin_of_a_package_the_node_has_at_another_version(toy):
    m = build(toy, "--prefer", "ours")
    carried = {w["name"]: w["version"] for w in m["wheels"]}
    assert carried["numpyish"] == "2.0"
    assert "six" in m["reused"]  # the node's six is our pinned version: nothing to shadow


def test_a_cross_build_targets_the_nodes_python_and_platform(toy):
    m = build(toy, "--python-version", "3.12", "--glibc", "2.28")
    assert m["target"]["python"] == "3.12"
    assert m["target"]["platforms"][0] == "manylinux_2_28_x86_64"
    assert "manylinux2014_x86_64" in m["target"]["platforms"]
    assert "manylinux_2_29_x86_64" not in m["target"]["platforms"]
    assert m["target"]["markers"]["python_version"] == "3.12"


def tools_mb(toy: Path) -> float:
    """A chunk size that holds pip and setuptools and little else: the toy's wheels need a second chunk."""
    return (sum(p.stat().st_size for p in (toy / "index").glob("[ps][ie]*-*.whl")) + 1024) / wh.MIB


def test_split_chunks_respect_the_limit_and_put_pip_first(toy):
    limit_mb = tools_mb(toy)
    m = build(toy, "--split-mb", str(limit_mb))
    assert len(m["chunks"]) >= 2
    chunk_files = {}
    for c in m["chunks"]:
        d = toy / "wh" / c["dir"]
        files = sorted(p.name for p in d.glob("*.whl"))
        chunk_files[c["dir"]] = files
        assert sum((d / f).stat().st_size for f in files) <= limit_mb * wh.MIB
        assert json.loads((d / wh.MANIFEST).read_text()) == m  # every chunk carries the whole plan
    assert any(f.startswith("pip-") for f in chunk_files["chunk-1"])
    assert any(f.startswith("setuptools-") for f in chunk_files["chunk-1"])
    assert sorted(f for fs in chunk_files.values() for f in fs) == sorted(w["file"] for w in m["wheels"])


def test_split_chunks_pure():
    sizes = {"a": 50, "b": 30, "c": 30, "pip": 5, "d": 10}
    chunks = wh.split_chunks(sizes, 60, ["pip"])
    assert "pip" in chunks[0]
    assert sorted(f for c in chunks for f in c) == sorted(sizes)
    assert all(sum(sizes[f] for f in c) <= 60 for c in chunks)
    assert len(chunks) == 3  # 125 bytes cannot fit in two chunks of 60
    with pytest.raises(wh.WheelhouseError, match=r"larger than one chunk: a \(0 MiB\)"):
        wh.split_chunks(sizes, 40, ["pip"])


def test_reading_a_nodes_freeze_list():
    have = wh.read_have(
        "# comment\nTorch==2.11.0+cu130\nhuggingface_hub==1.33.0\npandas\n"
        "mypkg @ file:///tmp/mypkg-1.0-py3-none-any.whl\n-e git+https://x/y#egg=z\n"
    )
    assert have == {"torch": "2.11.0+cu130", "huggingface-hub": "1.33.0", "pandas": None, "mypkg": None}
    with pytest.raises(wh.WheelhouseError, match="cannot read the line 'torch>=2'"):
        wh.read_have("torch>=2\n")


def test_reuse_rules():
    R = wh.Requirement
    assert wh.reuse_decision("2.5.2", [(R("numpy>=1.17"), "transformers")])[0]
    ok, why = wh.reuse_decision("2.5.2", [(R("numpy<2.4,>=1.25"), "mistral-common")])
    assert not ok and why == "mistral-common requires numpy<2.4,>=1.25; the node has 2.5.2"
    assert wh.reuse_decision(None, [(R("pandas>=2"), "datasets")])[0]
    ok, why = wh.reuse_decision(None, [(R("transformers==5.18.0"), "nemo-automodel")])
    assert not ok and "pins transformers==5.18.0" in why
    assert wh.reuse_decision("2.11.0+cu130", [(R("torch>=2.6"), "torchao")])[0]


def test_requirements_for_the_nodes_python_and_extras():
    meta = (
        "Name: x\nVersion: 1\nRequires-Dist: a\nRequires-Dist: b; python_version < '3.11'\n"
        "Requires-Dist: c; extra == 'fast'\nRequires-Dist: d; sys_platform == 'win32'\n"
    )
    env = wh.target_environment("3.12", ["manylinux_2_28_x86_64"])
    assert [r.name for r in wh.requirements_of(meta, set(), env)] == ["a"]
    assert [r.name for r in wh.requirements_of(meta, {"fast"}, env)] == ["a", "c"]
    env310 = wh.target_environment("3.10", ["manylinux_2_28_x86_64"])
    assert [r.name for r in wh.requirements_of(meta, set(), env310)] == ["a", "b"]


# -- installing the toy wheelhouse on a "node" with no network, one chunk per call -----------------


def offline_env() -> dict:
    """pip with nothing to reach: no index, no config, proxies that refuse every connection."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    dead = "http://127.0.0.1:9"
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_PROXY=dead, http_proxy=dead, https_proxy=dead)
    return env


def setup_offline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts/setup.sh"), "--offline", *args],
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=300,
    )


@pytest.mark.slow
def test_chunks_install_one_call_at_a_time_and_the_node_is_checked_before_nemoflow(toy, tmp_path):
    """The build assumed the node has numpyish 2.5 and six 0.9 (its freeze list said so); this node
    has neither numpyish nor that six. The install carries on chunk by chunk, then stops with one
    line per wrong assumption before it installs nemoflow."""
    m = build(toy, "--split-mb", str(tools_mb(toy)))
    node_python = make_node(tmp_path / "node", {"torch", "six"})
    venv = tmp_path / "venv"
    chunks = [c["dir"] for c in m["chunks"]]
    for i, chunk in enumerate(chunks):
        proc = setup_offline(str(toy / "wh" / chunk), "--venv", str(venv), "--reuse-torch", str(node_python))
        if i < len(chunks) - 1:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "still missing" in proc.stdout
            # what the node really has is known from the first call on: said before the next chunk travels
            assert "warning: numpyish is neither in the wheelhouse nor on the node" in proc.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr
    import six

    assert (
        "error: numpyish is neither in the wheelhouse nor on the node (the build assumed the node has it)"
        in proc.stdout
    )
    assert f"error: app-core requires six<1.0, the node has six {six.__version__}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == (
        "error: the wheelhouse was built for other versions than this node's: "
        f"rebuild it with --have {venv}/node-freeze.txt (the node's packages, written by this install)"
    )
    assert f"six=={six.__version__}" in (venv / "node-freeze.txt").read_text().splitlines()
    assert "installing nemoflow" not in proc.stdout
    # the carried wheels are in the venv itself; torch comes from the node through the .pth
    probe = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import app_core, helper, torch; print(app_core.__file__); print(torch.__file__)",
        ],
        capture_output=True,
        text=True,
        env=offline_env(),
        cwd=tmp_path,
    )
    app_core_file, torch_file = probe.stdout.split()
    assert app_core_file.startswith(str(venv))
    assert torch_file.startswith(str(tmp_path / "node"))


def test_an_offline_install_needs_a_torch_to_reuse(toy, tmp_path):
    m = build(toy)
    assert m["torch"]["source"] == "node"
    proc = setup_offline(str(toy / "wh"), "--venv", str(tmp_path / "venv"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: this wheelhouse carries no torch (it uses the node's): pass --reuse-torch PYTHON, "
        "a Python whose torch the venv should use"
    )


def test_a_wheelhouse_for_another_python_is_refused_with_the_fix(toy, tmp_path):
    build(toy, "--python-version", "3.9")
    proc = setup_offline(str(toy / "wh"), "--venv", str(tmp_path / "venv"), "--reuse-torch", sys.executable)
    assert proc.returncode == 1
    v = "{}.{}".format(*sys.version_info[:2])
    assert proc.stderr.strip() == (
        f"error: --reuse-torch {sys.executable} is Python {v}; the wheelhouse is for 3.9: rebuild it with --python-version {v}"
    )


def test_without_a_bundled_setuptools_the_installed_one_is_packed_and_installs(tmp_path, monkeypatch):
    """Python 3.12's ensurepip has no setuptools wheel (the H200 node's Python): the toy index gets the
    installed setuptools packed as a wheel, and pip installs it into a fresh venv where it imports."""
    monkeypatch.setattr(sys.modules[__name__], "BUNDLED", tmp_path / "no-bundled-wheels")
    wheel = bundled("setuptools", tmp_path / "repacked")
    import importlib.metadata

    assert wheel.name == f"setuptools-{importlib.metadata.version('setuptools')}-py3-none-any.whl"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr
    probe = "import setuptools, setuptools.build_meta; print(setuptools.__version__)"
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    assert ran.stdout.strip() == importlib.metadata.version("setuptools"), ran.stderr


def test_the_carried_setuptools_can_build_nemoflow():
    """The node builds nemoflow with the wheelhouse's setuptools (no build isolation, no index):
    it must satisfy pyproject.toml's build-system, whatever Python built the wheelhouse."""
    import tomllib

    requires = [
        wh.Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    ]
    for req in requires:
        assert req.name in wh.BUILD_TOOLS, f"{req.name} is not carried"
        assert req.specifier.contains(wh.BUILD_TOOLS[req.name]), (req, wh.BUILD_TOOLS[req.name])
