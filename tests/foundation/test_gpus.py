"""GPUs asked for but not there: one line naming the problem and the fix, before anything starts.

The messages are checked on captured views of real machines (an H200 node's nvidia-smi, a CPU build of
torch, a CUDA build newer than the driver); this machine's own probe and the local backend's refusal run
for real (this machine has no NVIDIA GPU).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time

import pytest

from infra import gpus
from infra.backends.local import LocalBackend
from infra.jobs import JobSpec, Resources, ServiceSpec

H200 = gpus.LocalGpus(
    names=("NVIDIA H200",),
    driver_version="580.159.03",
    driver_cuda="13.0",
    torch_version="2.11.0+cu130",
    torch_cuda="13.0",
    torch_count=1,
)


def test_parsers_read_nvidia_smi_as_printed():
    # nvidia-smi on the H200 node (driver 580.159.03), its query and its table header
    names, driver = gpus.parse_query("NVIDIA H200, 580.159.03\n")
    assert names == ["NVIDIA H200"] and driver == "580.159.03"
    header = "| NVIDIA-SMI 580.159.03             Driver Version: 580.159.03     CUDA Version: 13.0     |"
    assert gpus.parse_cuda_version(header) == "13.0"


def test_a_request_the_machine_can_serve_passes():
    gpus.check_request(1, H200)
    gpus.check_request(0, gpus.LocalGpus((), None, None, None, None, 0))  # CPU jobs need nothing


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        (
            gpus.LocalGpus((), None, None, None, None, 0),
            "train asks for 1 GPU but this machine has no NVIDIA GPU (nvidia-smi lists none): set gpus_per_node: 0",
        ),
        (
            gpus.LocalGpus(("NVIDIA H200",), "580.159.03", "13.0", "2.13.0+cpu", None, 0),
            "train asks for 1 GPU but torch 2.13.0+cpu is a CPU build and cannot use this machine's GPUs "
            "(1 x NVIDIA H200, driver 580.159.03): install the CUDA build with scripts/setup.sh --torch cuda",
        ),
        (
            gpus.LocalGpus(("NVIDIA A100-SXM4-80GB",) * 8, "535.104.05", "12.2", "2.13.0+cu130", "13.0", 0),
            "train asks for 1 GPU but torch 2.13.0+cu130 is built for CUDA 13.0 and this machine's driver "
            "535.104.05 supports CUDA up to 12.2 (8 x NVIDIA A100-SXM4-80GB, driver 535.104.05): install a torch "
            "built for CUDA 12.2 or older",
        ),
        (
            gpus.LocalGpus(("NVIDIA H200",), "580.159.03", "13.0", "2.11.0+cu130", "13.0", 0, visible=""),
            "train asks for 1 GPU but CUDA_VISIBLE_DEVICES='' hides this machine's GPUs",
        ),
    ],
)
def test_each_kind_of_missing_gpu_is_named_with_its_fix(machine, expected):
    with pytest.raises(gpus.GpuRequestError) as caught:
        gpus.check_request(1, machine, what="train")
    assert str(caught.value).startswith(expected), str(caught.value)
    assert "\n" not in str(caught.value)


def test_more_gpus_than_the_machine_has():
    with pytest.raises(
        gpus.GpuRequestError, match=r"asks for 8 GPUs but this machine has 1 usable .*set gpus_per_node to 1"
    ):
        gpus.check_request(8, H200, what="train")


def test_the_local_backend_refuses_before_starting_anything(tmp_path):
    """On this GPU-less machine, for real: no process is started for a job or a service that wants a GPU."""
    gpus.probe.cache_clear()
    here = gpus.probe()
    assert here.names == ()  # the development and CI machines have no NVIDIA GPU
    marker = tmp_path / "started"
    job = JobSpec(name="train-x", command=["sh", "-c", f"touch {marker}"], resources=Resources(gpus_per_node=1))
    with pytest.raises(gpus.GpuRequestError, match="train-x asks for 1 GPU but this machine has no NVIDIA GPU"):
        LocalBackend().run(job)
    service = ServiceSpec(
        name="serve-x", command=["sh", "-c", f"touch {marker}"], port=1, resources=Resources(gpus_per_node=1)
    )
    with pytest.raises(gpus.GpuRequestError, match="serve-x asks for 1 GPU"):
        LocalBackend().start_service(service)
    assert not marker.exists()


def _machine_with_a_slow_torch(tmp_path, monkeypatch):
    """An H200's nvidia-smi (its captured output) on PATH, and a Python whose torch takes 2 s to answer, each
    start of it counted (the probe's subprocess, as slow as torch's import and CUDA's start on a node)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu*) echo "NVIDIA H200, 580.159.03";; *) echo "| NVIDIA-SMI 580.159.03'
        '             Driver Version: 580.159.03     CUDA Version: 13.0     |";; esac\n'
    )
    starts = tmp_path / "starts"
    python = bin_dir / "python"
    python.write_text(
        f"#!/bin/sh\necho start >> {starts}\nsleep 2\n"
        """echo '{"version": "2.11.0+cu130", "cuda": "13.0", "count": 1, "error": null}'\n"""
    )
    for exe in (smi, python):
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    gpus.probe.cache_clear()
    return str(python), starts


def test_a_prefetched_probe_is_waited_for_not_run_again(tmp_path, monkeypatch):
    """The probe started in the background (the local backend does, when it is made) is what the first GPU job's
    check gets: once its torch has answered at once; while it is still running, the check waits for it (one
    torch subprocess in all, not two)."""
    python, starts = _machine_with_a_slow_torch(tmp_path, monkeypatch)
    try:
        gpus.prefetch(python)
        gpus.prefetch(python)  # once per process
        time.sleep(0.3)
        t0 = time.monotonic()
        found = gpus.probe(python)  # in flight: waited for
        waited = time.monotonic() - t0
        assert found == dataclasses.replace(H200, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        assert 0.5 < waited < 2.5  # what was left of the 2 s, not another 2 s
        assert starts.read_text().splitlines() == ["start"]
        gpus.prefetch(python)
        t0 = time.monotonic()
        assert gpus.probe(python) is found and time.monotonic() - t0 < 0.5  # cached
        assert starts.read_text().splitlines() == ["start"]
    finally:
        gpus.probe.cache_clear()


def test_without_nvidia_smi_nothing_is_prefetched(tmp_path, monkeypatch):
    python, starts = _machine_with_a_slow_torch(tmp_path, monkeypatch)
    (tmp_path / "bin" / "nvidia-smi").unlink()
    (tmp_path / "bin" / "sleep").symlink_to(shutil.which("sleep"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # a machine without the driver's tools
    gpus.prefetch(python)
    time.sleep(0.5)
    assert not starts.exists() and not [t for t in threading.enumerate() if t.name == "gpu-probe"]
    gpus.probe.cache_clear()


def test_the_local_backend_prefetches_when_it_is_made(monkeypatch):
    made = []
    monkeypatch.setattr(gpus, "prefetch", lambda *a: made.append(a))
    LocalBackend()
    assert made == [()]
