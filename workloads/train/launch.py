"""Before training: the processes launched, the host memory for asynchronous saves, the data's splits, the
inputs staged to this node and the run directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from infra import storage
from infra.configs.train import TrainConfig, estimate_parameters, resolve_strategy
from workloads import checkpoint as ckpt
from workloads import staging
from workloads.data_loader import check_splits
from workloads.train.errors import LaunchError


def launch_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain ``python -m``."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def check_launch(config: TrainConfig, world_size: int, cuda: bool, device_count: int) -> None:
    """The processes torchrun started must be the ones the configuration describes."""
    wanted = config.world_size
    if world_size != wanted:
        how = (
            f"num_nodes={config.num_nodes} x {config.procs_per_node} per node "
            f"({'gpus_per_node' if config.gpus_per_node and not config.nproc_per_node else 'nproc_per_node'})"
        )
        raise LaunchError(
            f"the configuration asks for {wanted} training processes ({how}) but {world_size} were started; "
            f"launch with python -m torch.distributed.run --nnodes {config.num_nodes} "
            f"--nproc-per-node {config.procs_per_node} -m workloads.train --config ..."
        )
    if config.gpus_per_node and not cuda:
        raise LaunchError(f"gpus_per_node={config.gpus_per_node} but this node has no CUDA device")
    if cuda and config.gpus_per_node and device_count < config.procs_per_node:
        raise LaunchError(
            f"{config.procs_per_node} processes per node need as many GPUs; this node has {device_count} "
            "(CUDA_VISIBLE_DEVICES?)"
        )


def check_data_splits(config: TrainConfig) -> None:
    """Before AutoModel builds the datasets: every split it builds (train; validation when
    limit_val_batches > 0) has documents of every prefix, or its index builder never returns."""
    splits = ("train", "validation") if config.limit_val_batches > 0 else ("train",)
    check_splits(config.data_prefix, config.split, splits, config.valid_data_prefix)


def async_save_fits(config: TrainConfig, vocab_size: int, world_size: int, cuda: bool) -> tuple[bool, str | None]:
    """Whether this node has the host memory to stage asynchronous saves; (False, the warning line) if not.

    Staging holds a copy of each local rank's model and optimizer state in pinned, shared host memory for
    the whole run (bf16-mixed / fp32: fp32 weights and two fp32 AdamW moments, 12 bytes a parameter; bf16:
    6), divided over the ranks when FSDP2 shards it. The torch.distributed.checkpoint writer process reads it
    from shared memory (/dev/shm), which containers often keep small. Without the room, saves are synchronous
    (training waits for each write) instead of an out-of-memory kill.
    """
    if not config.ckpt_async_save:
        return False, None
    per_rank = state_bytes_per_rank(config, vocab_size, world_size, cuda)
    if per_rank < config.ckpt_async_min_mib * 2**20:
        return False, (
            f"checkpoints are saved synchronously: {per_rank / 2**20:.0f} MiB a rank is under ckpt_async_min_mib="
            f"{config.ckpt_async_min_mib:g} (a write that small takes less than starting the background writer)"
        )
    needed = per_rank * min(config.procs_per_node, world_size) * 1.1  # 10 % for DCP's metadata and buffers
    room = host_memory_available()
    if needed <= room:
        return True, None
    return False, (
        f"warning: asynchronous checkpoints need {needed / 2**30:.1f} GiB of host memory on this node (pinned, "
        f"shared: a copy of the model and optimizer state per local rank) but {room / 2**30:.1f} GiB is available "
        "(MemAvailable, the cgroup limit, free /dev/shm): saving synchronously (training waits for each save)"
    )


def state_bytes_per_rank(config: TrainConfig, vocab_size: int, world_size: int, cuda: bool) -> float:
    """One rank's model and optimizer state in bytes (bf16-mixed / fp32: fp32 weights and two fp32 AdamW moments,
    12 bytes a parameter; bf16: 6), divided over the ranks when FSDP2 shards it."""
    per_param = 6 if (cuda and config.precision == "bf16") else 12
    strategy = resolve_strategy(config, world_size, vocab_size)
    shards = world_size if (strategy == "fsdp2" and world_size > 1) else 1
    return estimate_parameters(config, vocab_size) * per_param / shards


def replace_fits(
    config: TrainConfig,
    vocab_size: int,
    world_size: int,
    cuda: bool,
    gpu_memory_gib: float | None = None,
    room: float | None = None,
) -> tuple[bool, str | None]:
    """Whether saves can be copied on the device first (``ckpt_while_writing: replace``, asynchronous saves only);
    (False, the one line saying why not): the trainer then saves as with ``wait``.

    The copy is one more copy of a rank's saved state (fp32 weights and AdamW moments) on its device: on a GPU,
    the memory plan with it (infra/configs/memory_plan.py) against the GPU's memory (``gpu_memory_gib``, else
    the config's, else what CUDA reports); on CPU (the device is host memory), against
    :func:`host_memory_available` (or ``room``) per local rank.
    """
    if config.ckpt_while_writing != "replace":
        return False, None
    fallback = "saving as with ckpt_while_writing: wait"
    if cuda:
        from infra.configs.memory_plan import GIB, plan_memory

        memory = gpu_memory_gib or config.gpu_memory_gib
        if memory is None:
            import torch

            memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
        plan = plan_memory(config, vocab_size, gpu_memory_gib=memory, world_size=world_size)
        if plan.fits:
            return True, None
        return False, (
            f"warning: ckpt_while_writing: replace needs {plan.snapshot / GIB:.1f} GiB more per GPU for a copy of the "
            f"saved state, {plan.total / GIB:.1f} GiB in all by the memory plan, but the GPU has {memory:.1f} GiB: "
            f"{fallback}"
        )
    needed = state_bytes_per_rank(config, vocab_size, world_size, cuda) * min(config.procs_per_node, world_size)
    if room is None:
        room = host_memory_available()
    if needed <= room:
        return True, None
    return False, (
        f"warning: ckpt_while_writing: replace needs {needed / 2**30:.2f} GiB of memory for a copy of the saved "
        f"state but {room / 2**30:.2f} GiB is available (MemAvailable, the cgroup limit): {fallback}"
    )


def snapshots_fit(
    config: TrainConfig, vocab_size: int, world_size: int, cuda: bool, room: float | None = None
) -> tuple[bool, str | None]:
    """Whether saves can be snapshots in host memory (``ckpt_snapshots``); (False, the one line saying why not).

    Snapshots hold three copies of each local rank's state in /dev/shm (workloads/train/snapshots.py: one being
    persisted, one waiting, one being filled), against the least of MemAvailable, the cgroup's headroom and
    /dev/shm's free space (:func:`host_memory_available`, or ``room``). Without the room, or on several nodes or a
    run directory in object storage, saves are what they are without ``ckpt_snapshots``.
    """
    if not config.ckpt_snapshots:
        return False, None
    fallback = "saving as without ckpt_snapshots"
    if config.num_nodes > 1:
        return False, f"warning: checkpoint snapshots need one node (num_nodes={config.num_nodes}): {fallback}"
    if staging.is_remote(config.run_dir):
        return False, (
            f"warning: checkpoint snapshots need a run_dir on a file system ({config.run_dir} is in object "
            f"storage): {fallback}"
        )
    per_rank = state_bytes_per_rank(config, vocab_size, world_size, cuda)
    needed = 3 * per_rank * min(config.procs_per_node, world_size) * 1.1  # 10 % for the files' metadata
    if room is None:
        room = host_memory_available()
    if needed <= room:
        return True, None
    return False, (
        f"warning: checkpoint snapshots need {needed / 2**30:.2f} GiB of host memory on this node (3 slots of "
        f"{per_rank / 2**30:.2f} GiB a local rank in /dev/shm) but {room / 2**30:.2f} GiB is available "
        f"(MemAvailable, the cgroup limit, free /dev/shm): {fallback}"
    )


def host_memory_available(root: Path = Path("/")) -> float:
    """Bytes a staging copy may take: the least of MemAvailable, the cgroup's headroom (cgroup v2, or v1's memory
    controller) and /dev/shm's free space. ``root``: where /proc, /sys and /dev are (tests lay out a tree)."""
    limits = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    v2, v1 = root / "sys/fs/cgroup", root / "sys/fs/cgroup/memory"
    own_v2, own_v1 = _own_cgroups(root)
    candidates = []
    for base, own, limit_name, used_name in (
        (v2, own_v2, "memory.max", "memory.current"),
        (v1, own_v1, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        # this process's own cgroup where the mount shows it (a host), else the mount's root (a container's)
        for directory in ([base / own.lstrip("/")] if own else []) + [base]:
            candidates.append((directory / limit_name, directory / used_name))
    for limit_file, used_file in candidates:
        try:
            limit = limit_file.read_text().strip()
            # "max" (v2) or a page-rounded 2**63 (v1): no limit
            if limit != "max" and int(limit) < 1 << 60:
                limits.append(int(limit) - int(used_file.read_text()))
                break
        except (OSError, ValueError):
            continue
    shm = root / "dev/shm"
    if shm.is_dir():
        limits.append(shutil.disk_usage(shm).free)
    return float(min(limits)) if limits else float("inf")


def _own_cgroups(root: Path) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory-controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def run_mirror(config: TrainConfig) -> staging.RunMirror | None:
    """The node-local copy of a run directory in object storage (None for a path)."""
    if not config.run_dir:
        raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
    if not staging.is_remote(config.run_dir):
        return None
    if config.num_nodes > 1:
        raise ValueError(
            f"run_dir {config.run_dir} is in object storage, which needs the run on one node (each node writes "
            f"only its own ranks' checkpoint shards); with num_nodes={config.num_nodes} use a run_dir on a file "
            "system every node mounts (a PVC, Lustre, NFS)"
        )
    return staging.RunMirror(config.run_dir)


def localize(config: TrainConfig) -> TrainConfig:
    """The configuration with its inputs on this node's disk: gs:// blends, tokenizer and init_from staged in."""
    update: dict = {
        "data_prefix": staging.local_blend(config.data_prefix),
        "valid_data_prefix": staging.local_blend(config.valid_data_prefix),
    }
    if config.tokenizer_model:
        update["tokenizer_model"] = staging.stage_in(config.tokenizer_model)
    if staging.is_remote(config.init_from):
        if config.reset_optimizer:
            update["init_from"] = staging.local_checkpoint(config.init_from)
        else:  # the optimizer state too: the whole AutoModel step directory
            step_dir = staging.stage_tree(storage.parent(storage.parent(config.init_from)))
            update["init_from"] = str(ckpt.consolidated_dir(step_dir))
    return config.model_copy(update=update)


def prepare_run_dir(config: TrainConfig, mirror: staging.RunMirror | None = None) -> Path:
    """The local run directory (for a remote run_dir: the node's copy, the newest remote checkpoint pulled in)."""
    if mirror is not None:
        run_dir = mirror.pull()
    else:
        if not config.run_dir:
            raise ValueError("run_dir is not set: where should checkpoints and metrics go?")
        run_dir = Path(config.run_dir.removeprefix("file://"))
    probe = ckpt.checkpoints_dir(run_dir) / f".tmp-probe-{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"checkpoint directory {probe.parent} is not writable ({exc.strerror or exc}); "
            "set run_dir to a writable path"
        ) from None
    return run_dir


def grouped_init_from(config: TrainConfig, recorded: TrainConfig) -> str:
    """``init_from`` for the grouped Mixtral: as it is, or (a checkpoint transformers' Mixtral wrote, moe_impl 'hf')
    a node-local copy in Mixtral's per-expert layout, which AutoModel's MoE model loads (workloads/moe_model.py)."""
    from workloads import moe_model

    if not moe_model.uses_fused_expert_layout(config.init_from):
        return config.init_from
    if not config.reset_optimizer:
        raise ValueError(
            f"init_from {recorded.init_from} was written by transformers' MixtralForCausalLM (moe_impl 'hf'): its "
            "optimizer state cannot continue with moe_impl 'grouped' (other parameters); set reset_optimizer true, "
            "or moe_impl 'hf'"
        )
    return moe_model.mixtral_layout_checkpoint(config.init_from, staging.stage_dir() / "mixtral-layout")
