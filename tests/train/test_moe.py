"""Mixtral on NeMo AutoModel's MoE layers (moe_impl 'grouped', workloads/moe_model.py) against transformers' Mixtral.

The trainer runs as the pipeline runs it (``python -m workloads.train``, torchrun with 2 gloo processes), on
the KJV dataset, all from one checkpoint written by today's path (``moe_impl='hf'``: transformers'
``MixtralForCausalLM``, whose export holds the fused expert layout):

* ``hf``   one process, moe_impl 'hf';
* ``one``  one process, moe_impl 'grouped' (the checkpoint converted to Mixtral's per-expert layout on the way in);
* ``ep2``  two gloo ranks, expert_model_parallel_size 2 (each rank holds 2 of the 4 experts; the rest FSDP2);
* ``ddp``  two gloo ranks, strategy ddp (a replica per rank).

Global batch 8 each time (one process: 2 micro batches of 4; two ranks: 4 each).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.configs.train import ParallelismError, TrainConfig, check_parallelism
from tests.support.tiny_models import tiny_mixtral_config
from tests.train.helpers import read_metrics, run_trainer, tensor_layout, tiny_config, write_config
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")

TINY_MOE = dict(arch="mixtral", num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=96)


def moe_config(**overrides) -> TrainConfig:
    values = dict(
        arch="mixtral",
        num_moe_experts=8,
        max_steps=10,
        global_batch_size=16,
        data_prefix=["/d/x"],
        tokenizer_model="/t.model",
    )
    values.update(overrides)
    return TrainConfig(**values)


# ------------------------------------------------------------------------------------------- configuration
def test_expert_parallel_needs_the_grouped_implementation():
    with pytest.raises(ParallelismError) as err:
        check_parallelism(moe_config(moe_impl="hf", expert_model_parallel_size=2, gpus_per_node=2))
    message = str(err.value)
    assert "expert_model_parallel_size=2 needs moe_impl 'grouped' (or 'auto')" in message
    assert "supported with moe_impl='hf': 1" in message
    # The grouped implementation (and auto, which is grouped) runs it, on GPUs and on CPU (gloo).
    for impl in ("grouped", "auto"):
        assert check_parallelism(moe_config(moe_impl=impl, expert_model_parallel_size=2, gpus_per_node=2))
    plan = check_parallelism(moe_config(expert_model_parallel_size=2, nproc_per_node=2))
    assert plan.data_parallel_size == 2


def test_what_each_moe_implementation_cannot_run_is_refused_naming_the_field():
    cases = {
        # transformers' MoE grouped_mm fallback crashes under torch.compile (the issue's GuardOnDataDependentSymNode)
        "enable_compile=true with moe_impl='hf' crashes in torch.compile": moe_config(
            moe_impl="hf", enable_compile=True, gpus_per_node=1
        ),
        "moe_aux_loss_coeff=0.01 needs moe_impl 'grouped'": moe_config(moe_impl="hf", moe_aux_loss_coeff=0.01),
        "tensor_model_parallel_size=2 is not supported with moe_impl='grouped'": moe_config(
            tensor_model_parallel_size=2, gpus_per_node=2
        ),
        "hidden_size=100 must be a multiple of 8 with moe_impl='grouped'": moe_config(
            hidden_size=100, num_attention_heads=2
        ),
        "enable_compile=true with moe_impl='grouped' needs GPUs": moe_config(enable_compile=True),
        "precision='32' with moe_impl='grouped'": moe_config(precision="32", gpus_per_node=1),
        "expert_model_parallel_size=4 does not divide data_parallel_size(2) x context_parallel_size(1) = 2": moe_config(
            expert_model_parallel_size=4, gpus_per_node=4, tensor_model_parallel_size=2, moe_impl="hf"
        ),
        "strategy='ddp' keeps a whole replica": moe_config(
            strategy="ddp", expert_model_parallel_size=2, gpus_per_node=2
        ),
        "moe_impl='grouped' needs arch='mixtral'": moe_config(arch="llama", moe_impl="grouped"),
    }
    for expected, config in cases.items():
        with pytest.raises(ParallelismError) as err:
            check_parallelism(config)
        assert expected in str(err.value), (expected, str(err.value))
    # What each runs: compile with the grouped experts on GPUs, tensor parallel with the HF model, hf on CPU.
    assert check_parallelism(moe_config(enable_compile=True, gpus_per_node=1))
    assert check_parallelism(moe_config(moe_impl="hf", tensor_model_parallel_size=2, gpus_per_node=2))
    assert check_parallelism(moe_config(moe_impl="hf", hidden_size=100, num_attention_heads=2))


def test_recipe_builds_the_grouped_model_or_the_hf_model():
    from workloads.train.recipe import recipe_config

    grouped = recipe_config(moe_config(expert_model_parallel_size=2, gpus_per_node=2), Path("/r"), 32000, 2, cuda=True)
    model = grouped["model"]
    assert "force_hf" not in model
    assert model["config"]["architectures"] == ["MixtralForCausalLM"]
    assert model["backend"]["experts"] == "torch_mm" and model["backend"]["attn"] == "sdpa"
    assert grouped["distributed"]["ep_size"] == 2 and grouped["distributed"]["strategy"] == "fsdp2"

    hf = recipe_config(moe_config(moe_impl="hf", gpus_per_node=2), Path("/r"), 32000, 2, cuda=True)
    assert hf["model"]["force_hf"] is True and "backend" not in hf["model"] and "ep_size" not in hf["distributed"]
    # DDP must search for experts without gradients only in the HF model (grouped experts are one tensor a layer).
    ddp = {impl: moe_config(moe_impl=impl, strategy="ddp", gpus_per_node=2) for impl in ("hf", "grouped")}
    assert recipe_config(ddp["hf"], Path("/r"), 32000, 2, cuda=True)["distributed"]["find_unused_parameters"]
    assert not recipe_config(ddp["grouped"], Path("/r"), 32000, 2, cuda=True)["distributed"]["find_unused_parameters"]
    aux = recipe_config(moe_config(moe_aux_loss_coeff=0.01), Path("/r"), 32000, 1, cuda=False)
    assert aux["model"]["moe_overrides"] == {"aux_loss_coeff": 0.01}


# ------------------------------------------------------------------------------------------- the model itself
def _tiny_hf_config(**overrides):
    values = dict(
        vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False, architectures=["MixtralForCausalLM"]
    )
    return tiny_mixtral_config(**{**values, **overrides})


@pytest.fixture
def eager():
    """AutoModel's @torch.compile'd MoE helpers run eagerly, as the trainer runs them on CPU (no inductor build)."""
    import torch

    torch.compiler.set_stance("force_eager")
    yield
    torch.compiler.set_stance("default")


def _grouped_model(config, aux_loss_coeff: float = 0.0):
    import torch
    from nemo_automodel.components.models.common import BackendConfig

    from infra.configs.moe import backend_config
    from workloads import moe_model

    config.torch_dtype = torch.float32
    model = moe_model.MixtralForCausalLM(
        config,
        backend=BackendConfig(**backend_config(cuda=False)),
        moe_overrides={"aux_loss_coeff": aux_loss_coeff},
    )
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    return model


def _logits(model, ids):
    import torch

    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_experts_under_autocast_compute_in_the_autocast_dtype(eager):
    """bf16-mixed on one GPU is fp32 weights under bf16 autocast: torch._grouped_mm is no autocast op, so the
    experts cast their input themselves (else they would run in fp32). Checked with CPU autocast."""
    import torch

    torch.manual_seed(0)
    model = _grouped_model(_tiny_hf_config())
    experts = model.model.layers["0"].mlp.experts
    seen = []
    real = torch._grouped_mm

    def spy(a, b, *args, **kwargs):
        seen.append((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    torch._grouped_mm = spy
    try:
        x = torch.randn(16, 64)
        mask = torch.ones(16, dtype=torch.bool)
        weights, indices, _ = model.model.layers["0"].mlp.gate(x, mask, None)
        assert experts(x, mask, weights, indices).dtype == torch.float32 and seen == [(torch.float32,) * 2] * 2
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert experts(x, mask, weights, indices).dtype == torch.bfloat16
        assert seen == [(torch.bfloat16,) * 2] * 2
    finally:
        torch._grouped_mm = real


def test_load_balancing_loss_reaches_the_router_gradient(eager):
    """moe_aux_loss_coeff > 0 adds AutoModel's load-balancing loss: the router's gradient changes, the experts' do not."""
    import torch

    grads = []
    for coeff in (0.0, 0.1):
        torch.manual_seed(0)
        model = _grouped_model(_tiny_hf_config(), aux_loss_coeff=coeff)
        model.train()
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        logits = model(ids)
        logits = logits.logits if hasattr(logits, "logits") else logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        layer = model.model.layers["1"].mlp  # the last layer: nothing after its router adds a loss
        grads.append((layer.gate.weight.grad.clone(), layer.experts.down_projs.grad.clone()))
    (gate0, down0), (gate1, down1) = grads
    assert not torch.allclose(gate0, gate1)
    assert torch.equal(down0, down1)


# ------------------------------------------------------------------------------------------- trainer runs
@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, train_dataset):
    """Trainer runs made once each on demand: ``moe_runs("base")``, ``("hf")``, ``("one")``, ``("ep2")``, ``("ddp")``."""
    done: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("moe")
    home = root / "nemoflow-home"  # the node-local cache of converted checkpoints

    def get(name: str):
        if name in done:
            return done[name]
        run_dir = root / name / "run"
        if name == "base":
            # Today's path: transformers' Mixtral, 2 steps from its own init; the checkpoint every run starts from.
            config = tiny_config(
                train_dataset,
                run_dir,
                moe_impl="hf",
                max_steps=2,
                ckpt_every_n_steps=2,
                limit_val_batches=0,
                **TINY_MOE,
            )
            nproc = 1
        else:
            base = ckpt.latest_checkpoint(get("base")[1])
            overrides = dict(
                max_steps=4,
                ckpt_every_n_steps=4,
                val_check_interval=4,
                limit_val_batches=2,
                warmup_steps=0,
                lr=1e-3,
                seed=7,
                init_from=str(base.path),
                **TINY_MOE,
            )
            extra = {
                "hf": dict(moe_impl="hf"),
                "one": dict(moe_impl="grouped"),
                "ep2": dict(nproc_per_node=2, expert_model_parallel_size=2),  # moe_impl auto = grouped
                "ddp": dict(nproc_per_node=2, strategy="ddp", moe_impl="grouped"),
            }[name]
            config = tiny_config(train_dataset, run_dir, **overrides, **extra)
            nproc = config.get("nproc_per_node", 1)
        # The "one" run also profiles steps 2-3 (NEMOFLOW_PROFILE_STEPS): test_profile_steps_... reads the table.
        profile = {"NEMOFLOW_PROFILE_STEPS": f"{root / 'profile'}:2:2"} if name == "one" else {}
        proc = run_trainer(
            write_config(config, root / f"{name}.json"), nproc=nproc, timeout=600, NEMOFLOW_HOME=str(home), **profile
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        done[name] = (proc, run_dir, config)
        return done[name]

    return get


def test_profile_steps_writes_each_operators_time_for_the_chosen_steps(moe_runs):
    run_dir = moe_runs("one")[1]
    table = (run_dir.parents[1] / "profile" / "steps-rank0.txt").read_text()
    assert table.startswith("steps 2-3, sorted by self_cpu_time_total")
    assert "aten::mm" in table and "Self CPU" in table
    # only that run asked for it
    assert not (run_dir.parents[1] / "profile" / "steps-rank1.txt").exists()


def _curve(run_dir: Path) -> dict:
    return {(m["step"], k): m[k] for m in read_metrics(run_dir) for k in ("loss", "val_loss", "grad_norm") if k in m}


@pytest.mark.slow
def test_grouped_trains_like_the_hf_mixtral_from_the_same_weights(moe_runs):
    """From the same checkpoint and batch the two implementations give the same first loss and gradient norm."""
    hf, hf_dir, _ = moe_runs("hf")
    one, one_dir, _ = moe_runs("one")
    assert "moe_impl=hf expert_parallel=1" in hf.stdout
    assert "moe_impl=grouped expert_parallel=1" in one.stdout
    # The base checkpoint holds transformers' fused layout; the grouped run read a converted copy.
    assert "to Mixtral's per-expert layout for moe_impl 'grouped'" in one.stdout
    first_hf, first_grouped = read_metrics(hf_dir)[0], read_metrics(one_dir)[0]
    assert first_hf["step"] == first_grouped["step"] == 1
    assert first_grouped["loss"] == pytest.approx(first_hf["loss"], rel=1e-5)
    assert first_grouped["grad_norm"] == pytest.approx(first_hf["grad_norm"], rel=1e-4)
    losses = [m["loss"] for m in read_metrics(one_dir) if "loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0]  # it trains


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "ddp"])
def test_two_gloo_ranks_match_one_process(moe_runs, name):
    one, one_dir, _ = moe_runs("one")
    two, two_dir, _ = moe_runs(name)
    if name == "ep2":
        assert "moe_impl=grouped expert_parallel=2" in two.stdout and "strategy=fsdp2" in two.stdout
    else:
        assert "strategy=ddp (DistributedDataParallel)" in two.stdout
    curve, curve2 = _curve(one_dir), _curve(two_dir)
    assert curve.keys() == curve2.keys() and len([k for k in curve if k[1] == "loss"]) == 4
    for key, value in curve.items():
        assert curve2[key] == pytest.approx(value, rel=2e-4, abs=1e-5), key
    # The same checkpoint as one process writes: Mixtral's tensor names, shapes and dtypes.
    (mine,), (theirs,) = ckpt.list_checkpoints(two_dir), ckpt.list_checkpoints(one_dir)
    assert tensor_layout(mine.path) == tensor_layout(theirs.path)
    assert ckpt.verify_manifest(mine.path) == []


@pytest.mark.slow
def test_grouped_checkpoint_is_a_transformers_mixtral_with_the_training_models_logits(moe_runs, eager):
    """The consolidated export of an expert-parallel run: transformers loads it as MixtralForCausalLM, in Mixtral's
    own layout, and its logits are those of the training model (AutoModel's MoE layers) with the same weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    _, run_dir, _ = moe_runs("ep2")
    (info,) = ckpt.list_checkpoints(run_dir)
    saved = json.loads((info.path / "config.json").read_text())
    assert saved["architectures"] == ["MixtralForCausalLM"] and saved["num_local_experts"] == 4
    assert not {"scoring_func", "use_qk_norm"} & set(saved)  # the plain Mixtral config, nothing of MiniMax
    names = set(tensor_layout(info.path))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names

    reference = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32)
    assert type(reference).__name__ == "MixtralForCausalLM"
    model = _grouped_model(MixtralConfig.from_pretrained(info.path))
    disk = {}
    for file in info.path.glob("*.safetensors"):
        disk.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(model.state_dict_adapter.from_hf(disk), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(3, 32000, (2, 48), generator=torch.Generator().manual_seed(0))
    ours, theirs = _logits(model, ids), _logits(reference, ids)
    assert ours.shape == theirs.shape == (2, 48, 32000)
    assert torch.allclose(ours, theirs, atol=2e-5, rtol=1e-4), (ours - theirs).abs().max()


@pytest.mark.slow
def test_hf_checkpoint_converts_to_mixtrals_layout_with_identical_logits(moe_runs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from workloads import moe_model

    _, base_dir, _ = moe_runs("base")
    source = ckpt.latest_checkpoint(base_dir).path
    assert moe_model.uses_fused_expert_layout(source)
    converted = Path(moe_model.mixtral_layout_checkpoint(str(source), tmp_path / "cache"))
    assert converted != source and not moe_model.uses_fused_expert_layout(converted)
    assert moe_model.mixtral_layout_checkpoint(str(converted), tmp_path / "cache") == str(converted)  # as it is
    assert moe_model.mixtral_layout_checkpoint(str(source), tmp_path / "cache") == str(converted)  # made once
    ids = torch.randint(3, 32000, (2, 40), generator=torch.Generator().manual_seed(0))
    a = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert torch.equal(_logits(a, ids), _logits(b, ids))
