"""The seed's Mixtral-8x7B on a cluster preset: layout, memory per GPU, and a refusal with the arithmetic.

``nemoflow render`` builds the pretrain job as the stage submits it (Slurm preset hcc-a3m: 8 x H100 80GB a
node; Kubernetes with GPU node labels) and states the layout's memory per GPU (infra/configs/memory_plan.py);
a layout that does not fit is refused before anything is written, naming what would fit.
"""

from __future__ import annotations

import re

import pytest
import yaml

from infra.configs.memory_plan import GIB, RESERVE_GIB, executor_gpu_memory_gib, plan_memory
from infra.configs.train import TrainConfig
from nemoflow.cli import main as cli

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json) at the seed's sequence length.
MIXTRAL_8X7B = dict(
    arch="mixtral",
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    ffn_hidden_size=14336,
    num_moe_experts=8,
    moe_router_topk=2,
    seq_length=4096,
    micro_batch_size=1,
    global_batch_size=512,
    max_steps=1000,
    gpus_per_node=8,
    expert_model_parallel_size=8,
)
DATA = {
    "sources": "https://data.example.com/train/chunk{chunk}/example_train_{shard}.jsonl.zst",
    "chunks": "1",
    "shards": "0-15",
}


@pytest.fixture
def work_dir(monkeypatch):
    """The run's work directory (shared storage on Slurm, the workspace PVC on Kubernetes), as settings read it."""
    from infra.settings import reload_settings

    def use(path: str) -> None:
        monkeypatch.setenv("NEMOFLOW_WORK_DIR", path)
        reload_settings()

    yield use
    monkeypatch.undo()
    reload_settings()


LLAMA_1_1B = dict(hidden_size=2048, num_layers=16, num_attention_heads=16, num_key_value_heads=8, ffn_hidden_size=8192)


def _built_on_meta(config: TrainConfig, vocab: int) -> tuple[int, int]:
    """(parameters, parameters of one layer's experts) of the transformers model with ``config``'s shape, built
    on the meta device (no memory): the count comes from the real modules, not from the plan's formulas."""
    import torch
    import transformers

    shape = dict(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        tie_word_embeddings=False,
    )
    if config.experts:
        cls = transformers.MixtralForCausalLM
        hf = transformers.MixtralConfig(
            **shape, num_local_experts=config.experts, num_experts_per_tok=config.moe_router_topk
        )
    else:
        cls, hf = transformers.LlamaForCausalLM, transformers.LlamaConfig(**shape)
    with torch.device("meta"):
        model = cls(hf)
    total = sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].mlp.experts if config.experts else None
    return total, sum(p.numel() for p in experts.parameters()) if experts is not None else 0


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "llama-1.1b"])
def test_parameters_are_the_models_own(shape):
    """The plan's parameter counts are those of the transformers model of that shape (built on the meta device);
    for Mixtral-8x7B they round to Mistral's published 46.7B, 12.9B of them active per token."""
    if shape == "mixtral-8x7b":
        config = TrainConfig(**MIXTRAL_8X7B, data_prefix=["/d"], num_nodes=4)
    else:
        config = TrainConfig(**LLAMA_1_1B, seq_length=2048, micro_batch_size=4, global_batch_size=8, max_steps=1)
    plan = plan_memory(config, vocab_size=32000)
    total, experts = _built_on_meta(config, 32000)
    assert plan.parameters == total
    if config.experts:  # a token passes through top-k of the E experts of each layer
        inactive = config.num_layers * experts * (config.experts - config.moe_router_topk) // config.experts
        assert plan.active_parameters == total - inactive
        assert (round(total / 1e9, 1), round((total - inactive) / 1e9, 1)) == (46.7, 12.9)
    else:
        assert plan.active_parameters == total
    # one GPU, bf16-mixed: fp32 weights, fp32 gradients, AdamW's m and v in fp32 = 16 bytes a parameter
    if config.world_size == 1 and config.precision == "bf16-mixed":
        assert plan.weights + plan.gradients + plan.optimizer == 16 * total


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("gpus", [1, 2])
def test_estimate_is_at_most_ten_percent_above_the_peak_measured_here(tmp_path, train_dataset, gpus):
    """The plan against the peak measured in this run (the trainer logs ``peak_mem_gib``: CUDA's max allocated):
    Llama 1.1B, seq 2048, micro batch 4, on 1 and 2 GPUs. Never a number copied from the README."""
    import torch

    from tests.train.helpers import read_metrics, run_trainer, tiny_config, write_config

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} NVIDIA GPU(s); this machine has {torch.cuda.device_count()}")
    run_dir = tmp_path / "run"
    overrides = dict(seq_length=2048, micro_batch_size=4, global_batch_size=4 * gpus, max_steps=4, gpus_per_node=gpus)
    config = tiny_config(train_dataset, run_dir, **LLAMA_1_1B, **overrides, val_check_interval=1000)
    config.update(ckpt_every_n_steps=1000, limit_val_batches=0)
    done = run_trainer(write_config(config, tmp_path / "config.json"), timeout=900, nproc=gpus)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    peaks = [m["peak_mem_gib"] for m in read_metrics(run_dir) if "peak_mem_gib" in m]
    assert peaks, "the trainer logged no peak_mem_gib"
    measured = max(peaks)
    estimate = plan_memory(TrainConfig(**config)).total / GIB - RESERVE_GIB  # the allocator does not count the reserve
    print(f"{gpus} GPU(s): measured peak {measured:.1f} GiB, plan {estimate:.1f} GiB")
    assert measured <= estimate <= 1.1 * measured


def _render(tmp_path, executor: dict, **train) -> tuple[int, str, dict[str, str]]:
    config = {"executor": executor, "image": {"source": "nvcr.io/nvidia/nemo:25.02"}, "data": DATA}
    config["train"] = {**MIXTRAL_8X7B, **train}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    return (
        cli(["render", "--config", str(path), "--out", str(out)]),
        str(out),
        ({p.name: p.read_text() for p in out.iterdir()} if out.exists() else {}),
    )


HCC_A3M = {"kind": "slurm", "preset": "hcc-a3m", "account": "llm"}


def _components(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"^\s+(\w+)\s+([\d.]+)", text, re.M)}


def test_seed_mixtral_8x7b_renders_on_hcc_a3m_with_its_layout_and_memory(tmp_path, capsys, work_dir):
    work_dir("/shared/nemoflow")
    code, _, files = _render(tmp_path, HCC_A3M, num_nodes=4)
    assert code == 0, capsys.readouterr().err
    (train,) = [text for name, text in files.items() if name.startswith("train-") and name.endswith(".sbatch")]
    assert "#SBATCH --nodes=4" in train and "#SBATCH --gpus-per-node=8" in train
    assert "--nproc-per-node=8" in train and "-m workloads.train" in train
    plan = files["train-memory-plan.txt"]
    assert "layout: nodes 4, gpus 32, TP 1, PP 1, CP 1, EP 8, DP 32" in plan
    assert "micro_batch 1, seq 4096, strategy fsdp2" in plan
    parts = _components(plan)
    assert {"weights", "gradients", "optimizer", "working", "activations", "reserve", "total"} <= set(parts)
    listed = sum(v for k, v in parts.items() if k != "total")
    assert parts["total"] == pytest.approx(listed, abs=0.2)  # the lines add up (each rounded to 0.1)
    assert parts["total"] <= 79.6 and "of 79.6: fits" in plan  # an H100 80GB as CUDA reports it
    assert plan in capsys.readouterr().err  # the reviewer sees it too


def test_a_layout_that_does_not_fit_is_refused_with_the_arithmetic_and_the_fix_works(tmp_path, capsys, work_dir):
    work_dir("/shared/nemoflow")
    code, out, files = _render(tmp_path, HCC_A3M, num_nodes=2)
    err = capsys.readouterr().err
    assert code == 2 and not files  # nothing written
    needed = re.search(r"the layout needs ([\d.]+) GiB per GPU but a GPU has 79.6 GiB; it fits with (.*)", err)
    assert needed, err
    assert float(needed.group(1)) > 79.6
    parts = _components(err)
    assert parts["total"] == float(needed.group(1))
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), abs=0.2)
    assert "DOES NOT FIT" in err and "EP 8, DP 16" in err
    # Each way out it names renders (the same check passes).
    fixes = needed.group(2)
    assert "activation_checkpointing true" in fixes and "num_nodes 4" in fixes
    code, _, files = _render(tmp_path / "ac", HCC_A3M, num_nodes=2, activation_checkpointing=True)
    assert code == 0 and "fits" in files["train-memory-plan.txt"]
    code, _, _ = _render(tmp_path / "n4", HCC_A3M, num_nodes=4)
    assert code == 0
    # One node cannot even hold the training state (16 bytes a parameter / 8 GPUs).
    code, _, _ = _render(tmp_path / "n1", HCC_A3M, num_nodes=1)
    assert code == 2 and "the layout needs" in capsys.readouterr().err


def test_kubernetes_gpu_labels_give_the_memory_checked(tmp_path, capsys, work_dir):
    work_dir("/nemo-workspace/nemoflow")
    h100 = {"kind": "k8s", "namespace": "llm", "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    code, _, _ = _render(tmp_path / "h100", h100, num_nodes=2)
    assert code == 2 and "but a GPU has 79.6 GiB" in capsys.readouterr().err
    # GPU feature discovery's memory label (MiB): an H200 holds the same layout.
    h200 = {"kind": "k8s", "namespace": "llm", "node_selector": {"nvidia.com/gpu.memory": "143771"}}
    code, _, files = _render(tmp_path / "h200", h200, num_nodes=2)
    assert code == 0, capsys.readouterr().err
    assert "of 140.4: fits" in files["train-memory-plan.txt"]
    assert executor_gpu_memory_gib({"kind": "k8s"}) is None  # no label: not checked


def test_the_seeds_tensor_parallel_layout_is_refused_naming_the_field(tmp_path, capsys, work_dir):
    """The seed's launcher shards 8x7B with TP 8 / EP 8 (Megatron); AutoModel's MoE model has no tensor parallel."""
    work_dir("/shared/nemoflow")
    code, _, files = _render(tmp_path, HCC_A3M, num_nodes=4, tensor_model_parallel_size=8)
    err = capsys.readouterr().err
    assert code == 2 and not files
    assert "tensor_model_parallel_size=8 is not supported with moe_impl='grouped'" in err
    assert "supported with moe_impl='grouped': 1" in err
