"""The grouped Mixtral's MoE step without device-to-host syncs, and with today's numbers (issue 35).

On a GPU, an operator whose output size depends on the data (a boolean mask's ``nonzero``, ``bincount``,
``.item()``, ``.tolist()``) makes the host wait for the GPU before it can queue the next kernel; AutoModel's
token permutation made six of them a layer and step. Here, on CPU, :class:`HostSyncs` records every call of
those operators (a ``TorchDispatchMode`` sees each aten call, the backward's included; ``tolist``/``numpy``/
``cpu`` read memory without an aten call, so they are counted by wrapping them): the test of the MoE layer
fails when one comes back, and the same detector counts AutoModel's own path, so it is known to see them.

The numbers are AutoModel's: the same layer output and gradients, the same first loss and gradient norm of
the whole model, and within a tight tolerance of transformers' Mixtral (``moe_impl: hf``) over 20 steps from
the same weights. All in fp32 on CPU (``torch._grouped_mm`` has a CPU kernel); what only the GPU shows (bf16
kernels, CUDA's own syncs, the speed) is measured by benchmarks/bench_train_gpu.py with its sync profile.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.tiny_models import tiny_mixtral_config

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")

# aten operators whose CUDA kernels wait for the device: a result size or a Python value read from the data.
SYNCING_OPS = {
    "aten._local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.argwhere",
    "aten.masked_select",
    "aten.bincount",  # sizes its output by the largest value
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
}
INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


class HostSyncs(TorchDispatchMode):
    """Counts, by name, the operator calls under it that would sync a CUDA device with its host."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self._patched: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNCING_OPS:
            self.calls[name] += 1
        elif name == "aten.repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) == 1:
            self.calls["aten.repeat_interleave (no output_size)"] += 1
        elif name in INDEX_OPS and _has_mask_index(args):
            self.calls[f"{name} (boolean mask: nonzero)"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for method in ("tolist", "numpy", "cpu"):
            real = getattr(torch.Tensor, method)
            self._patched.append((method, real))
            setattr(torch.Tensor, method, self._counting(method, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for method, real in self._patched:
            setattr(torch.Tensor, method, real)
        self._patched.clear()
        return super().__exit__(*exc)

    def _counting(self, method, real):
        def call(tensor, *args, **kwargs):
            self.calls[f"Tensor.{method}"] += 1
            return real(tensor, *args, **kwargs)

        return call


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


@pytest.fixture
def eager():
    """AutoModel's @torch.compile'd activation runs eagerly (no inductor build on CPU; the dispatch mode sees it)."""
    torch.compiler.set_stance("force_eager")
    yield
    torch.compiler.set_stance("default")


def _config(**overrides):
    values = dict(vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)
    values["architectures"] = ["MixtralForCausalLM"]
    return tiny_mixtral_config(**{**values, **overrides})


def _grouped_model(config, seed: int = 0):
    from nemo_automodel.components.models.common import BackendConfig

    from infra.configs.moe import backend_config
    from workloads import moe_model

    torch.manual_seed(seed)
    config.torch_dtype = torch.float32
    model = moe_model.MixtralForCausalLM(config, backend=BackendConfig(**backend_config(cuda=False)))
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    return model


def _upstream(monkeypatch):
    """Make every layer take AutoModel's own path (the grouped path as it was before issue 35)."""
    from workloads.moe_model import AutocastGroupedExperts

    monkeypatch.setattr(AutocastGroupedExperts, "dispatches_on_device", lambda self: False)


def _layer_step(mlp, x, token_mask):
    """The MoE block's forward and backward as the decoder layer runs it (router, experts), on one input."""
    x = x.clone().requires_grad_()
    weights, indices, _ = mlp.gate(x, token_mask, None)
    y = mlp.experts(x, token_mask, weights, indices)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)))
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}


def test_moe_layer_forward_and_backward_make_no_host_sync(eager, monkeypatch):
    model = _grouped_model(_config())
    mlp = model.model.layers["0"].mlp
    assert mlp.experts.dispatches_on_device()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(64, dtype=torch.bool)
    with HostSyncs() as syncs:
        _layer_step(mlp, x, mask)
    assert dict(syncs.calls) == {}
    # The detector sees the syncs of AutoModel's permutation (boolean masks), forward and backward.
    mlp.zero_grad()
    _upstream(monkeypatch)
    with HostSyncs() as upstream:
        _layer_step(mlp, x, mask)
    assert sum(upstream.calls.values()) >= 4, upstream.calls
    assert any("boolean mask" in name for name in upstream.calls), upstream.calls


def test_whole_model_step_makes_no_host_sync_in_its_moe_layers(eager, monkeypatch):
    """The model's forward and backward (2 MoE layers): what remains outside the MoE layers is counted as zero too."""
    model = _grouped_model(_config())
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))

    def step():
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    with HostSyncs() as syncs:
        step()
    assert dict(syncs.calls) == {}
    _upstream(monkeypatch)
    with HostSyncs() as upstream:
        step()
    layers = len(model.model.layers)
    assert sum(upstream.calls.values()) >= 4 * layers, upstream.calls


@pytest.mark.parametrize("masked", [0, 5])
def test_layer_output_and_gradients_are_autmodels(eager, monkeypatch, masked):
    """Same router and experts, same input: the sync-free dispatch gives AutoModel's output and gradients,
    also for masked tokens (their assignments weighted 0 instead of dropped: their output is 0 either way)."""
    model = _grouped_model(_config())
    mlp = model.model.layers["1"].mlp
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(48, dtype=torch.bool)
    mask[torch.randperm(48, generator=torch.Generator().manual_seed(4))[:masked]] = False
    ours = _layer_step(mlp, x, mask)
    mlp.zero_grad(set_to_none=True)
    _upstream(monkeypatch)
    theirs = _layer_step(mlp, x, mask)
    y, x_grad, grads = ours
    y0, x_grad0, grads0 = theirs
    if not masked:  # the same operations in the same order: the same bits
        assert torch.equal(y, y0) and torch.equal(x_grad, x_grad0)
        assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
    else:
        assert torch.equal(y[~mask], torch.zeros_like(y[~mask])) and torch.equal(y0[~mask], y[~mask])
        torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x_grad, x_grad0, rtol=1e-6, atol=1e-6)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-5, atol=1e-6, msg=name)
    assert grads.keys() == grads0.keys() and "experts.gate_and_up_projs" in grads


def test_moe_block_compiles_as_one_graph(monkeypatch):
    """Static shapes: torch.compile traces the MoE block forward and backward whole (``fullgraph=True``; the
    aot_eager backend, which needs no compiler: the same graph capture as the trainer's per-layer compile).
    AutoModel's boolean masks make the token count data-dependent: its block breaks the graph."""
    model = _grouped_model(_config())
    mlp = model.model.layers["0"].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    block = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch._grouped_mm's traced form takes bf16 only
        y = block(x.clone().requires_grad_())
        eager = mlp(x.clone())
    y.float().square().sum().backward()
    assert mlp.experts.gate_and_up_projs.grad.abs().sum() > 0
    torch.testing.assert_close(y, eager, rtol=2**-7, atol=1e-4)  # decompositions round bf16 differently
    _upstream(monkeypatch)
    torch._dynamo.reset()
    block = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="data-dependent"), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x.clone())
    torch._dynamo.reset()


def _loss_and_grad_norm(model, ids) -> tuple[float, float]:
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.item(), norm.item()


def test_first_loss_and_grad_norm_are_todays_grouped_paths(eager, monkeypatch):
    ids = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(6))
    ours = _loss_and_grad_norm(_grouped_model(_config()), ids)
    _upstream(monkeypatch)
    today = _loss_and_grad_norm(_grouped_model(_config()), ids)
    assert ours == today  # bit for bit: same kernels on the same numbers in the same order


def test_twenty_steps_track_transformers_mixtral_from_the_same_weights(eager, tmp_path):
    """``moe_impl: grouped`` (sync-free) against ``moe_impl: hf`` (transformers' Mixtral), same weights, batches
    and AdamW, in fp32: the loss curves agree to fp32 rounding (the issue asks bf16 tolerance on the GPU) over 20 steps."""
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    from workloads.moe_model import mixtral_layout_checkpoint

    config = _config()
    torch.manual_seed(11)
    reference = MixtralForCausalLM(config).float()
    reference.save_pretrained(tmp_path / "hf")
    converted = mixtral_layout_checkpoint(str(tmp_path / "hf"), tmp_path / "cache")
    disk = {}  # Mixtral's per-expert layout (transformers writes it, or an older one the fused one, converted)
    for file in sorted(Path(converted).glob("*.safetensors")):
        disk.update(load_file(str(file)))
    model = _grouped_model(_config())
    missing, unexpected = model.load_state_dict(model.state_dict_adapter.from_hf(disk), strict=True)
    assert not missing and not unexpected

    # Four batches, seen five times each: a curve that falls (random tokens never seen twice would not).
    batches = torch.randint(0, 512, (4, 4, 48), generator=torch.Generator().manual_seed(12)).unbind()
    curves = []
    for m in (model, reference):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        losses = []
        for step in range(20):
            ids = batches[step % len(batches)]
            losses.append(_loss_and_grad_norm(m, ids)[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
        curves.append(losses)
    ours, hf = curves
    assert ours[-1] < ours[0] - 0.1  # it trains
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, hf, strict=True))
    print(f"20 steps: losses {ours[0]:.4f} -> {ours[-1]:.4f}, largest relative difference to hf {worst:.2e}")
    assert worst < 1e-5, (worst, ours, hf)


# ------------------------------------------------------------------------------------------- on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run it on a GPU machine)")


def _gpu_model():
    """moe-0.9b's layer shape (hidden 1024, 8 experts of 2816, top-2), 2 layers, fp32 weights on the GPU."""
    config = _config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_local_experts=8,
        max_position_embeddings=2048,
    )
    from nemo_automodel.components.models.common import BackendConfig

    from infra.configs.moe import backend_config
    from workloads import moe_model

    torch.manual_seed(0)
    config.torch_dtype = torch.float32
    model = moe_model.MixtralForCausalLM(config, backend=BackendConfig(**backend_config(cuda=True)))
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    return model.cuda()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_on_the_gpu_the_moe_block_never_waits_for_the_device(compiled):
    """bf16-mixed as the trainer runs it (fp32 weights, bf16 autocast), eager and torch.compile'd: under
    ``torch.cuda.set_sync_debug_mode("error")`` any device-to-host sync in the MoE block raises."""
    model = _gpu_model()
    mlp = model.model.layers["0"].mlp
    block = torch.compile(mlp) if compiled else mlp
    x = torch.randn(4 * 2048, 1024, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(x.clone().requires_grad_())
        y.float().square().mean().backward()

    step()  # compiles, autotunes, allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert mlp.experts.gate_and_up_projs.grad.isfinite().all()


@pytest.mark.gpu
@cuda
def test_on_the_gpu_a_whole_model_step_never_waits_for_the_device():
    """Forward, loss and backward of the whole grouped Mixtral (a sync here outside the MoE blocks is named
    by the error: the test says where the step still waits, not only whether)."""
    model = _gpu_model()
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids)
            logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:]).backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The profile the README's 216 came from (torch.profiler over 3 steps). What makes the host wait is the CUDA
    # runtime's synchronizing calls: an aten::item (or nonzero, bincount) on a GPU tensor issues one
    # (cudaMemcpyAsync to the host, then cudaStreamSynchronize). aten::item on a CPU scalar does not: the H200
    # run at 59069c5 counted 15 of those in 3 steps and no synchronizing call (and the "error" mode above raised
    # nothing), so the aten names are printed for the record, and the runtime calls are what is asserted.
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    aten = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense", "aten::bincount")
    # (not cudaDeviceSynchronize: the profiler's own stop may issue it; the model's operators sync streams)
    runtime = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
    events = prof.key_averages()
    print(f"aten calls that sync when their tensor is on the GPU, 3 steps: {_counts(events, aten) or 0}")
    syncs = _counts(events, runtime)
    print(f"the CUDA runtime's synchronizing calls in 3 steps of a 2-layer grouped Mixtral: {syncs or 0}")
    # where each comes from, when one does
    stacks = {
        f"{e.key} x{e.count}: " + " <- ".join(e.stack[:6])
        for e in prof.key_averages(group_by_stack_n=6)
        if e.key in runtime + aten
    }
    assert not syncs, "\n".join(sorted(stacks))


def _counts(events, names) -> dict[str, int]:
    return {e.key: e.count for e in events if e.key in names}


def test_the_rotary_frequencies_move_with_the_model():
    """AutoModel's RotaryEmbedding is no buffer: it computes its frequencies once on ``rotary_emb.device`` and
    caches them, so a model initialized on one device and then moved (``initialize_weights(cpu)`` and
    ``.cuda()``, as the GPU sync test builds it) copied them from host memory in every forward: the one
    synchronizing operation the H200 found in a whole grouped-Mixtral step at fc7500e (rope_utils.py,
    ``inv_freq.to(device)``). The model's moves now carry them, as they carry buffers; "meta" stands in for
    the GPU here (any device but the one it was initialized on)."""
    model = _grouped_model(_config())
    rotary = model.model.rotary_emb
    assert rotary._compute_concentration_and_inv_freq()[1].device.type == "cpu"  # computed and cached on the CPU
    model.to("meta")
    assert rotary._compute_concentration_and_inv_freq()[1].device.type == "meta"
    model.to(torch.float64)  # a dtype-only move leaves the device
    assert rotary._compute_concentration_and_inv_freq()[1].device.type == "meta"
