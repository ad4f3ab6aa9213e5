"""Pretrain (or continue pretraining) a Llama / Mixtral with NVIDIA NeMo AutoModel, on every GPU of every node.

    python -m workloads.train --config run.json                        # one process (CPU demo, one GPU)
    python -m torch.distributed.run --nproc-per-node 8 -m workloads.train --config run.json
    srun python -m torch.distributed.run --nnodes $N --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD:29500 -m workloads.train --config run.json   # one srun task per node

``run.json`` is a :class:`infra.configs.train.TrainConfig` (NeMo names; an unknown
key is an error naming it). :func:`recipe_config` maps it onto NeMo AutoModel's
pretraining recipe (``TrainFinetuneRecipeForNextTokenPrediction``): the model is a
Hugging Face ``LlamaForCausalLM`` / ``MixtralForCausalLM`` built from its config (or
loaded from ``init_from`` to continue pretraining), the data is AutoModel's Megatron-Core
dataset (``MegatronPretraining``) over the NeMo blend prepare-dataset writes (weights,
prefixes, split, seed), sharded over the data-parallel ranks by Megatron's sequential
sampler, and the model is replicated with DDP or sharded with FSDP2 (``strategy``; auto =
DDP for small dense models on one node, see ``resolve_strategy``; tensor / context parallel
where AutoModel supports them, with FSDP2). The training loop, optimizer, schedule, checkpointing and resume are
AutoModel's; this module adds what the pipeline needs around them:

* ``<run_dir>/metrics.jsonl`` (rank 0): one JSON object per logged step
  (step, loss, lr, tokens_per_s, grad_norm, consumed_samples; on GPUs mfu and peak_mem_gib),
  per validation (step, val_loss) and per save (step, checkpoint_save_s: how long it blocked);
* checkpoints every ``ckpt_every_n_steps``: AutoModel's sharded, resumable checkpoint, written in
  the background from pinned host memory (the loop waits only while the state leaves the GPU;
  the staging buffers are kept for the whole run), with nemoflow's meta.json, pruned to
  ``save_top_k``; when training ends, a separate process (workloads/consolidate.py) exports the
  best and the last as Hugging Face safetensors that transformers loads as they are, with
  tokenizer.model, meta.json and, last, MANIFEST.json (layout: workloads/checkpoint.py);
* resume: started again on the same ``run_dir`` (a retry, a Slurm requeue, a
  pre-empted job) AutoModel restores weights, optimizer, schedule, RNG and the data
  loader's position from the latest checkpoint, so the data order continues exactly;
* object storage: the blend, the tokenizer and ``init_from`` may be ``gs://`` URIs (staged
  to local disk once per node, workloads/staging.py), and so may ``run_dir`` (one node): the
  run then trains in a node-local copy, uploads every complete checkpoint (resume state
  included, MANIFEST.json last), metrics.jsonl and train_config.json, and a restarted job
  resumes from the newest uploaded checkpoint;
* a background save that fails (a storage error, a full disk, the writer process killed) is reported (a
  "warning: the checkpoint of step N was not saved" line, a ``checkpoint_failed`` record in metrics.jsonl) and
  training continues: the failed save is removed (it was never published), the previous checkpoint stays the
  newest, a dead writer process is replaced; ``ckpt_max_failed_saves`` failures in a row, or a failed last
  save, stop the run (exit 1, one line that says why);
* ``ckpt_while_writing: skip`` (opt-in; default ``wait``): a save due while the previous background save is
  still being written is skipped instead of waited for ("checkpoint of step N skipped" lines, a
  ``checkpoint_skipped_while_writing`` record in metrics.jsonl); never the last step's save or one on a signal;
* ``ckpt_while_writing: replace`` (opt-in): each save's state copied on the device first, so the loop waits for
  neither the copy to host memory nor the previous write; a save due during a write waits in that copy and is
  written when the write ends, a newer one replaces it (``checkpoint_waiting_for``, ``checkpoint_replaced_by``,
  ``checkpoint_write_delayed_s`` in metrics.jsonl); a save the writer process received outlives a killed trainer
  and the next run publishes it (workloads/train/device_snapshot.py, workloads/checkpoint_writers.py);
* ``ckpt_snapshots: true`` (opt-in): each save is a snapshot in /dev/shm that a writer process of its own
  session persists at the storage's pace (a newer snapshot replaces the one waiting; ``snapshot_*`` records in
  metrics.jsonl); it outlives a killed trainer, and the next run waits for it (workloads/train/snapshots.py);
* SIGTERM / SIGUSR1: a checkpoint at the next step boundary, then exit 76;
* W&B through AutoModel when ``WANDB_API_KEY`` is set (``WANDB_PROJECT``, default nemoflow);
* every rank's output prefixed with ``[rank N]`` when there is more than one.

Numerics (``precision``): ``bf16-mixed`` (default, as NeMo recipes) keeps fp32 master
weights and fp32 AdamW state and computes in bf16 (FSDP2's mixed-precision policy on
several GPUs; bf16 autocast with DDP, which has no such policy, and on one GPU, where
AutoModel skips FSDP2 and so its policy); gradients are reduced in fp32 either way. On
CPU everything is fp32.

Exit codes: 0 done, 2 bad configuration / missing data / unwritable run_dir,
75 out of memory, 76 stopped by a signal after saving a checkpoint.
"""

import warnings

# megatron-core / megatron-fsdp warn at import that Apex / Transformer Engine are absent; neither is used. Every
# module of the package is imported after this one, so the filter is in place before theirs import megatron.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
