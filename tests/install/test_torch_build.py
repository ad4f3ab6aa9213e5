"""Which torch build setup.sh installs, from what the NVIDIA driver says, and the one-line mismatch message."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import torch_build as tb

HERE = Path(__file__).parent
CAPTURED = HERE / "captured"
REPO = HERE.parents[1]


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


def smi_node(name: str) -> tb.Node:
    driver, cuda = tb.parse_smi(captured(f"{name}.txt"))
    return tb.Node(tb.parse_smi_list(captured(f"{name}-L.txt")), driver, cuda)


H200 = "h200-580"
A100 = "a100-535"


def test_nvidia_smi_header_gives_driver_and_cuda():
    assert tb.parse_smi(captured("h200-580.txt")) == ("580.159.03", (13, 0))
    assert tb.parse_smi(captured("a100-535.txt")) == ("535.104.05", (12, 2))
    assert tb.parse_smi(captured("no-driver.txt")) == (None, None)


def test_nvidia_smi_list_names_gpus_and_skips_mig_lines():
    assert tb.parse_smi_list(captured("h200-580-L.txt")) == ["NVIDIA H200"]
    assert tb.parse_smi_list(captured("a100-535-L.txt")) == ["NVIDIA A100-SXM4-80GB"] * 2


def test_driver_version_maps_to_the_newest_cuda_it_supports():
    assert tb.cuda_for_driver("580.159.03") == (13, 0)
    assert tb.cuda_for_driver("570.86.10") == (12, 8)
    assert tb.cuda_for_driver("535.104.05") == (12, 2)
    assert tb.cuda_for_driver("470.239.06") == (11, 0)
    assert tb.cuda_for_driver("440.33.01") is None


class Ran:
    """What subprocess.run returns, replaying captured nvidia-smi output."""

    def __init__(self, outputs: dict[tuple[str, ...], tuple[int, str]]):
        self.outputs = outputs

    def __call__(self, argv, **kw):
        rc, out = self.outputs[tuple(argv[1:])]
        return subprocess.CompletedProcess(argv, rc, out, "")


def test_probe_reads_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setattr(tb.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    run = Ran({(): (0, captured("h200-580.txt")), ("-L",): (0, captured("h200-580-L.txt"))})
    node = tb.probe(run=run, proc_root=str(tmp_path))
    assert node == tb.Node(["NVIDIA H200"], "580.159.03", (13, 0), "nvidia-smi")


def test_probe_without_a_working_driver_finds_no_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(tb.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    run = Ran({(): (9, captured("no-driver.txt")), ("-L",): (9, captured("no-driver.txt"))})
    assert tb.probe(run=run, proc_root=str(tmp_path)) is None


def test_probe_falls_back_to_proc_driver_nvidia(monkeypatch, tmp_path):
    """No nvidia-smi (a minimal container): the kernel module's version and /proc's GPU list."""
    monkeypatch.setattr(tb.shutil, "which", lambda name: None)
    (tmp_path / "driver/nvidia/gpus/0000:00:1e.0").mkdir(parents=True)
    (tmp_path / "driver/nvidia/version").write_text(captured("proc-version-470.txt"))
    (tmp_path / "driver/nvidia/gpus/0000:00:1e.0/information").write_text(captured("proc-gpu-information.txt"))
    node = tb.probe(proc_root=str(tmp_path))
    assert node == tb.Node(["Tesla V100-SXM2-32GB"], "470.239.06", (11, 0), "/proc/driver/nvidia")


def test_auto_takes_the_cpu_build_without_a_gpu():
    choice = tb.choose("auto", None)
    assert choice.variant == "cpu"
    assert "no NVIDIA GPU found" in choice.reason


def test_auto_on_an_h200_with_driver_580_takes_pypis_cuda_13_build():
    choice = tb.choose("auto", smi_node(H200))
    assert choice.variant == "cu130"
    assert choice.reason == (
        "found 1 NVIDIA GPU (NVIDIA H200), driver 580.159.03, CUDA 13.0 (via nvidia-smi): the newest build for CUDA <= 13.0"
    )
    assert tb.torch_requirement("cu130", "2.13.0") == "torch===2.13.0"
    assert tb.torch_index("cu130") is None


def test_auto_on_driver_535_takes_cuda_12_6_by_minor_version_compatibility():
    choice = tb.choose("auto", smi_node(A100))
    assert choice.variant == "cu126"
    assert "2 NVIDIA GPUs (NVIDIA A100-SXM4-80GB), driver 535.104.05, CUDA 12.2" in choice.reason
    assert "minor-version compatibility" in choice.reason
    assert tb.torch_requirement("cu126", "2.13.0") == "torch===2.13.0+cu126"
    assert tb.torch_index("cu126") == "https://download.pytorch.org/whl/cu126"


def test_auto_picks_the_newest_build_the_driver_supports():
    assert tb.choose("auto", tb.Node(["GPU"], "570.86.10", (12, 8))).variant == "cu128"
    assert tb.choose("auto", tb.Node(["GPU"], "575.51.03", (12, 9))).variant == "cu128"
    assert tb.choose("auto", tb.Node(["GPU"], "560.35.05", (12, 6))).variant == "cu126"


def test_a_driver_too_old_for_any_cuda_build_says_what_to_do():
    with pytest.raises(tb.DriverTooOld) as e:
        tb.choose("auto", tb.Node(["Tesla V100-SXM2-32GB"], "470.239.06", (11, 4)))
    assert str(e.value) == (
        "this node's NVIDIA driver 470.239.06 supports CUDA 11.4; the oldest CUDA build of torch (cu126) needs "
        "driver >= 525.60.13: upgrade the driver, or install the CPU build (scripts/setup.sh --torch cpu)"
    )


def test_asked_for_builds():
    assert tb.choose("cpu", smi_node(H200)) == tb.Choice("cpu", "asked for (--torch cpu)")
    assert tb.choose("cu126", None).variant == "cu126"
    assert tb.choose("cuda", None).variant == "cu130"
    assert tb.choose("cuda", smi_node(A100)).variant == "cu126"
    assert tb.torch_requirement("cpu", "2.13.0") == "torch===2.13.0+cpu"
    assert tb.torch_index("cpu") == "https://download.pytorch.org/whl/cpu"
    with pytest.raises(ValueError, match="--torch 'gpu'"):
        tb.choose("gpu", None)


def test_a_torch_index_mirror_replaces_download_pytorch_org(monkeypatch):
    monkeypatch.setenv("NEMOFLOW_TORCH_INDEX", "https://mirror.example/pytorch/")
    assert tb.torch_index("cu128") == "https://mirror.example/pytorch/cu128"


def test_mismatch_cuda_13_build_on_driver_535_names_the_build_to_install():
    line = tb.mismatch("2.13.0+cu130", "13.0", False, smi_node(A100))
    assert line == (
        "torch 2.13.0+cu130 is built for CUDA 13.0, which needs NVIDIA driver >= 580.65.06; this node's driver "
        "535.104.05 supports CUDA 12.2: install the cu126 build with `scripts/setup.sh --torch cu126`"
    )


def test_mismatch_on_a_driver_too_old_for_every_build():
    line = tb.mismatch("2.13.0+cu126", "12.6", False, tb.Node(["V100"], "470.239.06", (11, 4)))
    assert line == (
        "torch 2.13.0+cu126 is built for CUDA 12.6, which needs NVIDIA driver >= 525.60.13; this node's driver "
        "470.239.06 supports CUDA 11.4: upgrade the driver to >= 525.60.13, or install the cpu build with "
        "`scripts/setup.sh --torch cpu`"
    )


def test_mismatch_cpu_build_on_a_gpu_node():
    line = tb.mismatch("2.13.0+cpu", None, False, smi_node(H200))
    assert line.startswith("torch 2.13.0+cpu is the CPU build but this machine has 1 NVIDIA GPU (NVIDIA H200)")
    assert line.endswith("install the cuda build with `scripts/setup.sh --torch cuda`")


def test_mismatch_right_build_but_no_gpu_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    line = tb.mismatch("2.13.0", "13.0", False, smi_node(H200))
    assert "sees no GPU although this machine has 1 NVIDIA GPU" in line
    assert "CUDA_VISIBLE_DEVICES ('')" in line


def test_no_mismatch_when_torch_sees_the_gpu_or_there_is_none():
    assert tb.mismatch("2.13.0", "13.0", True, smi_node(H200)) is None
    assert tb.mismatch("2.13.0+cpu", None, False, None) is None


def test_the_offline_install_names_its_own_fix():
    fix = "point --reuse-torch at a Python whose torch is the {variant} build"
    line = tb.mismatch("2.11.0+cu130", "13.0", False, smi_node(A100), fix)
    assert line.endswith(": point --reuse-torch at a Python whose torch is the cu126 build")


# -- the same logic through the scripts, with captured nvidia-smi output on PATH ----------------


def fake_nvidia_smi(bin_dir: Path, name: str) -> None:
    """An ``nvidia-smi`` that prints a captured output (this machine has no GPU)."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -L ]; then cat {CAPTURED / (name + "-L.txt")}; else cat {CAPTURED / (name + ".txt")}; fi\n'
    )
    script.chmod(0o755)


def run_setup(args, path_prefix: Path | None = None, **env):
    e = {k: v for k, v in os.environ.items() if k != "NEMOFLOW_TORCH"}
    e.update(env)
    if path_prefix:
        e["PATH"] = f"{path_prefix}{os.pathsep}{e['PATH']}"
    return subprocess.run(
        ["bash", str(REPO / "scripts/setup.sh"), *args], capture_output=True, text=True, env=e, timeout=120
    )


def test_setup_dry_run_on_an_h200_chooses_the_cuda_13_build(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", H200)
    # --torch auto: a .venv here (CI's) keeps its build without it
    proc = run_setup(["--dry-run", "--torch", "auto"], tmp_path / "bin")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "==> torch 2.13.0, cu130 build: found 1 NVIDIA GPU (NVIDIA H200), driver 580.159.03, CUDA 13.0 "
        "(via nvidia-smi): the newest build for CUDA <= 13.0",
        "would run: pip install --no-deps --no-index torch===2.13.0 (a wheel already on disk), "
        "else pip install --no-deps torch===2.13.0",
    ]


def test_setup_dry_run_on_driver_535_chooses_cu126_and_a_cpu_request_wins(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", A100)
    proc = run_setup(["--dry-run", "--torch", "auto"], tmp_path / "bin")
    assert "==> torch 2.13.0, cu126 build: found 2 NVIDIA GPUs" in proc.stdout
    assert "--index-url https://download.pytorch.org/whl/cu126 torch===2.13.0+cu126" in proc.stdout
    proc = run_setup(["--dry-run"], tmp_path / "bin", NEMOFLOW_TORCH="cpu")
    assert "==> torch 2.13.0, cpu build: asked for (--torch cpu)" in proc.stdout


@pytest.mark.skipif(
    os.path.exists("/proc/driver/nvidia") or bool(shutil.which("nvidia-smi")), reason="this machine has a GPU"
)
def test_setup_dry_run_without_a_gpu_keeps_the_cpu_build():
    proc = run_setup(["--dry-run", "--torch", "auto"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        "==> torch 2.13.0, cpu build: no NVIDIA GPU found (no nvidia-smi, no /proc/driver/nvidia)"
    )
    assert "torch===2.13.0+cpu" in proc.stdout


def test_an_existing_venv_keeps_its_build_unless_torch_is_given(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / ".venv").mkdir(parents=True)
    shutil.copytree(REPO / "scripts", checkout / "scripts")
    shutil.copytree(REPO / "devtools", checkout / "devtools")
    shutil.copy(REPO / "constraints.txt", checkout)
    (checkout / ".venv/.nemoflow-torch").write_text("cu126\n")
    fake_nvidia_smi(tmp_path / "bin", H200)
    e = {k: v for k, v in os.environ.items() if k != "NEMOFLOW_TORCH"}
    e["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{e['PATH']}"

    def first_line(*args):
        proc = subprocess.run(
            ["bash", str(checkout / "scripts/setup.sh"), "--dry-run", *args], capture_output=True, text=True, env=e
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()[0]

    assert first_line() == "==> torch 2.13.0, cu126 build: kept from the last install (--torch auto chooses again)"
    assert first_line("--torch", "auto").startswith("==> torch 2.13.0, cu130 build: found 1 NVIDIA GPU (NVIDIA H200)")


def test_setup_refuses_an_unknown_build_and_argument(tmp_path):
    proc = run_setup(["--dry-run", "--torch", "gpu"])
    assert proc.returncode == 2
    assert "error: --torch 'gpu': expected auto, cpu, cuda or a CUDA tag such as cu126" in proc.stderr
    proc = run_setup(["--bogus"])
    assert proc.returncode == 2
    assert "unknown argument '--bogus'" in proc.stderr


def test_check_with_this_environments_cpu_torch_on_a_gpu_node_prints_one_line(tmp_path):
    """The real check, with this environment's real (CPU) torch, on a machine whose nvidia-smi lists an H200."""
    fake_nvidia_smi(tmp_path / "bin", H200)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "devtools/torch_build.py"), "check"], capture_output=True, text=True, env=env
    )
    import torch

    if torch.version.cuda:
        pytest.skip("this environment's torch is a CUDA build")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: torch {torch.__version__} is the CPU build but this machine has 1 NVIDIA GPU (NVIDIA H200), "
        "driver 580.159.03, CUDA 13.0 (via nvidia-smi): install the cuda build with `scripts/setup.sh --torch cuda`"
    ]
