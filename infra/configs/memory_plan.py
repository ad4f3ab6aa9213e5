"""How much GPU memory a training layout needs per GPU, and whether it fits: checked before anything is submitted.

    plan = plan_memory(config, gpu_memory_gib=79.6)     # config: a TrainConfig (the seed's Mixtral-8x7B, ...)
    print(plan.report())                                # layout, per-GPU memory by kind, the arithmetic
    check_memory(config, gpu_memory_gib=79.6)           # ParallelismError with the arithmetic when it does not fit

The estimate is for nemoflow's training engine as it runs the config (NeMo AutoModel, FSDP2 or DDP, expert
parallel for the grouped MoE, bf16-mixed by default), per GPU at the peak (the end of a micro batch's forward
pass), in bytes. Notation: N parameters (N_e of them in experts, N_d = N - N_e the rest), L layers, h hidden,
f FFN (per expert), V vocabulary, E experts, k experts per token, g = kv_heads / heads, T = micro_batch_size x
seq_length / context_parallel tokens per GPU; tp, pp, cp, ep, dp the parallel sizes (dp = world / (tp x pp x cp)).

* **Training state** (weights, gradients, AdamW m and v) at w = 4 bytes a value under ``bf16-mixed`` and ``32``
  (fp32 master weights), 2 under ``bf16``: weights w, gradients w, optimizer 2w bytes a parameter. FSDP2 shards
  all of it over the tp x pp x cp x dp ranks (expert parameters: ep ranks hold different experts, the
  dp x cp / ep ranks of an expert shard it: the same 1 / (dp x cp) share); DDP and one process hold it whole
  (divided by tp x pp only).
* **Working copies**: FSDP2 all-gathers one layer's parameters at a time in the compute dtype c (2 bytes, 4 under
  ``32``) with the next one prefetched, and reduces its gradients in fp32: (2c + 4) x P_layer, P_layer = one
  layer's dense parameters / tp + its expert parameters / ep; plus the output layer gathered once (c x V x h).
  Autocast (one GPU, DDP) keeps a bf16 copy of every weight it used, 2 x N / (tp x pp); DDP's gradient
  buckets add 4 x N.
* **Activations** kept for the backward pass (bf16, SDPA / flash attention: no seq^2 term; Korthikanti et al.
  2022, Megatron-LM's theoretical_memory_usage.py, adapted to GQA, SwiGLU and top-k experts), bytes a token and
  layer: attention (4 + (4 + 4g) / tp) x h (norm input and output, q, k, v, attention output); a dense SwiGLU
  MLP 4h + 6f / tp (norm input and output, gate|up, activation); an MoE layer 4h + 4kh + 6kf + 8E (norm input
  and output, each routed copy of the token in and out, gate|up and activation of its k experts, fp32 router
  scores). Times T x L (the first pipeline stage holds pp micro batches of L / pp layers). With
  ``activation_checkpointing`` only each layer's input is kept, 2h x T x L, plus one layer recomputed.
  Logits: T x V x 6 / tp (bf16 logits and their fp32 copy for the loss). Expert parallel's all-gather
  dispatch (AutoModel's ``torch`` dispatcher) holds ep x T x h x 6 bytes (gathered tokens, fp32 outputs).
* **A grouped MoE held whole** (one process, DDP): the experts are most of the parameters, and their gradients
  and the activations are never at full size at once (zero_grad frees the gradients, the backward pass frees
  activations as it creates gradients), so its peak is the larger of the end of the forward pass and the end of
  the backward pass (``_moe_replica_peak``; measured on H200: tests/train/test_moe_memory.py).
* **A save's snapshot** (``ckpt_while_writing: replace``): one more copy of the saved state on the GPU, the
  fp32 weights and AdamW m and v (weights + optimizer above), into which each save copies before DCP writes it.
  Without the room for it the trainer saves as with ``wait`` (one line says so): the layout is not refused.
* **Reserve**: 2 GiB for the CUDA context, NCCL buffers and allocator fragmentation.

Checked against measurements on H200 (README, "Training on H200"): Llama 1.1B, seq 2048, micro batch 4, one GPU
28.4 GiB peak compiled (estimate 30.0 without the reserve), two GPUs under FSDP2 19.2 GiB (estimate 20.0): the
estimate is a few percent high (torch.compile fuses some of the elementwise activations away). Uncompiled
(``enable_compile`` false, the default) the same one-GPU run peaked at 34.4 GiB, which the eager MLP term
(``EAGER_MLP_BYTES_PER_F``, fitted to that one measurement) covers: estimate 36.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.configs.train import ParallelismError, TrainConfig, resolve_strategy

GIB = 2**30
RESERVE_GIB = 2.0
# An uncompiled dense SwiGLU MLP keeps more for the backward pass than the compiled one the formula was checked
# against: the 1.1B at seq 2048, micro batch 4 on one H200 peaked at 34.4 GiB eager (tests/train/test_moe_plan.py at
# fc7500e) and 28.4 GiB compiled, 6.0 GiB apart = 6 bytes per FFN unit, token and layer. One measured shape (dense,
# one GPU): the MoE layers' eager path has not been measured.
EAGER_MLP_BYTES_PER_F = 6

# GPU memory as CUDA reports it (torch.cuda.get_device_properties().total_memory), by Slurm cluster preset
# (infra/slurm/options.py PRESETS) and by the GPU node labels a K8s executor's node_selector may name.
GPU_MEMORY_GIB = {
    "hcc-a3m": 79.6,  # A3 Mega: H100 80GB HBM3, 81,559 MiB
    "hcc-a3h": 79.6,  # A3 High: H100 80GB HBM3
    "hcc-a3u": 139.8,  # A3 Ultra: H200 141GB (the device README's "about 139 GiB")
    "hcc-a4": 178.4,  # A4: B200 180GB
    "nvidia-h100-80gb": 79.6,
    "nvidia-h100-mega-80gb": 79.6,
    "nvidia-h200-141gb": 139.8,
    "nvidia-b200": 178.4,
    "nvidia-a100-80gb": 79.2,
    "nvidia-tesla-a100": 39.4,
    # NVIDIA GPU feature discovery's nvidia.com/gpu.product (Run:ai, DGX Cloud, GPU operator clusters)
    "NVIDIA-H100-80GB-HBM3": 79.6,
    "NVIDIA-H200": 139.8,
    "NVIDIA-B200": 178.4,
    "NVIDIA-A100-SXM4-80GB": 79.2,
}
GPU_LABELS = ("cloud.google.com/gke-accelerator", "nvidia.com/gpu.product")
GPU_MEMORY_MIB_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB, as nvidia-smi reports it


def executor_gpu_memory_gib(executor) -> float | None:
    """Memory of one GPU of the executor's nodes: its Slurm preset, or the GPU labels of its node selector.

    ``executor``: an executor, its name or mapping (then read as infra.executors reads it, environment included)."""
    if executor is None or isinstance(executor, str | dict):
        from infra.executors import as_executor

        executor = as_executor(executor)
    preset = getattr(executor, "preset", None)
    if preset in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[preset]
    selector = getattr(executor, "node_selector", None) or {}
    if selector.get(GPU_MEMORY_MIB_LABEL, "").isdigit():
        return int(selector[GPU_MEMORY_MIB_LABEL]) / 1024
    return next((GPU_MEMORY_GIB[selector[k]] for k in GPU_LABELS if selector.get(k) in GPU_MEMORY_GIB), None)


@dataclass(frozen=True)
class MemoryPlan:
    layout: dict[str, int | str]
    parameters: int
    active_parameters: int
    # bytes per GPU
    weights: float
    gradients: float
    optimizer: float
    working: float
    activations: float
    gpu_memory_gib: float | None
    notes: tuple[str, ...] = ()
    snapshot: float = 0.0  # ckpt_while_writing: replace — a copy of the saved state (weights and optimizer)

    @property
    def total(self) -> float:
        return self.training + self.snapshot

    @property
    def training(self) -> float:
        """The memory per GPU without the save's snapshot."""
        return self.weights + self.gradients + self.optimizer + self.working + self.activations + RESERVE_GIB * GIB

    @property
    def fits(self) -> bool:
        return self.gpu_memory_gib is None or self.total <= self.gpu_memory_gib * GIB

    @property
    def fits_without_snapshot(self) -> bool:
        return self.gpu_memory_gib is None or self.training <= self.gpu_memory_gib * GIB

    def summary(self) -> str:
        layout = " ".join(f"{k}={v}" for k, v in self.layout.items())
        where = f" of {self.gpu_memory_gib:.1f} GiB" if self.gpu_memory_gib else ""
        return f"{layout}: {self.total / GIB:.1f} GiB per GPU{where}"

    def report(self) -> str:
        """The layout and each kind of memory per GPU, with the total against the GPU's."""
        g = GIB
        lines = [
            "layout: " + ", ".join(f"{k} {v}" for k, v in self.layout.items()),
            f"parameters: {self.parameters / 1e9:.2f}B ({self.active_parameters / 1e9:.2f}B active per token)",
            "memory per GPU (GiB):",
            f"  weights      {self.weights / g:8.1f}",
            f"  gradients    {self.gradients / g:8.1f}",
            f"  optimizer    {self.optimizer / g:8.1f}  (AdamW m and v)",
            f"  working      {self.working / g:8.1f}  (gathered / cast weight copies, gradient buffers, dispatch)",
            f"  activations  {self.activations / g:8.1f}",
            f"  reserve      {RESERVE_GIB:8.1f}  (CUDA context, NCCL, fragmentation)",
            *([f"  snapshot     {self.snapshot / g:8.1f}  (ckpt_while_writing: replace)"] if self.snapshot else []),
            f"  total        {self.total / g:8.1f}"
            + (
                f" of {self.gpu_memory_gib:.1f}: {'fits' if self.fits else 'DOES NOT FIT'}"
                if self.gpu_memory_gib
                else ""
            ),
            *self.notes,
        ]
        return "\n".join(lines)


def parameter_counts(config: TrainConfig, vocab_size: int) -> dict[str, int]:
    """Parameters by kind: per layer attention, dense MLP or experts (+ router), norms; embeddings and output."""
    h, f, heads = config.hidden_size, config.ffn_hidden_size, config.num_attention_heads
    head = h // heads
    attention = 2 * h * heads * head + 2 * h * config.kv_heads * head
    experts = config.experts
    mlp = 3 * h * f * (experts or 1)
    router = h * experts if experts else 0
    return {
        "attention": attention,
        "mlp": mlp,
        "router": router,
        "norms": 2 * h,
        "embedding": vocab_size * h,
        "output": vocab_size * h,
        "final_norm": h,
        "active_mlp": 3 * h * f * (config.moe_router_topk if experts else 1),
    }


def plan_memory(
    config: TrainConfig,
    vocab_size: int | None = None,
    gpu_memory_gib: float | None = None,
    world_size: int | None = None,
) -> MemoryPlan:
    """Per-GPU memory of ``config`` as nemoflow's AutoModel trainer runs it (formulas: the module docstring)."""
    vocab = vocab_size or config.vocab_size or 32000
    world = world_size or config.world_size
    tp, pp, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    ep = config.expert_model_parallel_size
    dp = max(1, world // (tp * pp * cp))
    L, h, f, V = config.num_layers, config.hidden_size, config.ffn_hidden_size, vocab
    E, k = config.experts or 0, config.moe_router_topk
    counts = parameter_counts(config, vocab)
    layer = counts["attention"] + counts["mlp"] + counts["router"] + counts["norms"]
    total = L * layer + counts["embedding"] + counts["output"] + counts["final_norm"]
    active = total - L * (counts["mlp"] - counts["active_mlp"])
    expert_params = L * counts["mlp"] if E else 0
    layer_dense = layer - (counts["mlp"] if E else 0)

    strategy = resolve_strategy(config, world, vocab) if world > 1 else "single"
    w = 2 if config.precision == "bf16" else 4
    c = 4 if config.precision == "32" else 2
    if strategy == "fsdp2":
        shard = tp * pp * cp * dp
    else:  # one process or DDP: a whole replica (tensor / pipeline parallel would still split it)
        shard = tp * pp
    local = total / shard
    weights, gradients, optimizer = w * local, w * local, 2 * w * local
    saved_state = weights + optimizer  # what a checkpoint holds of this rank (a snapshot copies it)

    if strategy == "fsdp2":
        p_layer = layer_dense / tp + (counts["mlp"] / ep if E else 0)
        working = (2 * c + 4) * p_layer + c * V * h / tp
        how = f"FSDP2 over {shard} ranks"
    else:
        working = 2 * total / (tp * pp) if c == 2 else 0.0  # autocast's bf16 weight copies
        if strategy == "ddp":
            working += 4 * total / (tp * pp)  # gradient buckets
        how = "DDP replica per rank" if strategy == "ddp" else "one process"
    tokens = config.micro_batch_size * config.seq_length / cp
    if E:
        working += (ep * tokens * h * 6) if ep > 1 else 0.0
    g = config.kv_heads / config.num_attention_heads
    attention_bytes = (4 + (4 + 4 * g) / tp) * h
    if E:
        mlp_bytes = 4 * h + 4 * k * h + 6 * k * f + 8 * E
    else:
        mlp_bytes = 4 * h + 6 * f / tp
        if not config.enable_compile:
            mlp_bytes += EAGER_MLP_BYTES_PER_F * f / tp  # the elementwise intermediates compile fuses away
    per_layer = tokens * (attention_bytes + mlp_bytes)
    if config.activation_checkpointing:
        activations = 2 * h * tokens * L + per_layer
    else:
        activations = per_layer * L
    activations += tokens * V * 6 / tp
    phase_note = acts_note = None
    if E and strategy != "fsdp2":
        weights, gradients, working, activations, phase_note, acts_note = _moe_replica_peak(
            config, counts, total, expert_params, tokens, w, c, per_layer
        )

    layout: dict[str, int | str] = {
        "nodes": config.num_nodes,
        "gpus": world,
        "TP": tp,
        "PP": pp,
        "CP": cp,
        "EP": ep,
        "DP": dp,
        "micro_batch": config.micro_batch_size,
        "seq": config.seq_length,
        "strategy": strategy if strategy != "single" else "one process",
    }
    notes = [
        f"state: {2 * w + 2 * w} bytes a parameter ({config.precision}) x {total / 1e9:.2f}B / {shard} "
        f"({how}) = {(weights + gradients + optimizer) / GIB:.1f} GiB",
        f"activations: {per_layer / tokens / 1024:.0f} KiB a token and layer x {tokens:.0f} tokens x {L} layers"
        + (
            " (activation checkpointing: layer inputs only, one layer recomputed)"
            if config.activation_checkpointing
            else ""
        )
        + f" + logits {tokens * V * 6 / tp / GIB:.2f} GiB",
    ]
    if phase_note:
        notes[1:2] = [acts_note, phase_note]
    if E:
        notes.append(
            f"experts: {expert_params / 1e9:.2f}B of the parameters; EP {ep}: {E // ep} of {E} experts a rank"
            + (f", all-gather dispatch {ep * tokens * h * 6 / GIB:.2f} GiB" if ep > 1 else "")
        )
    return MemoryPlan(
        layout=layout,
        parameters=total,
        active_parameters=active,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        working=working,
        activations=activations,
        gpu_memory_gib=gpu_memory_gib,
        notes=tuple(notes),
        snapshot=saved_state if config.ckpt_while_writing == "replace" else 0.0,
    )


def _moe_replica_peak(config, counts, total, expert_params, tokens, w, c, per_layer):
    """Weights, gradients, working, activations (bytes) and a note, at the peak of a grouped MoE that one process
    (or each DDP rank) holds whole: the larger of the end of the forward pass and the end of the backward pass.

    The experts are most of the parameters, so their gradients and the activations are never at full size at
    once: the optimizer's ``zero_grad`` frees the gradients before the forward pass (set_to_none), and the
    backward pass frees each layer's activations as it creates that layer's gradients. Per token and layer the
    activations are the module docstring's, plus, under bf16-mixed, the two RMSNorm inputs in fp32 (the residual
    stream of fp32 weights under autocast: 4h more); the logits hold 10 bytes a token and vocabulary entry while
    the loss runs (AutoModel's MaskedCrossEntropy: the bf16 logits, their fp32 copy and log-softmax's fp32 output).

    * end of the forward pass: weights, optimizer, every layer's activations, the loss's logits, and under
      bf16-mixed the bf16 weight copies (autocast's cached casts and the experts' own casts, kept for the backward
      pass: 2 bytes a parameter);
    * end of the backward pass: weights, optimizer, all gradients, the first layer's activations (freed last)
      and, under bf16-mixed, that layer's expert gradients in bf16 before they become the fp32 ``.grad``
      (2 x one layer's expert parameters).

    Checked (tests/train/test_moe_memory.py) against the two-layer Mixtral-8x7B slice on one H200 (issue 35:
    49.9 GiB peak allocated at micro batch 2, 50.3 at 4: the end of the backward pass binds, hence the small
    growth with the micro batch) and moe-0.9b (README: 20.5 / 28.9 / 45.5 GiB at micro batch 4 / 8 / 16: the
    end of the forward pass binds). Dense models and FSDP2 keep the all-at-once sum, which their measurements
    (Llama 1.1B) were checked against. DDP's gradient buckets (4 bytes a parameter) are there in both phases.
    """
    h, V, L = config.hidden_size, config.vocab_size or 32000, config.num_layers
    tp_pp = config.tensor_model_parallel_size * config.pipeline_model_parallel_size
    local, layer_experts = total / tp_pp, counts["mlp"] / tp_pp
    mixed = config.precision == "bf16-mixed"
    world = config.world_size
    buckets = 4 * local if world > 1 and resolve_strategy(config, world, V) == "ddp" else 0.0
    layer_acts = per_layer + (tokens * 4 * h if mixed else 0.0)
    stored = 2 * h * tokens * L + layer_acts if config.activation_checkpointing else layer_acts * L
    logits = tokens * V * 10 / config.tensor_model_parallel_size
    copies = 2 * local if mixed else 0.0
    forward_end = copies + stored + logits
    acts_note = (
        f"activations: {layer_acts / tokens / 1024:.0f} KiB a token and layer x {tokens:.0f} tokens x {L} layers"
        + (
            " (activation checkpointing: layer inputs only, one layer recomputed)"
            if config.activation_checkpointing
            else ""
        )
        + f" + logits in the loss {logits / GIB:.2f} GiB"
    )
    grad_transient = c * layer_experts if mixed else 0.0
    backward_end = w * local + grad_transient + layer_acts
    if backward_end >= forward_end:
        note = (
            "peak: the end of the backward pass (all gradients, the first layer's activations"
            + (", its expert gradients in bf16" if mixed else "")
            + f"); the end of the forward pass needs {(backward_end - forward_end) / GIB:.1f} GiB less"
        )
        return w * local, w * local, grad_transient + buckets, layer_acts, note, acts_note
    note = (
        "peak: the end of the forward pass (no gradients: zero_grad frees them; all activations, the loss's "
        f"logits{', bf16 weight copies' if mixed else ''}); the end of the backward pass needs "
        f"{(forward_end - backward_end) / GIB:.1f} GiB less"
    )
    return w * local, 0.0, copies + buckets, stored + logits, note, acts_note


def check_memory(
    config: TrainConfig, gpu_memory_gib: float | None = None, world_size: int | None = None
) -> MemoryPlan | None:
    """Refuse (``ParallelismError``, like check_parallelism) a GPU layout whose memory per GPU does not fit.

    The GPU's memory: ``config.gpu_memory_gib``, else ``gpu_memory_gib`` (the executor's); unknown or on CPU:
    nothing to check (None). Call it after check_parallelism: it assumes the sizes divide."""
    memory = config.gpu_memory_gib or gpu_memory_gib
    if not memory or not config.gpus_per_node:
        return None
    plan = plan_memory(config, gpu_memory_gib=memory, world_size=world_size)
    if not plan.fits_without_snapshot:  # without the snapshot's room the trainer saves without it (one line)
        raise ParallelismError("invalid training configuration:\n  - " + memory_error(plan, config))
    return plan


def memory_error(plan: MemoryPlan, config: TrainConfig) -> str:
    """One refusal: the memory per GPU against the GPU's, what would fit (the same check), and the arithmetic."""
    memory = plan.gpu_memory_gib

    def needs(**update) -> float:
        return plan_memory(config.model_copy(update=update), gpu_memory_gib=memory).total / GIB

    def divides(nodes: int) -> bool:
        """The other rules of check_parallelism hold at this node count (batch and expert split)."""
        model_parallel = config.tensor_model_parallel_size * config.pipeline_model_parallel_size
        world = nodes * config.procs_per_node
        if world % (model_parallel * config.context_parallel_size):
            return False
        dp = world // (model_parallel * config.context_parallel_size)
        return not (
            config.global_batch_size % (config.micro_batch_size * dp)
            or (dp * config.context_parallel_size) % config.expert_model_parallel_size
        )

    def fewest_nodes(**update) -> int | None:
        candidates = (n for n in range(config.num_nodes + 1, 1025) if divides(n))
        return next((n for n in candidates if needs(num_nodes=n, **update) <= memory), None)

    options = []
    if not config.activation_checkpointing and needs(activation_checkpointing=True) <= memory:
        options.append(f"activation_checkpointing true ({needs(activation_checkpointing=True):.1f} GiB)")
    if config.micro_batch_size > 1 and needs(micro_batch_size=1) <= memory:
        options.append(f"micro_batch_size 1 ({needs(micro_batch_size=1):.1f} GiB)")
    nodes = fewest_nodes()
    if nodes is not None:
        options.append(f"num_nodes {nodes} ({needs(num_nodes=nodes):.1f} GiB)")
    if not config.activation_checkpointing:
        nodes_ac = fewest_nodes(activation_checkpointing=True)
        if nodes_ac is not None and (nodes is None or nodes_ac < nodes):
            options.append(
                f"num_nodes {nodes_ac} with activation_checkpointing true "
                f"({needs(num_nodes=nodes_ac, activation_checkpointing=True):.1f} GiB)"
            )
    fix = ("; it fits with " + ", or ".join(options)) if options else ""
    return (
        f"the layout needs {plan.total / GIB:.1f} GiB per GPU but a GPU has {memory:.1f} GiB{fix}\n    "
        + plan.report().replace("\n", "\n    ")
    )
