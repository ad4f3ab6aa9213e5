"""Run a user's training command under nemoflow's contract (the ``command`` engine of the training stages).

    python -m workloads.command_run -- python pretrain/llama3p1_2b_pt.py --devices 8
    python -m workloads.command_run --shell -- 'torchrun --nnodes $NNODES --node-rank $NODE_RANK ... train.py'

The stage (tasks/train_engines/command.py) sets ``NEMOFLOW_*`` variables naming the data, tokenizer and
output locations; this launcher adds the rank layout every launcher understands and runs the
command once per node, in the staged image:

====================  =========================================================================
NNODES                nodes of the job
NPROC_PER_NODE        processes the command should start per node (GPUs per node, or 1)
NODE_RANK             this node's index (0 on the first node)
MASTER_ADDR           the first node's address (the rendezvous host)
MASTER_PORT           a port there for the command's own rendezvous (torchrun --master-port)
====================  =========================================================================

Under a multi-node backend launch (torchrun with one process per node: Slurm, Kubernetes
Indexed Jobs) the node rank comes from torchrun's ``GROUP_RANK`` (or the pod index), and the
port is the next one after the backend's rendezvous port (which torchrun's own store holds);
torchrun's per-process variables (RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_*) are removed so
the command's own launcher starts clean.

The command's exit status is this process's; SIGTERM and SIGUSR1 (pre-emption, time limit)
are passed on to it so it can checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

# torchrun's per-worker variables: a command that launches its own processes must not inherit them.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
)
CONTRACT = (
    "NEMOFLOW_DATA_PREFIX",
    "NEMOFLOW_DATA_PREFIX_JSON",
    "NEMOFLOW_TOKENIZER_TYPE",
    "NEMOFLOW_TOKENIZER_MODEL",
    "NEMOFLOW_RUN_DIR",
    "NEMOFLOW_CHECKPOINT_DIR",
    "NEMOFLOW_LOG_DIR",
    "NEMOFLOW_INIT_FROM",
    "NEMOFLOW_SEQ_LENGTH",
    "WANDB_PROJECT",
    "WANDB_NAME",
    "WANDB_DIR",
    "WANDB_MODE",
    "NNODES",
    "NPROC_PER_NODE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_layout(environ: dict[str, str]) -> dict[str, str]:
    """NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT for the command (see the module docstring).

    >>> rank_layout({"NEMOFLOW_NNODES": "2", "NEMOFLOW_NPROC_PER_NODE": "8", "GROUP_RANK": "1",
    ...              "MASTER_ADDR": "node-a", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "7"})
    {'NNODES': '2', 'NPROC_PER_NODE': '8', 'NODE_RANK': '1', 'MASTER_ADDR': 'node-a', 'MASTER_PORT': '29501'}
    """
    nnodes = environ.get("NEMOFLOW_NNODES") or environ.get("NNODES") or "1"
    nproc = environ.get("NEMOFLOW_NPROC_PER_NODE") or environ.get("NPROC_PER_NODE") or "1"
    under_torchrun = "TORCHELASTIC_RUN_ID" in environ
    if under_torchrun:
        node_rank = environ.get("GROUP_RANK", "0")
    else:
        node_rank = (
            environ.get("NODE_RANK") or environ.get("SLURM_NODEID") or environ.get("JOB_COMPLETION_INDEX") or "0"
        )
    if int(nnodes) > 1 or "MASTER_ADDR" in environ:
        addr = environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(environ.get("MASTER_PORT", "29500"))
        # the backend's rendezvous port belongs to its torchrun store: the command gets the next one
        port = port + 1 if under_torchrun else port
    else:
        addr, port = "127.0.0.1", _free_port()
    return {
        "NNODES": nnodes,
        "NPROC_PER_NODE": nproc,
        "NODE_RANK": node_rank,
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(rank_layout(environ))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.command_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shell", action="store_true", help="run the command with bash -c (one string)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("error: no command given (python -m workloads.command_run -- COMMAND ...)", file=sys.stderr)
        return 2
    env = child_environment(dict(os.environ))
    for name in ("NEMOFLOW_CHECKPOINT_DIR", "NEMOFLOW_LOG_DIR"):
        if env.get(name):
            os.makedirs(env[name], exist_ok=True)
    print("nemoflow command contract: " + " ".join(f"{k}={env[k]}" for k in CONTRACT if k in env), flush=True)
    argv_child = ["bash", "-c", " ".join(command)] if args.shell else command
    try:
        child = subprocess.Popen(argv_child, env=env)
    except FileNotFoundError:
        print(f"error: command {argv_child[0]!r} not found in the image", file=sys.stderr, flush=True)
        return 2

    def forward(signum, _frame):
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
