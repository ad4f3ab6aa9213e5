"""The nemoflow CPU image: built here from Debian packages, run with podman (issue #13, item 1).

The slow tests build the image (cached: see deployments/image/build.py) and run it the
way a pod would: `nemoflow --help`, and the tokenize workload on a mounted directory
holding the KJV text and the Mixtral tokenizer, whose .bin/.idx must be byte-identical
to the same command run on the host.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.image import build as image_build
from deployments.image import podman
from nemoflow.cli import main as cli
from workloads.demo_data import kjv_chapters

REPO = Path(__file__).resolve().parents[2]


def run_in(image: str, *args: str, volumes: tuple[str, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = podman.run_args("--rm", "--network=none", *[a for v in volumes for a in ("--volume", v)], image, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


# --- fast: keys and flags, no podman -------------------------------------------------------


def test_cache_keys_follow_their_inputs(monkeypatch, tmp_path):
    """The base is keyed by the package list, the wheelhouse by constraints.txt (and the base)."""
    base = image_build.base_tag()
    assert base.startswith("localhost/nemoflow-base:bookworm-")
    monkeypatch.setattr(image_build, "base_packages", lambda: ["python3", "python3-venv", "curl"])
    assert image_build.base_tag() != base
    monkeypatch.undo()
    wheels = image_build.wheelhouse_dir(base)
    assert image_build.wheelhouse_dir(base) == wheels
    assert image_build.wheelhouse_dir(base + "x") != wheels
    fake_repo = tmp_path / "repo"
    fake_repo.mkdir()
    (fake_repo / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    (fake_repo / "constraints.txt").write_text((REPO / "constraints.txt").read_text() + "extra==1.0\n")
    monkeypatch.setattr(image_build, "REPO", fake_repo)
    assert image_build.wheelhouse_dir(base) != wheels


def test_podman_flags_stay_within_this_hosts_limits():
    import resource

    flags = dict(zip(podman.limit_args()[1::2], podman.limit_args()[::2]))
    assert set(flags.values()) == {"--ulimit"}
    nofile = next(f for f in flags if f.startswith("nofile="))
    nproc = next(f for f in flags if f.startswith("nproc="))
    hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert int(nofile.split(":")[1]) <= (hard_nofile if hard_nofile != resource.RLIM_INFINITY else 1048576)
    assert int(nproc.split(":")[1]) <= int(Path("/proc/sys/kernel/pid_max").read_text())


def test_staged_context_has_what_git_sees_and_no_environment(tmp_path):
    context = image_build.stage_context(tmp_path / "ctx")
    assert (context / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()
    assert (context / "deployments" / "image" / "Containerfile.cpu").exists()
    assert not (context / ".venv").exists() and not (context / ".git").exists()
    assert not list(context.rglob("__pycache__"))
    stale = context / "removed-upstream.txt"
    stale.write_text("x")
    image_build.stage_context(context)
    assert not stale.exists(), "a file gone from the repository leaves the context too"


def test_image_build_refuses_a_bad_tag_in_one_line(capsys):
    assert cli(["image", "build", "--tag", "Registry.Example.com/Team/NemoFlow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Registry.Example.com/Team/NemoFlow" in err[0]


# --- slow: the real image ------------------------------------------------------------------


@pytest.mark.slow
def test_nemoflow_help_runs_in_the_image(nemoflow_image):
    proc = run_in(nemoflow_image, "nemoflow", "--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("preprocess", "render", "image", "stage-image"):
        assert command in proc.stdout
    where = run_in(nemoflow_image, "python", "-c", "import workloads, os; print(os.path.dirname(workloads.__file__))")
    assert where.stdout.strip() == "/opt/nemoflow/workloads", "the repository at /opt/nemoflow is what runs"


@pytest.mark.slow
def test_every_package_in_the_image_is_pinned(nemoflow_image):
    """The image's Python environment is constraints.txt's: no package unpinned or at another version."""
    proc = run_in(nemoflow_image, "python", "-m", "pip", "list", "--format=json", "--exclude-editable")
    assert proc.returncode == 0, proc.stderr
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(proc.stdout)}
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split(";")[0].strip().partition("==")
        if sep:
            pins[name.lower().replace("_", "-")] = version
    for requirement in image_build.BUILD_REQUIREMENTS:
        name, _, version = requirement.partition("==")
        pins.setdefault(name, version)
    pins.setdefault("pip", installed.get("pip"))  # the base's own pip (Debian's python3-venv)
    wrong = {n: v for n, v in installed.items() if pins.get(n) != v.split("+")[0]}
    assert not wrong, f"not pinned in constraints.txt (or another version): {wrong}"


def _tokenize_inputs(root: Path) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    docs = root / "kjv.jsonl"
    with docs.open("w", encoding="utf-8") as fh:
        for chapter in kjv_chapters()[:400]:
            fh.write(json.dumps({"text": chapter}) + "\n")
    spec = importlib.util.find_spec("mistral_common")
    model = Path(list(spec.submodule_search_locations)[0]) / "data" / "tokenizer.model.v1"
    (root / "tokenizer.model").write_bytes(model.read_bytes())
    return docs, root / "tokenizer.model"


@pytest.mark.slow
def test_tokenize_in_the_container_matches_the_host_byte_for_byte(nemoflow_image, tmp_path):
    data = tmp_path / "data"
    _tokenize_inputs(data)
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--append-eod", "--workers", "2"]
    host = subprocess.run(
        [sys.executable, "-m", "nemoflow", "preprocess", "--input", str(data / "kjv.jsonl")]
        + ["--output-prefix", str(tmp_path / "host" / "kjv"), "--tokenizer-model", str(data / "tokenizer.model")]
        + flags,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert host.returncode == 0, host.stderr
    inside = run_in(
        nemoflow_image,
        "nemoflow",
        "preprocess",
        "--input",
        "/data/kjv.jsonl",
        "--output-prefix",
        "/data/container/kjv",
        "--tokenizer-model",
        "/data/tokenizer.model",
        *flags,
        volumes=(f"{data}:/data",),
    )
    assert inside.returncode == 0, inside.stderr
    summary = json.loads(inside.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 400 and summary["tokens"] > 100_000
    for suffix in (".bin", ".idx"):
        ours = (data / "container" / f"kjv_text_document{suffix}").read_bytes()
        theirs = (tmp_path / "host" / f"kjv_text_document{suffix}").read_bytes()
        assert ours == theirs, f"{suffix} differs between the container and the host"
