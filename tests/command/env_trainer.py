"""A user's own training script, as the command engine runs it: it reads ONLY nemoflow's contract variables
(NEMOFLOW_DATA_PREFIX, NEMOFLOW_TOKENIZER_MODEL, NEMOFLOW_CHECKPOINT_DIR, NEMOFLOW_SEQ_LENGTH, NPROC_PER_NODE,
MASTER_PORT, W&B settings) and trains with the installed engine (NeMo AutoModel through workloads.train). In a
CPT refresh NEMOFLOW_INIT_FROM names the promoted model: the script continues it (the same shape: it trained it)."""

import json
import os
import subprocess
import sys

env = os.environ
words = env["NEMOFLOW_DATA_PREFIX"].split()  # NeMo's form: "w1 prefix1 w2 prefix2"
blend = [float(w) if i % 2 == 0 else w for i, w in enumerate(words)] if len(words) > 1 else words
run_dir = os.path.dirname(env["NEMOFLOW_CHECKPOINT_DIR"])  # workloads.train writes <run_dir>/checkpoints
config = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "seq_length": int(env["NEMOFLOW_SEQ_LENGTH"]),
    "global_batch_size": 4,
    "micro_batch_size": 4,
    "max_steps": 6,
    "lr": 0.003,
    "val_check_interval": 3,
    "ckpt_every_n_steps": 3,
    "limit_val_batches": 1,
    "log_every_n_steps": 3,
    "save_top_k": -1,
    "data_prefix": blend,
    "tokenizer_model": env["NEMOFLOW_TOKENIZER_MODEL"],
    "run_dir": run_dir,
    "nproc_per_node": int(env["NPROC_PER_NODE"]),
}
if env.get("NEMOFLOW_INIT_FROM"):
    config["init_from"] = env["NEMOFLOW_INIT_FROM"]
path = os.path.join(env["NEMOFLOW_RUN_DIR"], "my_config.json")
with open(path, "w") as fh:
    json.dump(config, fh)
print(
    f"env_trainer: node {env['NODE_RANK']} of {env['NNODES']}, rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}, W&B project {env['WANDB_PROJECT']}",
    flush=True,
)
cmd = [sys.executable, "-m", "workloads.train", "--config", path]
if int(env["NPROC_PER_NODE"]) > 1:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={env['NNODES']}",
        f"--nproc-per-node={env['NPROC_PER_NODE']}",
        f"--node-rank={env['NODE_RANK']}",
        f"--master-addr={env['MASTER_ADDR']}",
        f"--master-port={env['MASTER_PORT']}",
        "-m",
        "workloads.train",
        "--config",
        path,
    ]
sys.exit(subprocess.call(cmd))
