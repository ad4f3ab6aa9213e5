"""The typed config models and pure arithmetic that flows, tasks and workloads share.

Each is defined once, here, and imported by the flow that takes it as a parameter, the task that checks it
before spending compute and the job that runs it. Nothing here imports torch or any job-side package: a
flow or the CLI imports these without loading a training stack (tests/foundation/test_layers.py checks it).

    train.py        ``TrainConfig`` (pretraining, NeMo names), ``parse_blend``, the parallelism check
    moe.py          which MoE implementation a Mixtral run trains with
    memory_plan.py  memory per GPU of a training layout, checked before launch
    sft.py          ``SftConfig`` (fine-tuning)
    tokenizer.py    ``TokenizerConfig`` (Megatron's ``--tokenizer-type`` and files) and its fingerprint
    fetch.py        ``FetchOptions`` of the download + extract job
"""
