"""A user's own fine-tuning script, as the command engine runs it in the sft flow: it reads ONLY nemoflow's
contract variables (NEMOFLOW_INIT_FROM, NEMOFLOW_CHAT_TRAIN, NEMOFLOW_CHAT_HELD_OUT, NEMOFLOW_CHECKPOINT_DIR,
NEMOFLOW_SEQ_LENGTH) and fine-tunes with the installed engine (NeMo AutoModel through workloads.sft)."""

import json
import os
import subprocess
import sys

from tests.sft.test_sft_flow import TINY_SFT  # the job runs with the repository on PYTHONPATH

env = os.environ
config = {
    "init_from": env["NEMOFLOW_INIT_FROM"],
    "train_data": env["NEMOFLOW_CHAT_TRAIN"],
    "valid_data": env["NEMOFLOW_CHAT_HELD_OUT"],
    "run_dir": os.path.dirname(env["NEMOFLOW_CHECKPOINT_DIR"]),  # workloads.sft writes <run_dir>/checkpoints
    "seq_length": int(env["NEMOFLOW_SEQ_LENGTH"]),
    # tests/sft/test_sft_flow.py's tiny run: enough for a 4M-parameter model to answer and end its turn
    **{k: v for k, v in TINY_SFT.items() if k != "seq_length"},
}
path = os.path.join(env["NEMOFLOW_RUN_DIR"], "my_sft_config.json")
with open(path, "w") as fh:
    json.dump(config, fh)
print(f"sft_trainer: fine-tuning {config['init_from']} on {config['train_data']}", flush=True)
sys.exit(subprocess.call([sys.executable, "-m", "workloads.sft", "--config", path]))
