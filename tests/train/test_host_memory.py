"""The host-memory check before a run with asynchronous checkpoints (issue 34, item 6): MemAvailable, the cgroup
limit (v2, or v1's memory controller, this process's own cgroup first) and /dev/shm's free space.

The trees below are laid out as the kernel shows them (the v1 values are this CI machine's own formats: an
unlimited v1 limit reads 9223372036854771712); the real machine's own answer is checked too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from workloads.train.launch import host_memory_available

GIB = 1 << 30


def _tree(root: Path, meminfo_gib: int, cgroup: dict[str, str], self_cgroup: str) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_gib * 1024 * 1024} kB\n")
    (root / "proc/self/cgroup").write_text(self_cgroup)
    for name, value in cgroup.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def test_cgroup_v1_limit_of_this_process_counts(tmp_path):
    root = _tree(
        tmp_path,
        64,
        {
            "memory/memory.limit_in_bytes": "9223372036854771712",  # the mount's root: unlimited
            "memory/memory.usage_in_bytes": str(5 * GIB),
            "memory/slurm/job_7/memory.limit_in_bytes": str(16 * GIB),
            "memory/slurm/job_7/memory.usage_in_bytes": str(6 * GIB),
        },
        "12:memory:/slurm/job_7\n11:pids:/\n",
    )
    assert host_memory_available(root) == 10 * GIB  # the job's cgroup: 16 GiB limit, 6 GiB used


def test_cgroup_v2_limit_and_an_unlimited_v1_root(tmp_path):
    v2 = _tree(tmp_path / "v2", 64, {"memory.max": str(8 * GIB), "memory.current": str(3 * GIB)}, "0::/\n")
    assert host_memory_available(v2) == 5 * GIB
    unlimited = _tree(
        tmp_path / "v1",
        12,
        {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": str(GIB)},
        "12:memory:/\n",
    )
    assert host_memory_available(unlimited) == 12 * GIB  # no limit: MemAvailable decides


def test_dev_shm_free_space_counts(tmp_path, monkeypatch):
    root = _tree(tmp_path, 1 << 20, {}, "0::/\n")  # 1 PiB available: /dev/shm decides
    shm = root / "dev/shm"
    shm.mkdir(parents=True)
    # its free space as the file system says it, fixed: the tree lies on a disk that other tests write to at the
    # same time (CI at f03fd77 saw it move by 4 KiB between two reads)
    real = shutil.disk_usage
    fixed = real(shm)._replace(free=7 << 30)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: fixed if Path(path) == shm else real(path))
    assert host_memory_available(root) == 7 << 30


def test_this_machine(tmp_path):
    """On the machine itself: never more than MemAvailable or /dev/shm's free space."""
    room = host_memory_available()
    available = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    assert 0 < room <= available * 1.05  # MemAvailable moves between the two reads
    assert room <= shutil.disk_usage("/dev/shm").free
