"""A trainer whose checkpoints are NOT in the Hugging Face layout: iter_N/{weights.pt, arch.json} (a torch state
dict), as a Megatron-style engine writes them. The converter (pt_to_hf.py) turns one into a Hugging Face directory."""

import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = os.environ["NEMOFLOW_CHECKPOINT_DIR"]
arch = {
    "vocab_size": 32000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**arch))
for step in (2, 5):
    with torch.no_grad():
        model.lm_head.weight.fill_(step / 100)  # "training": the step is visible in the weights
    directory = os.path.join(out, f"iter_{step:07d}")
    os.makedirs(directory, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(directory, "weights.pt"))
    with open(os.path.join(directory, "arch.json"), "w") as fh:
        json.dump(arch, fh)
print("saved", sorted(os.listdir(out)))
