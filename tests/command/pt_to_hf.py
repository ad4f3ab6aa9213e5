"""The converter of pt_trainer.py's checkpoints: python pt_to_hf.py CHECKPOINT OUTPUT (Hugging Face layout)."""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

checkpoint, output = sys.argv[1], sys.argv[2]
with open(os.path.join(checkpoint, "arch.json")) as fh:
    model = LlamaForCausalLM(LlamaConfig(**json.load(fh)))
model.load_state_dict(torch.load(os.path.join(checkpoint, "weights.pt")))
model.save_pretrained(output)
print("converted", checkpoint, "->", output)
