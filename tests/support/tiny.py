"""A tiny training configuration: the end-to-end and CPT tests shrink the demo model with it."""

TINY_TRAIN = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "seq_length": 64,
    "global_batch_size": 4,
    "micro_batch_size": 4,
    "max_steps": 12,
    "lr": 0.003,
    "warmup_steps": 0,
    "val_check_interval": 6,
    "ckpt_every_n_steps": 6,
    "limit_val_batches": 2,
    "log_every_n_steps": 3,
}
