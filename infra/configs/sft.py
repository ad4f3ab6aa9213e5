"""The fine-tuning configuration: one run of ``python -m workloads.sft`` (workloads/sft.py), NeMo names.

The sft flow takes it as a parameter, the stage checks it before launch (tasks/train_engines/automodel.py's
``AutoModelSft`` is this model plus the engine's interface), the job reads it from ``<run_dir>/sft_config.json``.
No torch here.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra.configs.train import RunLayout

# Mistral's v1 chat format, which the demo tokenizer (Mixtral's) was made for:
# <s>[INST] question [/INST] answer</s>[INST] ... A system message goes first, before the first [INST].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


class SftConfig(BaseModel, RunLayout):
    """One fine-tuning run (NeMo names where NeMo has one); serialised to ``<run_dir>/sft_config.json``."""

    model_config = ConfigDict(extra="forbid")

    init_from: str | None = Field(None, description="checkpoint directory to fine-tune (the stage fills it)")
    train_data: str | None = Field(None, description="chat JSONL to train on, a local path (the stage fills it)")
    valid_data: str | None = Field(
        None, description="held-out chat JSONL: validation and --validate (the stage fills it)"
    )
    run_dir: str | None = Field(None, description="output directory (local path or shared volume)")
    tokenizer_model: str | None = Field(None, description="sentencepiece .model; default <init_from>/tokenizer.model")
    chat_template: str = Field(CHAT_TEMPLATE, description="Jinja chat template (default: Mistral's [INST] format)")
    seq_length: int = Field(256, ge=8, description="longest tokenized conversation; longer ones are truncated")

    global_batch_size: int = Field(8, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    max_steps: int = Field(40, ge=1)
    lr: float = Field(5e-4, ge=0)
    min_lr: float = Field(5e-5, ge=0)
    warmup_steps: int = Field(2, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    gradient_clip_val: float | None = 1.0
    val_check_interval: int = Field(20, ge=1)
    ckpt_every_n_steps: int | None = Field(None, ge=1, description="None = once, at the end")
    log_every_n_steps: int = Field(5, ge=1)
    seed: int = 1234

    # the --validate check
    eval_examples: int = Field(32, ge=1, description="held-out conversations for the loss (the first N)")
    generation_examples: int = Field(8, ge=0, description="held-out prompts answered greedily")
    max_new_tokens: int = Field(48, ge=1)
    min_new_tokens: int = Field(
        1, ge=0, description="tokens generated before </s> may end an answer (1: no empty answers)"
    )
    min_answer_rate: float = Field(
        0.5, ge=0, le=1, description="share of greedy answers that must be non-empty and end with </s>"
    )

    precision: Literal["bf16-mixed", "bf16", "32"] = "bf16-mixed"
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, description="0 = CPU")
    nproc_per_node: int | None = Field(None, ge=1)
    cpus_per_task: int = Field(2, ge=1)
    mem: str | None = None
    time: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SftConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                f"{self.micro_batch_size}"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.lr}")
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_model or os.path.join(self.init_from or "", "tokenizer.model")


def load_sft_config(text: str) -> SftConfig:
    """An SftConfig from JSON; one line naming each bad or unknown key."""
    try:
        return SftConfig.model_validate_json(text)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "config"
            problems.append(
                f"unknown SftConfig key '{where}'" if error["type"] == "extra_forbidden" else f"{where}: {error['msg']}"
            )
        raise ValueError("; ".join(problems)) from None
