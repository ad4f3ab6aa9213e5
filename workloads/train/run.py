"""The run: ``train`` (checks, inputs staged, the recipe built, trained, exported) and ``main``, its command line
(``python -m workloads.train``, the package's ``__main__``) with its exit codes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from infra import phases, storage
from infra.configs.moe import resolve_moe_impl
from infra.configs.train import (
    EXIT_BAD_CONFIG,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    ParallelismError,
    TrainConfig,
    check_parallelism,
    load_train_config,
)
from workloads import checkpoint as ckpt
from workloads import staging
from workloads import train as train_package
from workloads.data_loader import DatasetMissingError, SentencePieceInfo, check_prefixes
from workloads.train.checkpoints import export_checkpoints, recover_written_save, upload_unsent
from workloads.train.errors import NO_SPACE, CheckpointSaveError, ExportError, disk_full, run_dir_full
from workloads.train.launch import (
    async_save_fits,
    check_data_splits,
    check_launch,
    grouped_init_from,
    launch_world,
    localize,
    prepare_run_dir,
    replace_fits,
    run_mirror,
    snapshots_fit,
)
from workloads.train.loop import build_recipe
from workloads.train.output import finish_wandb, log_phases, model_flops_per_token, prefix_output_with_rank
from workloads.train.recipe import recipe_config
from workloads.train.snapshots import SnapshotWriter, wait_for_writer


def train(config: TrainConfig) -> int:
    rank, _, world_size = launch_world()
    if not config.data_prefix or not config.tokenizer_model:
        raise ValueError("data_prefix and tokenizer_model must be set (the prepared dataset's blend and tokenizer)")

    import torch

    cuda = torch.cuda.is_available() and config.gpus_per_node > 0
    check_launch(config, world_size, cuda, torch.cuda.device_count())
    plan = check_parallelism(config, on_cpu=not cuda, world_size=world_size)
    if cuda:
        from infra.configs.memory_plan import check_memory

        check_memory(config, world_size=world_size)  # against gpu_memory_gib when the config states it
    phases.switch(phases.DATA)  # the run directory, the inputs staged in and checked
    mirror = run_mirror(config)
    run_dir = prepare_run_dir(config, mirror)
    wait_for_writer(run_dir)  # a killed run's snapshot writer still persisting (ckpt_snapshots): resume after it
    recover_written_save(run_dir)  # a killed run's last save, written after its death (ckpt_while_writing: replace)
    recorded, config = config, localize(config)  # meta.json records the URIs given; AutoModel reads local files
    if config.init_from and not (Path(config.init_from) / "config.json").is_file():
        raise FileNotFoundError(f"init_from {recorded.init_from} has no config.json: not a checkpoint directory")
    if config.init_from and resolve_moe_impl(config.arch, config.moe_impl) == "grouped":
        config = config.model_copy(update={"init_from": grouped_init_from(config, recorded)})
    check_prefixes(config.data_prefix)
    if config.valid_data_prefix:
        check_prefixes(config.valid_data_prefix)
    check_data_splits(config)
    tokenizer = SentencePieceInfo(config.tokenizer_model)
    vocab_size = config.vocab_size or tokenizer.vocab_size
    if rank == 0:
        ckpt.write_text_atomic(run_dir / "train_config.json", recorded.model_dump_json(indent=1))
        if mirror is not None:
            mirror.push_file("train_config.json")
            upload_unsent(run_dir, mirror)

    phases.switch(phases.START)  # NeMo AutoModel's imports
    from workloads import automodel_shim

    automodel_shim.pin_ninja()  # the helper cached by the install is the one found (no rebuild)
    if not cuda:
        automodel_shim.apply()
    snapshot_saves, why_not = snapshots_fit(config, vocab_size, world_size, cuda)
    if why_not and rank == 0:
        print(why_not, flush=True)
    if snapshot_saves:
        async_save = False  # each save is AutoModel's synchronous save into host memory (/dev/shm)
    else:
        async_save, why_not = async_save_fits(config, vocab_size, world_size, cuda)
        if why_not and rank == 0:
            print(why_not, flush=True)
    replace = False
    if async_save:
        automodel_shim.keep_staging_buffers(cuda)
        replace, why_not = replace_fits(config, vocab_size, world_size, cuda)
        if why_not and rank == 0:
            print(why_not, flush=True)
    automodel_shim.parallel_writes(config.ckpt_write_threads, keep_writing=replace)
    if resolve_moe_impl(config.arch, config.moe_impl) == "grouped":
        from workloads import moe_model

        if not moe_model.grouped_mm_available():
            raise ValueError(
                f"moe_impl={config.moe_impl!r} runs the experts with torch._grouped_mm, which torch "
                f"{torch.__version__} lacks (torch >= 2.8 has it); set moe_impl 'hf' or upgrade torch"
            )
        moe_model.register()  # AutoModel builds its MoE-layer Mixtral for MixtralForCausalLM configs
        if not cuda and not config.enable_compile:
            # AutoModel's MoE helpers (SwiGLU, ...) are @torch.compile'd: on CPU inductor's C++ build of them takes
            # ~25 s for milliseconds of work. Run them eagerly there (the same numbers) unless compile is asked for.
            torch.compiler.set_stance("force_eager")
    os.environ.setdefault("LOGGING_LEVEL", str(30))  # AutoModel's INFO lines (dataset indexes...) flood the log
    if config.init_from:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never ask the Hugging Face hub
    cfg = recipe_config(config, run_dir, vocab_size, world_size, cuda, async_save)
    strategy = cfg["distributed"]["strategy"]
    autocast_bf16 = cuda and config.precision == "bf16-mixed" and (world_size == 1 or strategy == "ddp")
    flops = model_flops_per_token(config, vocab_size)
    recipe = build_recipe(config, run_dir, cfg, autocast_bf16, recorded, mirror, flops)
    if snapshot_saves:
        recipe.snapshot_saves = True
        if rank == 0:  # one writer for the node (snapshots need one node): every local rank's files in a slot
            recipe.snapshots = SnapshotWriter.start(run_dir, config.save_top_k)
    phases.switch(phases.BUILD)
    recipe.setup()
    phases.switch(phases.BUILD)  # setup ends with the data loaders: what follows builds (compile, init_from)
    if async_save:
        recipe.writer_start = automodel_shim.start_checkpoint_process(recipe.checkpointer._model_ctx.process_group)
        weights = [p for part in recipe.model_parts for p in part.parameters()]
        if replace:
            # every save copies the state within the device first: the stager copies from those buffers, so its
            # host buffers are prepared for them (made now, while the model compiles)
            from workloads.train.device_snapshot import DeviceSnapshot

            recipe.device_snapshot = DeviceSnapshot()
            weights = recipe.device_snapshot.prepare(weights)
        recipe.prestage = automodel_shim.Prestage(recipe.checkpointer._model_ctx.stager, weights, cuda)
        if world_size > 1:
            recipe.agree_group = torch.distributed.new_group(backend="gloo")
    if snapshot_saves and world_size > 1:
        recipe.agree_group = torch.distributed.new_group(backend="gloo")  # the ranks agree on each save's slot
    if strategy == "ddp" and config.enable_compile:
        compile_decoder_layers(recipe.model_parts)
    without_kv_cache(recipe.model_parts)  # pipeline parallel is refused: the parts are whole models
    if config.init_from and not config.reset_optimizer:
        source = Path(config.init_from).parent.parent
        recipe.checkpointer.load_optimizer(recipe.optimizer, recipe.model_parts, str(source))
    resumed = recipe.step_scheduler.step
    recipe.start_metrics()
    if rank == 0:
        from workloads.wandb_run import record_active_run

        record_active_run(run_dir)  # the W&B run's link or offline path, for the stage's artifact
        params = sum(p.numel() for p in recipe.model_parts[0].parameters())
        moe_impl = resolve_moe_impl(config.arch, config.moe_impl)
        moe_note = f"moe_impl={moe_impl} expert_parallel={config.expert_model_parallel_size}, " if moe_impl else ""
        device = f"cuda x {world_size}" if cuda else f"cpu (gloo) x {world_size}"
        print(
            f"NeMo AutoModel {config.arch}: {params / 1e6:.2f}M parameters (per rank), {device}, "
            f"{moe_note}steps={plan.total_steps}, global_batch_size={config.global_batch_size} "
            f"micro_batch_size={config.micro_batch_size} data_parallel={plan.data_parallel_size} "
            f"accumulation={plan.gradient_accumulation_steps} seq_length={config.seq_length} strategy={strategy} "
            f"({type(recipe.model_parts[0]).__name__}) "
            f"precision={config.precision if cuda else '32 (cpu)'}",
            flush=True,
        )
        if resumed:
            saved = ckpt.saved_checkpoints(run_dir)
            latest = saved[-1].step_dir if saved else None
            print(f"resuming from {latest} at step {resumed} (consumed_samples={resumed * config.global_batch_size})")
        elif config.init_from:
            print(f"initialised weights from {config.init_from} (reset_optimizer={config.reset_optimizer})")
        sys.stdout.flush()
    try:
        phases.switch(phases.DATA)  # the first batch
        recipe.run_train_validation_loop()
        phases.switch(phases.SAVE)  # the last saves published and uploaded, then the export
        recipe.finisher.finish_published()
        recipe.finisher.join()
    except (torch.OutOfMemoryError, MemoryError):
        print(
            f"out of memory at step {recipe.step_scheduler.step + 1} with micro_batch_size={config.micro_batch_size}, "
            f"seq_length={config.seq_length}: lower micro_batch_size (or set activation_checkpointing)",
            flush=True,
        )
        return EXIT_OUT_OF_MEMORY
    finally:
        if recipe.snapshots is not None and recipe.snapshots.proc.poll() is None:
            recipe.snapshots.proc.stdin.close()  # an error ended training: the writer persists what it holds
        writer_start = getattr(recipe, "writer_start", None)
        if writer_start is not None:
            # A run with nothing left to train ends before the writer process it started is up: the start's
            # thread then died at exit with a traceback after the run's last line (the export's error).
            writer_start.join(timeout=300)
        if recipe.metrics is not None:
            log_phases(
                recipe,
                config.num_nodes * (config.gpus_per_node if cuda else config.cpus_per_task),
                "GPU" if cuda else "CPU",
            )
            recipe.metrics.close()
            if mirror is not None:
                mirror.push_file("metrics.jsonl")
        finish_wandb()
    done = recipe.step_scheduler.step
    if recipe.step_scheduler.sigterm_flag and done < plan.total_steps:
        if rank == 0:
            print(f"received a stop signal: checkpoint saved at step {done}, exiting", flush=True)
        return EXIT_PREEMPTED
    if rank == 0:
        started = time.perf_counter()
        export_checkpoints(run_dir, config.tokenizer_model, mirror)
        best = ckpt.best_checkpoint(run_dir)
        print(
            f"done: {done} steps, best checkpoint {best.path if best else None} "
            f"(exported in {time.perf_counter() - started:.1f} s after training)",
            flush=True,
        )
    return 0


def compile_decoder_layers(model_parts: list) -> None:
    """torch.compile each decoder layer in place, as AutoModel's FSDP2 path does for ``enable_compile``.

    AutoModel 0.7 compiles per layer only under FSDP2 (its DDP path offers whole-model compile alone), so with
    DDP nemoflow calls the same AutoModel function on the wrapped module after setup. ``nn.Module.compile``
    compiles in place: DDP's gradient hooks stay on the same parameters and the state-dict keys (hence the
    checkpoints) do not change.
    """
    from nemo_automodel.components.distributed.parallelizer import _apply_per_layer_compile

    for part in model_parts:
        _apply_per_layer_compile(getattr(part, "module", part))


def without_kv_cache(model_parts: list) -> None:
    """Every forward of the training model with ``use_cache=False``.

    transformers' Llama and Mixtral build a KV cache (a DynamicCache) in any forward unless told not to, training
    included, and each decoder layer writes its keys and values into it; torch.compile (enable_compile: one
    compiled region per decoder layer) then guards on that cache's state, so every layer compiled its own graph
    (a 16-layer model: 15 recompilations in the first step, 16 more in the first validation) where one graph
    serves them all. The config is left as it is (use_cache stays in the exported config.json, where generation
    wants it); only the forward calls change. A model whose forward takes no ``use_cache`` is left alone.
    """
    import functools
    import inspect

    for part in model_parts:
        inner = getattr(part, "module", part)  # DDP's wrapped model; FSDP2 wraps in place
        try:
            takes = "use_cache" in inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            part.forward = functools.partial(part.forward, use_cache=False)


def _read_config(path: str) -> str:
    """The --config file: a path, or a URI in object storage (a run directory there keeps it)."""
    if staging.is_remote(path):
        return storage.read_text(path)
    return Path(path).read_text()


def _config_fields_help() -> str:
    lines = ["config fields (JSON keys, NeMo names):"]
    for name, field in TrainConfig.model_fields.items():
        default = "required" if field.is_required() else f"default {field.default!r}"
        note = f": {field.description}" if field.description else ""
        lines.append(f"  {name} ({default}){note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.train",
        description=train_package.__doc__,
        epilog=_config_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="TrainConfig as a JSON file")
    parser.add_argument("--check", action="store_true", help="only check the configuration and the data, then exit")
    args = parser.parse_args(argv)
    prefix_output_with_rank()
    config = None
    try:
        config = load_train_config(_read_config(args.config))
        if args.check:
            plan = check_parallelism(config)
            check_prefixes(config.data_prefix)
            check_data_splits(config)
            print(json.dumps(plan.__dict__))
            return 0
        return train(config)
    except (ParallelismError, DatasetMissingError, PermissionError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except CheckpointSaveError as exc:
        if exc.disk_full or disk_full(exc) or run_dir_full(config):
            print(f"error: {NO_SPACE}", file=sys.stderr, flush=True)
        else:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not (disk_full(exc) or run_dir_full(config)):
            raise
        # One line after the traceback: what happened and what to do (the incomplete save is never a checkpoint).
        print(f"error: {NO_SPACE} ({exc.__class__.__name__} while writing)", file=sys.stderr, flush=True)
        return 1
    finally:
        phases.write()  # the job's phase seconds for the stage's gpu-time artifact ($NEMOFLOW_PHASES_FILE)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
