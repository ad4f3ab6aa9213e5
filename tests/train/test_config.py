"""The parallelism arithmetic, the blend parser and the schedule: pure functions, no torch."""

from __future__ import annotations

import pytest

from infra.configs.train import (
    ParallelismError,
    TrainConfig,
    check_parallelism,
    estimate_parameters,
    load_train_config,
    parse_blend,
    resolve_strategy,
)

BLEND = [0.7, "/d/ot_text_document", 0.3, "/d/nt_text_document"]


def config(**overrides) -> TrainConfig:
    base = dict(
        data_prefix=BLEND,
        tokenizer_model="/t/tokenizer.model",
        max_steps=100,
        hidden_size=256,
        num_attention_heads=8,
        num_layers=4,
        global_batch_size=32,
        micro_batch_size=4,
    )
    base.update(overrides)
    return TrainConfig(**base)


def test_batch_not_divisible_names_the_numbers():
    bad = config(global_batch_size=30, micro_batch_size=4, num_nodes=1, gpus_per_node=2)
    with pytest.raises(ParallelismError) as err:
        check_parallelism(bad)
    assert "global_batch_size=30 is not divisible by micro_batch_size(4) x data_parallel_size(2) = 8" in str(err.value)


def test_every_broken_rule_is_reported_at_once():
    bad = config(
        num_nodes=1,
        gpus_per_node=6,
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=1,
        num_attention_heads=6,
        hidden_size=384,
        num_key_value_heads=4,
        num_layers=3,
    )
    with pytest.raises(ParallelismError) as err:
        check_parallelism(bad)
    message = str(err.value)
    assert (
        "world size 6 (num_nodes=1 x 6 processes per node) is not divisible by tensor(4) x pipeline(1) x context(1)"
        in message
    )
    assert "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4" in message
    assert "num_attention_heads=6 is not divisible by num_key_value_heads=4" in message


def test_pipeline_and_expert_rules():
    with pytest.raises(ParallelismError, match=r"num_layers=6 is not divisible by pipeline_model_parallel_size=4"):
        check_parallelism(config(num_layers=6, pipeline_model_parallel_size=4, gpus_per_node=8))
    with pytest.raises(ParallelismError, match=r"num_moe_experts=6 is not divisible by expert_model_parallel_size=4"):
        check_parallelism(config(arch="mixtral", num_moe_experts=6, expert_model_parallel_size=4, gpus_per_node=8))
    with pytest.raises(ParallelismError, match=r"moe_router_topk=3 exceeds num_moe_experts=2"):
        check_parallelism(config(arch="mixtral", num_moe_experts=2, moe_router_topk=3))
    with pytest.raises(ParallelismError, match=r"expert_model_parallel_size=2 needs arch='mixtral'"):
        check_parallelism(config(expert_model_parallel_size=2, gpus_per_node=2))


def test_what_the_engine_cannot_run_is_named():
    """Parallelism AutoModel 0.7 does not provide fails before launch, saying so (not: checked, then ignored)."""
    with pytest.raises(
        ParallelismError, match=r"pipeline_model_parallel_size=2 is not supported by nemoflow's AutoModel trainer"
    ):
        check_parallelism(config(pipeline_model_parallel_size=2, gpus_per_node=2))
    with pytest.raises(ParallelismError, match=r"expert_model_parallel_size=2 needs moe_impl 'grouped' \(or 'auto'\)"):
        check_parallelism(
            config(arch="mixtral", num_moe_experts=4, expert_model_parallel_size=2, gpus_per_node=2, moe_impl="hf")
        )
    with pytest.raises(ParallelismError, match=r"context_parallel_size=2 is not supported for arch='mixtral'"):
        check_parallelism(config(arch="mixtral", num_moe_experts=4, context_parallel_size=2, gpus_per_node=2))
    with pytest.raises(ParallelismError, match=r"sizes \(2/1/1\) need GPUs: on CPU only data parallel \(and"):
        check_parallelism(config(tensor_model_parallel_size=2, nproc_per_node=2))
    # Tensor and context parallel on GPUs are mapped onto AutoModel (tp_size, cp_size).
    plan = check_parallelism(
        config(gpus_per_node=8, tensor_model_parallel_size=2, context_parallel_size=2, global_batch_size=8)
    )
    assert plan.data_parallel_size == 2


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ValueError) as err:
        load_train_config('{"max_step": 10, "data_prefix": ["/d/a"]}')
    assert str(err.value).startswith("unknown TrainConfig key 'max_step' (did you mean 'max_steps'?)")
    with pytest.raises(ValueError, match=r"unknown TrainConfig keys 'learning_rate', 'max_step'"):
        load_train_config('{"max_steps": 10, "max_step": 10, "learning_rate": 0.1}')
    with pytest.raises(ValueError, match=r"^not valid JSON"):
        load_train_config("{max_steps: 10}")
    with pytest.raises(ValueError, match=r"micro_batch_size: Input should be greater than or equal to 1"):
        load_train_config('{"max_steps": 10, "micro_batch_size": 0}')
    # The library's constructor rejects them too (tasks and flows build TrainConfig directly).
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        config(learning_rate=0.1)


LLAMA_134M = dict(hidden_size=768, num_layers=12, num_attention_heads=12, ffn_hidden_size=2048)
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_attention_heads=16, num_key_value_heads=8, ffn_hidden_size=8192)


def test_strategy_auto_is_ddp_for_small_dense_models_on_one_node_else_fsdp2():
    assert estimate_parameters(config(**LLAMA_134M), 32000) == 134_105_856
    assert estimate_parameters(config(**LLAMA_1B), 32000) == 1_137_772_544
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=2), world_size=2, vocab_size=32000) == "ddp"
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=8), world_size=8, vocab_size=32000) == "ddp"
    assert resolve_strategy(config(**LLAMA_1B, gpus_per_node=2), world_size=2, vocab_size=32000) == "fsdp2"
    # Several nodes, model parallel, or an MoE: FSDP2.
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=8, num_nodes=2), 16, 32000) == "fsdp2"
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=2, tensor_model_parallel_size=2), 2, 32000) == "fsdp2"
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=2, context_parallel_size=2), 2, 32000) == "fsdp2"
    assert resolve_strategy(config(arch="mixtral", gpus_per_node=2), 2, 32000) == "fsdp2"
    # The vocabulary counts: 134M's layers with a 300k vocabulary are a 545M model.
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=2), 2, 300_000) == "fsdp2"
    # Explicit choices are kept; one process is never wrapped (AutoModel's DDP would cast the weights to bf16).
    assert resolve_strategy(config(**LLAMA_1B, gpus_per_node=2, strategy="ddp"), 2, 32000) == "ddp"
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=2, strategy="fsdp2"), 2, 32000) == "fsdp2"
    assert resolve_strategy(config(**LLAMA_134M, gpus_per_node=1, strategy="ddp"), 1, 32000) == "fsdp2"


def test_unknown_strategy_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"^strategy: Input should be 'auto', 'fsdp2' or 'ddp'$"):
        load_train_config('{"max_steps": 10, "strategy": "zero3"}')
    with pytest.raises(ValueError, match=r"unknown TrainConfig key 'strategie' \(did you mean 'strategy'\?\)"):
        load_train_config('{"max_steps": 10, "strategie": "ddp"}')
    with pytest.raises(ParallelismError, match=r"strategy='ddp' keeps a whole replica .* use strategy 'fsdp2'"):
        check_parallelism(config(strategy="ddp", gpus_per_node=2, tensor_model_parallel_size=2, global_batch_size=4))


def test_ddp_recipe_has_no_fsdp2_policy_and_fsdp2_keeps_it():
    from pathlib import Path

    from workloads.train.recipe import recipe_config

    small = recipe_config(
        config(**LLAMA_134M, gpus_per_node=2, enable_compile=True), Path("/r"), 32000, world_size=2, cuda=True
    )
    # DDP: AutoModel's DDPConfig takes none of FSDP2's keys; fp32 master weights, bf16 by autocast (train()).
    assert small["distributed"] == {
        "strategy": "ddp",
        "dp_size": None,
        "tp_size": 1,
        "cp_size": 1,
        "activation_checkpointing": False,
        "find_unused_parameters": False,
    }
    assert small["model"]["torch_dtype"] == "float32"
    big = recipe_config(config(**LLAMA_1B, gpus_per_node=2), Path("/r"), 32000, world_size=2, cuda=True)
    assert big["distributed"]["strategy"] == "fsdp2"
    assert big["distributed"]["mp_policy"]["param_dtype"] == "bfloat16"
    one = recipe_config(config(**LLAMA_134M, gpus_per_node=1), Path("/r"), 32000, world_size=1, cuda=True)
    assert one["distributed"]["strategy"] == "fsdp2"
    moe = recipe_config(
        config(arch="mixtral", strategy="ddp", gpus_per_node=2, moe_impl="hf"), Path("/r"), 32000, 2, cuda=True
    )
    assert moe["distributed"]["find_unused_parameters"] is True  # the HF Mixtral's unrouted experts
    # The section is one AutoModel accepts: its own parser builds the strategy from it.
    from nemo_automodel.components.distributed.config import DDPConfig, FSDP2Config
    from nemo_automodel.recipes._dist_utils import parse_distributed_section

    assert isinstance(parse_distributed_section(small["distributed"])["strategy_config"], DDPConfig)
    assert isinstance(parse_distributed_section(big["distributed"])["strategy_config"], FSDP2Config)


def test_processes_per_node_and_world_size():
    assert config(gpus_per_node=8, num_nodes=2).world_size == 16
    assert config(gpus_per_node=0, nproc_per_node=2).world_size == 2  # two gloo processes on CPU
    assert config(gpus_per_node=0).world_size == 1
    plan = check_parallelism(config(gpus_per_node=0, nproc_per_node=2, global_batch_size=8, micro_batch_size=4))
    assert (plan.world_size, plan.data_parallel_size, plan.gradient_accumulation_steps) == (2, 2, 1)


def test_valid_plan_gives_data_parallel_and_accumulation():
    plan = check_parallelism(
        config(
            num_nodes=2,
            gpus_per_node=8,
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            global_batch_size=64,
            micro_batch_size=2,
        )
    )
    # 16 GPUs / (2 x 2) = 4 data-parallel ranks; 64 / (2 x 4) = 8 micro batches each.
    assert (plan.world_size, plan.data_parallel_size, plan.gradient_accumulation_steps) == (16, 4, 8)
    cpu = check_parallelism(config(gpus_per_node=0, global_batch_size=32, micro_batch_size=4))
    assert (cpu.world_size, cpu.gradient_accumulation_steps) == (1, 8)


def test_token_budget_sets_steps():
    # The seed's arithmetic: 300,000 steps from a token budget at gbs 8 x seq 2048.
    cfg = config(
        max_steps=None, max_tokens=300_000 * 8 * 2048 + 5, global_batch_size=8, micro_batch_size=1, seq_length=2048
    )
    assert cfg.total_steps == 300_000
    with pytest.raises(ValueError, match="exactly one of max_steps and max_tokens"):
        config(max_steps=10, max_tokens=1000)


def test_blend_parsing_and_errors():
    assert parse_blend(BLEND) == (["/d/ot_text_document", "/d/nt_text_document"], [0.7, 0.3])
    assert parse_blend(["0.5", "/d/a", "0.5", "/d/b"]) == (["/d/a", "/d/b"], [0.5, 0.5])
    with pytest.raises(ValueError, match="odd length"):
        parse_blend([0.5, "/d/a", 0.5])
    with pytest.raises(ValueError, match=r"weight 'x' \(before '/d/a'\)"):
        parse_blend(["x", "/d/a", 1, "/d/b"])
    with pytest.raises(ValueError, match="is not a path prefix"):
        parse_blend([0.5, 0.5, "/d/a", "/d/b"])
    with pytest.raises(ValueError, match="split '98,2' must be three"):
        config(split="98,2")


def test_recipe_config_maps_nemo_names_onto_automodel():
    from pathlib import Path

    from workloads.train.recipe import recipe_config

    cfg = config(
        gpus_per_node=8,
        num_nodes=2,
        tensor_model_parallel_size=2,
        global_batch_size=64,
        micro_batch_size=2,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=10,
        max_steps=110,
        val_check_interval=25,
        ckpt_every_n_steps=50,
        limit_val_batches=3,
        enable_compile=True,
    )
    recipe = recipe_config(cfg, Path("/runs/x"), vocab_size=32000, world_size=16, cuda=True)
    assert recipe["step_scheduler"] | {} == {
        **recipe["step_scheduler"],
        "global_batch_size": 64,
        "local_batch_size": 2,
        "max_steps": 110,
        "ckpt_every_steps": 50,
        "val_every_steps": 25,
        "preemption_signal": ["SIGTERM", "SIGUSR1"],
    }
    assert recipe["dataset"]["paths"] == ["0.7", "/d/ot_text_document", "0.3", "/d/nt_text_document"]
    assert (recipe["dataset"]["split"], recipe["dataset"]["seed"]) == ("98,1,1", 1234)
    assert recipe["validation_dataset"]["splits_to_build"] == "validation"
    assert recipe["validation_dataset"]["num_val_samples"] == 3 * 64
    assert recipe["distributed"]["tp_size"] == 2 and recipe["distributed"]["enable_compile"] is True
    # bf16-mixed: fp32 master weights (the model's dtype), bf16 compute through FSDP2's policy, fp32 reductions.
    assert recipe["model"]["torch_dtype"] == "float32"
    assert recipe["distributed"]["mp_policy"]["param_dtype"] == "bfloat16"
    assert recipe["distributed"]["mp_policy"]["reduce_dtype"] == "float32"
    assert recipe["lr_scheduler"] == {
        "lr_decay_style": "cosine",
        "lr_warmup_steps": 10,
        "lr_decay_steps": 110,
        "init_lr": 0.0,
        "max_lr": 1e-3,
        "min_lr": 1e-4,
    }
    # Never consolidated inside the loop (workloads/consolidate.py exports after training); saved in the background.
    assert recipe["checkpoint"]["save_consolidated"] == "false" and recipe["checkpoint"]["is_async"] is True
    assert "wandb" not in recipe
    cpu = recipe_config(config(precision="bf16"), Path("/runs/y"), vocab_size=32000, world_size=1, cuda=False)
    assert cpu["model"]["torch_dtype"] == "float32" and cpu["checkpoint"]["is_async"] is True  # CPU: fp32, async too
    short = recipe_config(config(), Path("/r"), vocab_size=32000, world_size=1, cuda=True, async_save=False)
    assert short["checkpoint"]["is_async"] is False  # a node without the host memory to stage saves
    off = recipe_config(config(ckpt_async_save=False), Path("/r"), vocab_size=32000, world_size=1, cuda=True)
    assert off["checkpoint"]["is_async"] is False
    bf16 = recipe_config(
        config(precision="bf16", gpus_per_node=1), Path("/r"), vocab_size=32000, world_size=1, cuda=True
    )
    assert bf16["model"]["torch_dtype"] == "bfloat16"


def test_loss_chart_svg_scales_points_into_the_frame():
    import xml.etree.ElementTree as ET

    from tasks.train_engines.automodel import loss_chart_svg, sparkline

    metrics = [{"step": s, "loss": 10.0 - s / 2} for s in range(1, 11)] + [{"step": 10, "val_loss": 4.0}]
    svg = ET.fromstring(loss_chart_svg(metrics, width=200, height=100))
    ns = "{http://www.w3.org/2000/svg}"
    points = [tuple(map(float, p.split(","))) for p in svg.find(f"{ns}polyline").get("points").split()]
    assert len(points) == 10
    assert all(0 <= x <= 200 and 0 <= y <= 100 for x, y in points)
    assert points[0][1] < points[-1][1]  # falling loss draws downwards (SVG y grows down)
    dot = svg.find(f"{ns}circle")
    assert float(dot.get("cy")) == pytest.approx(100 - 22)  # the lowest value sits on the x axis
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"


def test_a_compiled_run_keeps_its_compile_cache_on_the_work_dir(monkeypatch, tmp_path):
    """The nightly refresh on another node reuses the kernels: the cache is on the shared work dir, not /tmp."""
    from infra.settings import get_settings
    from tasks.train_engines.automodel import AutoModel, build_train_job

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    get_settings.cache_clear()
    try:
        run_dir = str(tmp_path / "runs" / "r")
        compiled = build_train_job(AutoModel(enable_compile=True, max_steps=2, run_dir=run_dir))
        assert compiled.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "torch-compile")
        assert "TORCHINDUCTOR_CACHE_DIR" not in (build_train_job(AutoModel(max_steps=2, run_dir=run_dir)).env or {})
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/mine")  # the user's own wins
        assert "TORCHINDUCTOR_CACHE_DIR" not in (
            build_train_job(AutoModel(enable_compile=True, max_steps=2, run_dir=run_dir)).env or {}
        )
    finally:
        get_settings.cache_clear()


def test_a_small_state_is_saved_synchronously_and_a_large_one_in_the_background(monkeypatch):
    """Starting the background writer costs about 5 CPU-seconds of imports; a state of a few MiB is written in
    milliseconds. The threshold is per rank (fp32 weights and two AdamW moments: 12 bytes a parameter)."""
    from workloads.train import launch
    from workloads.train.launch import async_save_fits

    # a node with room for the 1.1B model's staging copy, whatever this machine has free
    monkeypatch.setattr(launch, "host_memory_available", lambda: 64 * 2**30)

    tiny = dict(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128, max_steps=4
    )
    small, why = async_save_fits(TrainConfig(**tiny, run_dir="/r"), vocab_size=32000, world_size=1, cuda=False)
    assert small is False
    assert why.startswith("checkpoints are saved synchronously: ") and "ckpt_async_min_mib=256" in why
    forced, why = async_save_fits(
        TrainConfig(**tiny, run_dir="/r", ckpt_async_min_mib=0), vocab_size=32000, world_size=1, cuda=False
    )
    assert (forced, why) == (True, None)
    big = TrainConfig(
        hidden_size=2048, num_layers=16, num_attention_heads=16, ffn_hidden_size=8192, max_steps=4, run_dir="/r"
    )
    assert async_save_fits(big, vocab_size=32000, world_size=1, cuda=False)[0] is True  # 1.1B: 13 GB a save


def test_skipping_saves_while_writing_needs_background_saves():
    tiny = dict(max_steps=4, data_prefix=["/d"], tokenizer_model="/t", run_dir="/r")
    assert TrainConfig(**tiny, ckpt_while_writing="skip").ckpt_while_writing == "skip"
    for other in ({"ckpt_async_save": False}, {"ckpt_snapshots": True}):
        with pytest.raises(ValueError, match="ckpt_while_writing: skip skips a save while a background save"):
            TrainConfig(**tiny, ckpt_while_writing="skip", **other)
