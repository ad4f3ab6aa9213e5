"""How a :class:`~infra.jobs.JobSpec` becomes an sbatch job: :class:`SlurmOptions` and cluster presets.

Fields are named exactly like the sbatch flags they become (``partition`` ->
``--partition``, ``gpus_per_node`` -> ``--gpus-per-node``), as in NeMo-Run's
SlurmExecutor and the NeMo-on-Slurm guides.

Every field can be set from the environment as ``NEMOFLOW_SLURM_<FIELD>``.

Merging with the job's :class:`~infra.jobs.Resources`: a resource the stage set
explicitly (``Resources(gpus_per_node=8)``) wins; otherwise the option given
here (a backend- or deployment-wide default) is used; otherwise the Resources
default. So ``SlurmOptions(time="04:00:00")`` caps every job that does not ask
for its own limit.

Cluster presets (``preset="hcc-a3m"``, like the NeMo seeds' ``--cluster_type``)
fill in the GPUs per node, a typical partition name and the NCCL/network
environment of Google Cloud's HPC Cluster Toolkit machine types. The NCCL
values are the *typical* ones from the public A3/A4 guides: check them
against your cluster's own guide (interface names and plugin paths differ
between images), and override any of them with ``env``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.jobs import JobSpec, Resources, TimeLimit, parse_time_limit


class ClusterPreset(BaseModel):
    name: str
    description: str
    gpus_per_node: int
    partition: str
    env: dict[str, str] = Field(default_factory=dict)
    setup_lines: list[str] = Field(default_factory=list)


_GIB_COMMON = {
    "NCCL_NET": "gIB",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_P2P_NET_CHUNKSIZE": "131072",
    "NCCL_NVLS_CHUNKSIZE": "524288",
    "NCCL_IB_ADAPTIVE_ROUTING": "1",
    "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_IB_TC": "52",
    "NCCL_IB_FIFO_TC": "84",
}


def _gib_preset(name: str, machine: str, partition: str, tuner_config: str) -> ClusterPreset:
    """An RDMA cluster (gIB NCCL plugin): the same NCCL settings and library path, a tuner config of its own."""
    return ClusterPreset(
        name=name,
        description=f"{machine}, RDMA over CX-7 (gIB NCCL plugin)",
        gpus_per_node=8,
        partition=partition,
        env={**_GIB_COMMON, "NCCL_TUNER_CONFIG_PATH": f"/usr/local/gib/configs/{tuner_config}"},
        setup_lines=["export LD_LIBRARY_PATH=/usr/local/gib/lib64:${LD_LIBRARY_PATH:-}"],
    )


PRESETS: dict[str, ClusterPreset] = {
    preset.name: preset
    for preset in [
        ClusterPreset(
            name="hcc-a3m",
            description="A3 Mega: 8x H100 80GB, GPUDirect-TCPXO (FasTrak NCCL plugin)",
            gpus_per_node=8,
            partition="a3mega",
            env={
                "NCCL_FASTRAK_CTRL_DEV": "enp0s12",
                "NCCL_FASTRAK_IFNAME": "enp6s0,enp7s0,enp13s0,enp14s0,enp134s0,enp135s0,enp141s0,enp142s0",
                "NCCL_SOCKET_IFNAME": "enp0s12",
                "NCCL_CROSS_NIC": "0",
                "NCCL_ALGO": "Ring,Tree",
                "NCCL_PROTO": "Simple",
                "NCCL_MIN_NCHANNELS": "4",
                "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
                "NCCL_P2P_NET_CHUNKSIZE": "524288",
                "NCCL_P2P_PCI_CHUNKSIZE": "524288",
                "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
                "NCCL_FASTRAK_NUM_FLOWS": "2",
                "NCCL_FASTRAK_USE_SNAP": "1",
                "NCCL_FASTRAK_USE_LLCM": "1",
                "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
                "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
                "NCCL_BUFFSIZE": "8388608",
                "NCCL_NET_GDR_LEVEL": "PIX",
                "NCCL_NVLS_ENABLE": "0",
                "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
                "NCCL_TUNER_CONFIG_PATH": "/var/lib/tcpxo/lib64/a3plus_tuner_config.textproto",
            },
            setup_lines=["export LD_LIBRARY_PATH=/var/lib/tcpxo/lib64:${LD_LIBRARY_PATH:-}"],
        ),
        _gib_preset("hcc-a3u", "A3 Ultra: 8x H200 141GB", "a3ultra", "tuner_config_a3u.txtpb"),
        _gib_preset("hcc-a4", "A4: 8x B200 180GB", "a4high", "tuner_config_a4.txtpb"),
        ClusterPreset(
            name="hcc-a3h",
            description="A3 High: 8x H100 80GB, GPUDirect-TCPX",
            gpus_per_node=8,
            partition="a3",
            env={
                "NCCL_NET": "GPUDirectTCPX_v7",
                "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
                "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
                "NCCL_SOCKET_IFNAME": "eth0",
                "NCCL_CROSS_NIC": "0",
                "NCCL_ALGO": "Ring",
                "NCCL_PROTO": "Simple",
                "NCCL_NSOCKS_PERTHREAD": "4",
                "NCCL_SOCKET_NTHREADS": "1",
                "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
                "NCCL_P2P_NET_CHUNKSIZE": "524288",
                "NCCL_P2P_PCI_CHUNKSIZE": "524288",
                "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
                "NCCL_BUFFSIZE": "4194304",
                "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177",
                "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191",
                "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "50000",
                "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx",
            },
            setup_lines=["export LD_LIBRARY_PATH=/var/lib/tcpx/lib64:${LD_LIBRARY_PATH:-}"],
        ),
    ]
}


class SlurmOptions(BaseSettings):
    """sbatch options for every job a :class:`~infra.backends.slurm.SlurmBackend` submits.

    Each field can also come from the environment, ``NEMOFLOW_SLURM_<FIELD>``
    (``NEMOFLOW_SLURM_PARTITION=gpu``, lists as JSON: ``NEMOFLOW_SLURM_SETUP_LINES='["module load cuda"]'``),
    so flows that only say ``backend="slurm"`` pick up the site's settings.
    """

    model_config = SettingsConfigDict(env_prefix="NEMOFLOW_SLURM_", extra="forbid")

    preset: str | None = Field(None, description="cluster type: " + ", ".join(PRESETS))
    partition: str | None = Field(None, description="sbatch --partition (default: the cluster's default)")
    gpu_partition: str | None = Field(None, description="partition for jobs that request GPUs, if different")
    account: str | None = None
    qos: str | None = None
    nodes: int | None = Field(None, ge=1)
    ntasks_per_node: int | None = Field(None, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    mem: str | None = None
    time: TimeLimit = None
    exclusive: bool = False
    constraint: str | None = None
    dependency: str | None = Field(None, description="e.g. 'afterok:1234'")
    signal: str | None = Field(
        None, description="pre-emption warning, e.g. 'B:USR1@120': the batch script forwards it to the workload"
    )
    output: str | None = Field(None, description="sbatch --output pattern (default: <log_dir>/<name>-%j.out)")
    error: str | None = Field(None, description="sbatch --error pattern (default: merged into output)")
    job_name: str | None = None
    extra_sbatch_flags: list[str] = Field(default_factory=list, description="e.g. ['--reservation=r1']")
    setup_lines: list[str] = Field(
        default_factory=list, description="shell lines before the command: module load, venv activation"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment (non-secret)")
    container_mounts: list[str] = Field(default_factory=list, description="extra pyxis mounts 'src:dst[:ro]'")
    launcher: Literal["auto", "direct", "srun", "torchrun"] = Field(
        "auto", description="auto: torchrun over srun for multi-node, srun for containers/multi-task, else direct"
    )
    master_port: int = Field(29500, ge=1, le=65535)
    log_dir: str | None = Field(None, description="where scripts and output files go (shared storage)")
    max_resubmits: int = Field(3, ge=0, description="resubmissions after TIMEOUT, NODE_FAIL or PREEMPTED")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise ValueError(f"unknown cluster preset {value!r}; choose one of {', '.join(PRESETS)}")
        return value

    @property
    def cluster_preset(self) -> ClusterPreset | None:
        return PRESETS[self.preset] if self.preset else None


class SbatchRequest(BaseModel):
    """The merged, final values one job is submitted with."""

    job_name: str
    partition: str | None
    account: str | None
    qos: str | None
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem: str | None
    time: str | None
    exclusive: bool
    constraint: str | None
    dependency: str | None
    signal: str | None
    array: str | None
    output: str
    error: str | None
    extra_sbatch_flags: list[str]
    setup_lines: list[str]
    env: dict[str, str]
    launcher: Literal["direct", "srun", "torchrun"]
    master_port: int
    nproc_per_node: int | None = None
    comment: str | None = None

    @property
    def time_seconds(self) -> int | None:
        return parse_time_limit(self.time) if self.time else None


def merge(spec: JobSpec, options: SlurmOptions, log_dir: str, array_indices: list[int] | None = None) -> SbatchRequest:
    """Resolve the final sbatch values for ``spec`` (see the module docstring for precedence)."""
    preset = options.cluster_preset
    res: Resources = spec.resources
    explicit = res.model_fields_set

    def pick(name: str):
        if name in explicit:
            return getattr(res, name)
        value = getattr(options, name)
        return value if value is not None else getattr(res, name)

    gpus = pick("gpus_per_node")
    partition = options.partition
    if gpus and options.gpu_partition:
        partition = options.gpu_partition
    if partition is None and preset is not None:
        partition = preset.partition
    nodes = pick("nodes")
    ntasks = pick("ntasks_per_node")
    launcher = options.launcher
    if spec.nproc_per_node and (nodes > 1 or spec.nproc_per_node > 1):
        launcher = "torchrun"  # a torch.distributed job: one torchrun per node, nproc_per_node each
    elif launcher == "auto":
        if nodes > 1 and _python_command(spec.command):
            launcher = "torchrun"
        elif nodes > 1 or ntasks > 1 or spec.container_image:
            launcher = "srun"
        else:
            launcher = "direct"
    array = None
    if array_indices is not None:
        array = _array_spec(array_indices, spec.array_parallelism)
    pattern = "%A_%a" if array_indices is not None else "%j"
    env = {**(preset.env if preset else {}), **options.env, **spec.env}
    return SbatchRequest(
        job_name=options.job_name or spec.name,
        partition=partition,
        account=options.account,
        qos=options.qos,
        nodes=nodes,
        ntasks_per_node=ntasks,
        gpus_per_node=gpus,
        cpus_per_task=pick("cpus_per_task"),
        mem=pick("mem"),
        time=pick("time"),
        exclusive=options.exclusive,
        constraint=options.constraint,
        dependency=options.dependency,
        signal=options.signal,
        array=array,
        output=options.output or f"{log_dir}/{spec.name}-{pattern}.out",
        error=options.error,
        extra_sbatch_flags=list(options.extra_sbatch_flags),
        setup_lines=[*(preset.setup_lines if preset else []), *options.setup_lines],
        env=env,
        launcher=launcher,
        master_port=options.master_port,
        nproc_per_node=spec.nproc_per_node,
        comment=labels_comment(spec.labels) if spec.labels else None,
    )


COMMENT_PREFIX = "nemoflow:"


def labels_comment(labels: dict[str, str]) -> str:
    """``sbatch --comment`` carrying a job's labels (squeue ``%k`` and sacct read them back).

    >>> labels_comment({"flow-run": "abc", "fingerprint": "f00"})
    'nemoflow:fingerprint=f00,flow-run=abc'
    """
    return COMMENT_PREFIX + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_labels_comment(comment: str) -> dict[str, str]:
    """The labels of :func:`labels_comment` (empty for other comments).

    >>> parse_labels_comment("nemoflow:fingerprint=f00,flow-run=abc")
    {'fingerprint': 'f00', 'flow-run': 'abc'}
    """
    if not comment.startswith(COMMENT_PREFIX):
        return {}
    pairs = [p.split("=", 1) for p in comment[len(COMMENT_PREFIX) :].split(",") if "=" in p]
    return {k: v for k, v in pairs}


def _python_command(command: list[str]) -> bool:
    exe = command[0].rsplit("/", 1)[-1]
    return exe.startswith("python") and len(command) > 1


def _array_spec(indices: list[int], parallelism: int | None) -> str:
    """``--array`` value: ``0-7%2`` for a full range, ``1,4`` for a resubmitted subset.

    >>> _array_spec([0, 1, 2, 3], 2)
    '0-3%2'
    >>> _array_spec([1, 4], None)
    '1,4'
    """
    indices = sorted(indices)
    if indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 1:
        body = f"{indices[0]}-{indices[-1]}"
    else:
        body = ",".join(str(i) for i in indices)
    return body + (f"%{parallelism}" if parallelism else "")
