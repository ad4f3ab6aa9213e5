"""AutoModel's pretraining recipe with nemoflow's hooks: metrics, checkpoint bookkeeping (background saves
published as soon as written, a failed one dropped), phases, profiles and failpoints."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from infra import failpoints, phases
from infra.configs.train import TrainConfig
from workloads import checkpoint as ckpt
from workloads import staging
from workloads.train import snapshots
from workloads.train.checkpoints import CheckpointFinisher, checkpoint_meta
from workloads.train.errors import CheckpointSaveError, disk_full, one_line, run_dir_full
from workloads.train.output import MetricsLog, peak_flops, say, scalar


def build_recipe(
    config: TrainConfig,
    run_dir: Path,
    cfg: dict,
    autocast_bf16: bool,
    recorded: TrainConfig | None = None,
    mirror: staging.RunMirror | None = None,
    flops_per_token: float | None = None,
):
    """AutoModel's pretraining recipe with nemoflow's metrics, checkpoint bookkeeping and failpoints.

    ``config`` has its inputs on local disk (:func:`localize`); ``recorded`` is the configuration as
    given (gs:// URIs), which the checkpoints' meta.json records; ``mirror`` uploads the checkpoints of
    a remote run directory; ``flops_per_token`` (model FLOPs of one trained token) gives the logged MFU.
    """
    recorded = recorded or config
    import torch
    from nemo_automodel.components.checkpoint.utils import is_checkpoint_incomplete
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    from workloads import automodel_shim

    tokens_per_step = config.global_batch_size * config.seq_length
    log_samples = failpoints.enabled("train.log_samples")
    peak = peak_flops() if torch.cuda.is_available() else None

    class NemoflowPretraining(TrainFinetuneRecipeForNextTokenPrediction):
        metrics: MetricsLog | None = None
        last_val_loss: float | None = None
        saved_step: int | None = None  # the save whose staging the next optimizer step may wait for
        failed_in_row: int = 0  # background saves that failed since the last one published
        failed_step: int | None = None  # the step of the last save that failed
        failed_error: BaseException | None = None  # and its error (the cause of a CheckpointSaveError)
        failed_disk_full: bool = False  # and whether the run directory's disk was full then
        prestage = None  # automodel_shim.Prestage: the first save's staging buffers, prepared in the background
        staged_report: bool = False  # the first save after pre-staging records the buffers it used
        write_marks: dict | None = None  # when the pending save's copies and writes ended (perf_counter)
        agree_group = None  # ranks agree on publishing a written save (publish_written_save)
        snapshot_saves: bool = False  # ckpt_snapshots: each save a snapshot in host memory (save_snapshot)
        snapshots = None  # snapshots.SnapshotWriter, rank 0's handle on the node's writer process
        # ckpt_while_writing: replace (device_snapshot.DeviceSnapshot): each save's state copied on the device first
        device_snapshot = None
        waiting: dict | None = None  # and the save taken while the previous one was written: written when it ends

        def _make_progress_bar(self, *args, **kwargs):
            return None  # one log line per logged step instead of a redrawn bar in the job log

        def _forward_backward_step(self, *args, **kwargs):
            # One GPU (AutoModel skips FSDP2 and with it the bf16 compute policy) and DDP (which has none):
            # autocast computes in bf16 over the fp32 master weights instead.
            if autocast_bf16:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return super()._forward_backward_step(*args, **kwargs)
            return super()._forward_backward_step(*args, **kwargs)

        def _run_train_optim_step(self, batches, max_grad_norm=None):
            done = self.step_scheduler.step + 1
            if failpoints.at("train.oom_at_step", done):
                raise torch.OutOfMemoryError("simulated by the failpoint train.oom_at_step")
            if log_samples:
                rows = [
                    hashlib.sha256(row.numpy().tobytes()).hexdigest()[:12] for b in batches for row in b["input_ids"]
                ]
                say(f"samples step={done} rank={self.dist_env.rank} {','.join(rows)}")
            self.step_lr = self.optimizer[0].param_groups[0]["lr"]  # the lr this step trains with
            self.publish_written_save()
            self.log_snapshot_events()
            if self.saved_step is not None:
                # The optimizer may not change the weights before the last save's copy to host memory is done:
                # AutoModel waits for it before opt.step (maybe_wait_for_staging). Wait here first, timed, so the
                # training loop's share of the save is on record (checkpoint_wait_s); AutoModel's wait is then a no-op.
                started = time.perf_counter()
                with phases.within(phases.SAVE):
                    self.checkpointer.maybe_wait_for_staging()
                if self.metrics is not None:
                    record = {"step": self.saved_step, "checkpoint_wait_s": time.perf_counter() - started}
                    if self.staged_report:
                        # every buffer the first save used: equal to what was pre-staged when it served the save
                        stagers = (self.checkpointer._model_ctx.stager, self.checkpointer._optim_ctx.stager)
                        record["checkpoint_staged_gib"] = sum(map(automodel_shim.staged_bytes, stagers)) / 2**30
                    self.metrics.log(record)
                self.saved_step, self.staged_report = None, False
            self.profile_steps(done, start=True)
            # This process's first step compiles (torch.compile is lazy) and warms up: counted as the build.
            phases.switch(phases.STEPS if getattr(self, "stepped", False) else phases.BUILD)
            result = super()._run_train_optim_step(batches, max_grad_norm)
            phases.switch(phases.DATA)  # until the next step: the next batch and the loop's bookkeeping
            self.stepped = True
            self.profile_steps(done, start=False)
            if self.prestage is not None and not self.prestage.optimizer_ready.is_set():
                # the optimizer's state exists from its first step on: its staging buffers can be prepared now
                tensors = automodel_shim.optimizer_tensors(self.optimizer)
                if self.device_snapshot is not None:  # ckpt_while_writing: replace: the stager copies from these
                    tensors = self.device_snapshot.prepare(tensors)
                self.prestage.optimizer(self.checkpointer._optim_ctx.stager, tensors)
            return result

        def _get_dp_rank(self, include_cp: bool = False):
            if not include_cp and phases.timer().current == phases.BUILD:
                phases.switch(phases.DATA)  # AutoModel 0.7's setup asks this first when it builds the data loaders
            return super()._get_dp_rank(include_cp=include_cp)

        @phases.timed(phases.BUILD)  # resume: weights, optimizer and data position back from the checkpoint
        def load_checkpoint(self, *args, **kwargs):
            return super().load_checkpoint(*args, **kwargs)

        @phases.timed(phases.VALIDATION)
        def _run_validation_epoch(self, *args, **kwargs):
            # Eager: AutoModel validates under no_grad, and the compiled decoder layers (enable_compile) would be
            # compiled again for it (torch.compile guards on grad mode) for a few batches. A compiled run
            # of the 16-layer tiny Llama on the 2-core VM: its validations 7.9 s -> 3.4 s with this and the
            # trainer's forward without a KV cache (run.py without_kv_cache); the same losses.
            with torch.compiler.set_stance("force_eager"):
                return super()._run_validation_epoch(*args, **kwargs)

        def profile_steps(self, done: int, start: bool) -> None:
            """``NEMOFLOW_PROFILE_STEPS=DIR[:FIRST[:COUNT]]`` (default steps 8-10): torch.profiler over those steps.

            Writes ``DIR/steps-rank<R>.txt``, the operators by their own GPU time (CPU time on CPU), to find where a
            step's time goes (benchmarks/bench_train_gpu.py passes it on; off unless set).
            """
            spec = os.environ.get("NEMOFLOW_PROFILE_STEPS")
            if not spec:
                return
            out, first, count = (spec.split(":") + ["8", "3"])[:3]
            first, last = int(first), int(first) + int(count) - 1
            if start and done == first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.step_profiler = torch.profiler.profile(activities=activities)
                self.step_profiler.__enter__()
            elif not start and done == last and getattr(self, "step_profiler", None) is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.step_profiler.__exit__(None, None, None)
                sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                table = self.step_profiler.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
                Path(out).mkdir(parents=True, exist_ok=True)
                name = f"{out}/steps-rank{self.dist_env.rank}.txt"
                Path(name).write_text(f"steps {first}-{last}, sorted by {sort}\n{table}\n")
                self.step_profiler = None

        def publish_written_save(self, wait: bool = False, launch: bool = True) -> None:
            """Publish the last asynchronous save as soon as its files are written, or drop it if its write failed.

            AutoModel publishes an asynchronous save (removes its ``.incomplete`` marker, moves LATEST) only at the
            next save or at the end of training, so a job killed in between would resume from the save before.
            Every rank must publish at the same step (publication runs collectives), so the ranks agree first,
            on a gloo group of their own, and only while a save is pending. ``wait``: until the writes end (before
            the next save and at the end of training).

            A write that failed on any rank (the storage, a full disk, the writer process killed) used to raise
            here and end the run (issue 34: one background write's error ended a 1.1B run): it is
            :meth:`drop_failed_save` instead, on every rank at the same step.

            ``ckpt_while_writing: replace``: once the write has ended, the save waiting for it (if any) is handed to
            the writer (:meth:`write_waiting`), unless ``launch`` is false (a newer save is about to replace it).
            """
            if not self.checkpointer.config.is_async:
                return
            if self.checkpointer.lifecycle._pending_checkpoint_dir is not None and not self.end_write(wait):
                return  # still being written
            if launch and self.waiting is not None:
                self.write_waiting()  # the write it waited for is published, or was dropped as failed
                if wait:
                    self.publish_written_save(wait=True)

        def end_write(self, wait: bool) -> bool:
            """The pending save: published if written on every rank, dropped if failed on any; False while it is
            still being written (``wait``: until it is not)."""
            lifecycle = self.checkpointer.lifecycle
            writes = [c.future.upload_completion for c in self.checkpointer_contexts() if c.future is not None]
            if wait:
                concurrent.futures.wait(writes)
            written = all(w.done() for w in writes)
            errors = [w.exception() for w in writes if w.done() and w.exception() is not None]
            # [not written, failed, writer process dead] on this rank; the ranks' maximum is what every rank does
            flags = [int(not written), int(bool(errors)), int(not automodel_shim.writer_alive())]
            if self.agree_group is not None:
                flag = torch.tensor(flags)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.agree_group)
                flags = flag.tolist()
            if flags[0]:
                return False
            if flags[1]:
                self.drop_failed_save(errors[0] if errors else None, replace_writer=bool(flags[2]))
                return True
            self.checkpointer.async_wait()  # returns at once: the writes are done
            path = lifecycle._pending_checkpoint_dir
            lifecycle.complete_pending()
            self.failed_in_row = 0
            if self.dist_env.is_main:
                self.record_write(Path(path))
                self.finisher.finish_published()
            return True

        def skip_while_writing(self, done: int) -> bool:
            """``ckpt_while_writing: skip``: while the previous background save is still being written (on any
            rank: the ranks agree in :meth:`publish_written_save`), this save is skipped, on record, and the loop
            goes on without waiting. Saves then happen at the storage's pace. Never the last step's save, nor one
            on a signal (the run ends after it)."""
            if config.ckpt_while_writing != "skip" or not self.checkpointer.config.is_async:
                return False
            scheduler = self.step_scheduler
            if scheduler.is_last_step or scheduler.sigterm_flag:
                return False
            self.publish_written_save()  # published now if its write has ended
            pending = self.checkpointer.lifecycle._pending_checkpoint_dir
            if pending is None:
                return False
            writing = ckpt.step_of(Path(pending))
            if self.metrics is not None:
                self.metrics.log({"step": done, "checkpoint_skipped_while_writing": writing})
            if self.dist_env.is_main:
                say(f"checkpoint of step {done} skipped: the save of step {writing} is still being written")
            return True

        def record_write(self, path: Path) -> None:
            """The background write's time and rate (metrics.jsonl ``checkpoint_write_s``, ``checkpoint_gb``,
            ``checkpoint_write_gbps``): from the end of the first copy to host memory to the end of the last write,
            over the bytes of the step directory (every rank's files: the rate of the whole save)."""
            marks, self.write_marks = self.write_marks or {}, None
            staged = [t for k, t in marks.items() if k.endswith("staged")]
            written = [t for k, t in marks.items() if k.endswith("written")]
            if self.metrics is None or not staged or not written or not path.is_dir():
                return
            seconds = max(written) - min(staged)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            self.metrics.log(
                {
                    "step": ckpt.step_of(path),
                    "checkpoint_write_s": seconds,
                    "checkpoint_gb": size / 1e9,
                    "checkpoint_write_gbps": size / 1e9 / max(seconds, 1e-9),
                }
            )

        def mark_writes(self) -> None:
            """Note when this save's copies to host memory and its writes end (for :meth:`record_write`)."""
            marks = self.write_marks = {}
            for name, context in (("model", self.checkpointer._model_ctx), ("optim", self.checkpointer._optim_ctx)):
                if context.future is None:
                    continue
                for kind, future in (
                    ("staged", context.future.staging_completion),
                    ("written", context.future.upload_completion),
                ):
                    future.add_done_callback(lambda _, key=f"{name}_{kind}": marks.setdefault(key, time.perf_counter()))

        def join_prestage(self, done: int) -> None:
            """Before the first save: the background preparation of its staging buffers is finished (it waits for
            what is left, counted in checkpoint_save_s), and on record."""
            prestage, self.prestage = self.prestage, None
            prestage.join()
            if prestage.error is not None:
                if self.dist_env.is_main:
                    say(
                        f"warning: the checkpoint staging buffers could not be prepared ahead "
                        f"({one_line(prestage.error)}); the first save allocates them"
                    )
                return
            self.staged_report = self.checkpointer.config.is_async
            if self.dist_env.is_main:
                say(
                    f"checkpoint staging buffers ready: {prestage.bytes / 2**30:.2f} GiB of host memory "
                    f"({'pinned, ' if prestage.cuda else ''}shared) prepared in {prestage.seconds:.1f} s in the "
                    "background"
                )
                if self.metrics is not None:
                    self.metrics.log(
                        {
                            "step": done,
                            "checkpoint_prestage_s": prestage.seconds,
                            "checkpoint_prestage_gib": prestage.bytes / 2**30,
                        }
                    )

        def drop_failed_save(self, error: BaseException | None, replace_writer: bool) -> None:
            """A background save failed: report it, remove it, keep training (or stop after too many in a row).

            The save was never published (AutoModel's ``.incomplete`` marker), so nothing ever loads it; it is
            moved aside (one rename: never a half-deleted directory without its marker) and deleted, which gives
            a full disk its space back. The previous checkpoint stays the newest. A writer process that died is
            replaced on every rank (the others' processes share a gloo group with it).
            """
            lifecycle = self.checkpointer.lifecycle
            path = Path(lifecycle._pending_checkpoint_dir)
            for context in (self.checkpointer._model_ctx, self.checkpointer._optim_ctx):
                context.future, context.staging_active = None, False
            lifecycle._pending_checkpoint_dir = lifecycle._pending_best_checkpoint = None
            self.write_marks = None
            self.failed_in_row += 1
            self.failed_step = step = ckpt.step_of(path)
            self.failed_error = error
            reason = one_line(error) if error is not None else "the write failed on another rank"
            # torch.save inside DCP's writer reports a full disk as "unexpected pos", without an errno: the disk
            # is looked at before the failed save is removed and gives its space back.
            self.failed_disk_full = (error is not None and disk_full(error)) or run_dir_full(config)
            if self.failed_disk_full and "No space left" not in reason:
                reason += " (no space left on the device holding the run directory)"
            if replace_writer:
                code = automodel_shim.writer_exit_code()
                died = f"died with exit code {code}" if code is not None else "died on another rank"
                reason += f" (the checkpoint writer process {died}; a new one is started)"
                self.writer_start = automodel_shim.replace_writer(self.checkpointer._model_ctx.process_group)
            if self.dist_env.is_main:
                if path in self.finisher.pending:
                    self.finisher.pending.remove(path)
                ckpt.remove_unpublished(path)
                saved = ckpt.saved_checkpoints(run_dir)
                newest = f"step {saved[-1].step} ({saved[-1].step_dir})" if saved else "none"
                say(
                    f"warning: the checkpoint of step {step} was not saved: {reason}; training continues, the newest "
                    f"checkpoint is still {newest} ({self.failed_in_row} failed save(s) in a row, the run stops at "
                    f"{config.ckpt_max_failed_saves})"
                )
                if self.metrics is not None:
                    self.metrics.log(
                        {"step": step, "checkpoint_failed": reason, "checkpoint_failed_in_row": self.failed_in_row}
                    )
            if self.failed_in_row >= config.ckpt_max_failed_saves:
                raise CheckpointSaveError(
                    f"{self.failed_in_row} checkpoint saves in a row failed (the last, of step {step}: {reason}); "
                    "stopping: the newest complete checkpoint is kept, fix the storage and run again to resume",
                    disk_full=self.failed_disk_full,
                ) from error

        # -------------------------------------------------- ckpt_while_writing: replace
        def save_replacing(self, epoch, step, train_loss, val_loss, best_metric_key) -> None:
            """``ckpt_while_writing: replace`` (workloads/train/device_snapshot.py): AutoModel's save, its model and
            optimizer state first copied into buffers on the device, so the loop waits for neither the copy to host
            memory (the stager reads the buffers, not the weights) nor the previous save's write: a save due while
            that write runs waits in the buffers (:meth:`take_waiting`) and is written when it ends; a newer one
            replaces it. The last step's save and one on a signal wait for the previous write, as without it."""
            done = step + 1
            started = time.perf_counter()
            scheduler = self.step_scheduler
            last = scheduler.is_last_step or scheduler.sigterm_flag
            # The previous write published if it has ended, and the save waiting for it handed to the writer (this
            # one then waits in its place): a save is never lost to a race between a write's end and the next save.
            # The last save waits for that write, and replaces the waiting one instead (the run ends after it).
            self.publish_written_save(wait=last, launch=not last)
            if self.prestage is not None:
                self.join_prestage(done)  # the first save: the host buffers prepared in the background, on record
            copying = self.wait_for_snapshot_copy()  # the stager still copying the buffers out (rare: < 1 s on an H200)
            if self.waiting is not None:
                self.replace_waiting(done)
            lifecycle = self.checkpointer.lifecycle
            writing = lifecycle._pending_checkpoint_dir
            path = Path(self.checkpointer.config.checkpoint_dir) / f"epoch_{epoch}_step_{step}"
            if writing is None:
                checkpointer, snapshot = self.checkpointer, self.device_snapshot
                real = checkpointer._do_save

                def save_from_snapshot(state_dict, path, storage_writer=None):
                    return real(snapshot.copy(Path(path).name, state_dict), path, storage_writer)

                checkpointer._do_save = save_from_snapshot
                try:
                    super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
                finally:
                    del checkpointer._do_save
                self.snapshot_written(self.checkpointer_contexts())
            else:
                self.take_waiting(epoch, step, train_loss, val_loss, best_metric_key, path)
            if self.dist_env.is_main:
                val = (val_loss or {}).get("default")
                meta = checkpoint_meta(recorded, done, None if val is None else scalar(val), scalar(train_loss))
                meta["world_size"] = self.dist_env.world_size
                ckpt.write_text_atomic(path / ckpt.META, json.dumps(meta, indent=1, sort_keys=True, default=str))
                if writing is None:
                    self.finisher.pending.append(path)
            if writing is None:
                self.mark_writes()
            blocked = time.perf_counter() - started
            first = not getattr(self, "snapshot_reported", False)
            self.snapshot_reported = True
            if self.metrics is not None:
                record = {"step": done, "checkpoint_save_s": blocked}
                if copying > 0.001:
                    record["checkpoint_snapshot_copy_wait_s"] = copying
                if writing is not None:
                    record["checkpoint_waiting_for"] = ckpt.step_of(Path(writing))
                if first:
                    record["checkpoint_snapshot_gib"] = self.device_snapshot.bytes / 2**30
                    # of which made before this first save (with the stager's host buffers for them)
                    record["checkpoint_snapshot_prepared_gib"] = self.device_snapshot.prepared_used / 2**30
                self.metrics.log(record)
            if first:
                self.device_snapshot.prepared.clear()  # any this save did not use (none when the keys match)
            if writing is not None and self.dist_env.is_main:
                say(
                    f"checkpoint of step {done} taken; its write starts when the save of step "
                    f"{ckpt.step_of(Path(writing))} is written"
                )
            self.window_start += blocked  # tokens_per_s measures training steps only

        def checkpointer_contexts(self) -> tuple:
            return self.checkpointer._model_ctx, self.checkpointer._optim_ctx

        @staticmethod
        def snapshot_written(contexts) -> None:
            """A save handed to DCP from the snapshot's buffers: the next optimizer step need not wait for the copy
            to host memory (AutoModel's maybe_wait_for_staging), since it reads the buffers, not the weights."""
            for context in contexts:
                context.staging_active = False

        def wait_for_snapshot_copy(self) -> float:
            """Wait until DCP's stager has copied the buffers to host memory (they are about to be overwritten)."""
            started = time.perf_counter()
            futures = [c.future.staging_completion for c in self.checkpointer_contexts() if c.future is not None]
            concurrent.futures.wait(futures)
            return time.perf_counter() - started

        def take_waiting(self, epoch, step, train_loss, val_loss, best_metric_key, path: Path) -> None:
            """A save due while the previous one is being written: AutoModel's save runs as always (the step
            directory reserved, unpublished; the data loader's position, the RNG, the schedule and the losses written
            now), except that the model's and the optimizer's state go into the snapshot's buffers instead of to DCP,
            and the write being in progress is neither waited for nor published. :meth:`write_waiting` hands them to
            DCP when that write ends."""
            checkpointer, lifecycle, snapshot = self.checkpointer, self.checkpointer.lifecycle, self.device_snapshot
            contexts = self.checkpointer_contexts()
            in_progress = [(c.future, c.staging_active) for c in contexts]
            pending = (lifecycle._pending_checkpoint_dir, lifecycle._pending_best_checkpoint)
            writes: list = []

            def keep(state_dict, path, storage_writer=None):
                writes.append((snapshot.copy(Path(path).name, state_dict), path, storage_writer))
                return None  # no write yet (AutoModel stores it as the context's future: put back below)

            checkpointer._do_save = keep
            checkpointer.async_wait = lambda: None  # the write in progress goes on
            lifecycle.complete_pending = lambda: None  # and is published when written, not before
            try:
                super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            finally:
                del checkpointer._do_save, checkpointer.async_wait, lifecycle.complete_pending
                publication = (lifecycle._pending_checkpoint_dir, lifecycle._pending_best_checkpoint)
                lifecycle._pending_checkpoint_dir, lifecycle._pending_best_checkpoint = pending
                for context, (future, staging) in zip(contexts, in_progress):
                    context.future, context.staging_active = future, staging
            self.waiting = {
                "step": step + 1,
                "path": path,
                "writes": writes,
                "publication": publication,
                "taken": time.perf_counter(),
            }

        def write_waiting(self) -> None:
            """The previous write has ended: the save waiting in the snapshot's buffers is handed to DCP (every rank
            at the same step: publish_written_save's agreement), and published when written, as any save."""
            waiting, self.waiting = self.waiting, None
            checkpointer, lifecycle = self.checkpointer, self.checkpointer.lifecycle
            for state_dict, path, storage_writer in waiting["writes"]:
                context = checkpointer._model_ctx if Path(path).name == "model" else checkpointer._optim_ctx
                context.future = checkpointer._do_save(state_dict, path, storage_writer)
            self.snapshot_written(self.checkpointer_contexts())
            lifecycle._pending_checkpoint_dir, lifecycle._pending_best_checkpoint = waiting["publication"]
            self.mark_writes()
            if self.dist_env.is_main:
                self.finisher.pending.append(waiting["path"])
            if self.metrics is not None:
                delay = time.perf_counter() - waiting["taken"]
                self.metrics.log({"step": waiting["step"], "checkpoint_write_delayed_s": delay})

        def replace_waiting(self, done: int) -> None:
            """A newer save replaces the one waiting for the previous write: its step directory (reserved, never
            published) is removed, and the replacement is on record."""
            waiting, self.waiting = self.waiting, None
            if self.dist_env.is_main:
                ckpt.remove_unpublished(waiting["path"])
                say(f"checkpoint of step {waiting['step']} replaced by the save of step {done} before its write began")
            if self.metrics is not None:
                self.metrics.log({"step": waiting["step"], "checkpoint_replaced_by": done})

        # -------------------------------------------------- metrics
        def save_snapshot(self, epoch, step, train_loss, val_loss, best_metric_key) -> None:
            """``ckpt_snapshots``: AutoModel's own synchronous save, into a free slot in /dev/shm (host memory), then
            the slot handed to the writer process (workloads/train/snapshots.py), which persists it into the run's
            checkpoint directory at the storage's pace. The training loop waits for the copy only."""
            done = step + 1
            started = time.perf_counter()
            slot = self.snapshots.acquire() if self.snapshots is not None else 0
            if self.agree_group is not None:
                # every rank writes its files of this save into the same slot (rank 0 asked the writer)
                chosen = torch.tensor([slot if self.dist_env.is_main else 0])
                torch.distributed.all_reduce(chosen, op=torch.distributed.ReduceOp.SUM, group=self.agree_group)
                slot = int(chosen.item())
            slot_root = snapshots.slot_dir(run_dir, slot)
            checkpoint_config = self.checkpointer.config
            persistent_dir, checkpoint_config.checkpoint_dir = checkpoint_config.checkpoint_dir, str(slot_root)
            try:
                super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            finally:
                checkpoint_config.checkpoint_dir = persistent_dir
            if self.dist_env.is_main:
                val = (val_loss or {}).get("default")
                meta = checkpoint_meta(recorded, done, None if val is None else scalar(val), scalar(train_loss))
                meta["world_size"] = self.dist_env.world_size
                path = slot_root / f"epoch_{epoch}_step_{step}"
                ckpt.write_text_atomic(path / ckpt.META, json.dumps(meta, indent=1, sort_keys=True, default=str))
                self.snapshots.filled(slot, done, time.time())
            blocked = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.log({"step": done, "snapshot_copy_s": blocked})
            self.window_start += blocked  # tokens_per_s measures training steps only

        def log_snapshot_events(self, events: list | None = None) -> None:
            """The writer's reports since the last call into metrics.jsonl: a snapshot persisted (its write's
            seconds and its lag behind the save), replaced by a newer one before it was written, or failed."""
            if self.snapshots is None:
                return
            for event in self.snapshots.drain() if events is None else events:
                kind, step = event["event"], event["step"]
                if kind == "persisted":
                    say(f"saved checkpoint {event['path']} (step {step}, val_loss {event['val_loss']})")
                elif kind == "failed":
                    say(f"warning: the snapshot of step {step} was not persisted: {event['error']}; training continues")
                if self.metrics is not None:
                    self.metrics.log(snapshots.metrics_record(event))
                if kind == "persisted" and mirror is not None:
                    uri = mirror.push_checkpoint(Path(event["path"]))
                    say(f"uploaded checkpoint {uri}")

        def finish_snapshots(self) -> None:
            """The end of training: the writer persists what it holds (the last save among it) and exits."""
            if self.snapshots is not None:
                self.log_snapshot_events()
                self.log_snapshot_events(self.snapshots.finish())
                say(
                    f"checkpoint snapshots: {self.snapshots.taken} taken, {self.snapshots.persisted} persisted, "
                    f"{self.snapshots.replaced} replaced by a newer one before their write, {self.snapshots.failed} "
                    "failed"
                )
            if self.agree_group is not None:
                torch.distributed.barrier(group=self.agree_group)  # no rank goes on before the last is persisted

        def start_metrics(self) -> None:
            self.window_start, self.window_steps = time.perf_counter(), 0
            self.max_steps = self.step_scheduler.max_steps
            # W&B gets what metrics.jsonl gets: log_train_metrics below passes only nemoflow's log steps
            # (done % log_every_n_steps, done = step + 1) to AutoModel, whose own filter (step % n, 0-based)
            # would then drop every one of them; so AutoModel logs remotely whenever it is called.
            self.step_scheduler.log_remote_every_steps = 1
            if self.dist_env.is_main:
                self.metrics = MetricsLog(run_dir, self.step_scheduler.step)

        def log_train_metrics(self, log_data):
            done = log_data.step + 1
            self.window_steps += 1
            if done % config.log_every_n_steps and done != self.max_steps:
                return
            now = time.perf_counter()
            m = log_data.metrics
            tokens_per_s = self.window_steps * tokens_per_step / max(now - self.window_start, 1e-9)
            record = {
                "step": done,
                "loss": scalar(m["loss"]),
                "lr": self.step_lr,
                "tokens_per_s": tokens_per_s,
                "grad_norm": scalar(m["grad_norm"]),
                "consumed_samples": done * config.global_batch_size,
            }
            if torch.cuda.is_available():
                if flops_per_token and peak:
                    # model FLOPs utilisation: the FLOPs the model needs per token x tokens/s over every GPU's peak
                    record["mfu"] = tokens_per_s * flops_per_token / (peak * self.dist_env.world_size)
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.window_start, self.window_steps = now, 0
            if self.metrics is not None:
                self.metrics.log(record)
            super().log_train_metrics(log_data)  # W&B, AutoModel's own log; resets the peak-memory window
            if failpoints.at("train.pause_after_step", done):
                handler = self.step_scheduler.sig_handler
                deadline = time.monotonic() + 120
                while not handler._signal_received and time.monotonic() < deadline:
                    time.sleep(0.05)
                    self.publish_written_save()  # a save written meanwhile is published, as between steps

        def log_val_metrics(self, val_name, log_data, metric_logger=None):
            self.last_val_loss = scalar(log_data.metrics["val_loss"])
            if self.metrics is not None and val_name == "default":
                self.metrics.log({"step": log_data.step + 1, "val_loss": self.last_val_loss})
            super().log_val_metrics(val_name, log_data, metric_logger)

        @phases.timed(phases.SAVE)
        def _finalize_and_close_checkpointer(self):
            started = time.perf_counter()
            if self.snapshot_saves:
                self.finish_snapshots()
            self.publish_written_save(wait=True)  # the last save: published, or dropped as failed
            super()._finalize_and_close_checkpointer()  # closes the checkpointer
            done = self.step_scheduler.step
            if self.metrics is not None:
                self.metrics.log({"step": done, "checkpoint_finalize_s": time.perf_counter() - started})
            if self.failed_step is not None and self.failed_step == done:
                # Training ended (or a stop signal came) but its state is not on disk: the run did not do its job.
                saved = ckpt.saved_checkpoints(run_dir)
                raise CheckpointSaveError(
                    f"the last checkpoint (step {done}) was not saved; the newest complete checkpoint is "
                    f"{f'step {saved[-1].step}' if saved else 'none'}: run again to resume from it",
                    disk_full=self.failed_disk_full,
                ) from self.failed_error

        # -------------------------------------------------- checkpoints
        @phases.timed(phases.SAVE)
        def save_checkpoint(self, epoch, step, train_loss, val_loss=None, best_metric_key="default"):
            if self.snapshot_saves:
                return self.save_snapshot(epoch, step, train_loss, val_loss, best_metric_key)
            if self.device_snapshot is not None:
                return self.save_replacing(epoch, step, train_loss, val_loss, best_metric_key)
            done = step + 1
            path = Path(self.checkpointer.config.checkpoint_dir) / f"epoch_{epoch}_step_{step}"
            if self.skip_while_writing(done):
                return
            if failpoints.at("train.crash_in_save_at_step", done):
                # Die inside AutoModel's save: weights written, optimizer not, checkpoint never published.
                def die(*args, **kwargs):
                    os.kill(os.getpid(), signal.SIGKILL)

                self.checkpointer.save_optimizer = die
            started = time.perf_counter()
            # The previous save's write, if still running, ends first: published, or dropped as failed (AutoModel's
            # own wait would raise its error and end the run).
            self.publish_written_save(wait=True)
            if self.prestage is not None:
                self.join_prestage(done)
            profile = os.environ.get("NEMOFLOW_PROFILE_SAVES")  # a directory: cProfile of each save's blocking part
            if profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            super().save_checkpoint(epoch, step, train_loss, val_loss, best_metric_key)
            if profile:
                profiler.disable()
                Path(profile).mkdir(parents=True, exist_ok=True)
                profiler.dump_stats(f"{profile}/save-step{done}-rank{self.dist_env.rank}.prof")
            if self.dist_env.is_main:
                # The step directory is AutoModel's reserved (unpublished) directory until the save completes:
                # nemoflow's record goes in with it.
                val = (val_loss or {}).get("default")
                meta = checkpoint_meta(recorded, done, None if val is None else scalar(val), scalar(train_loss))
                meta["world_size"] = self.dist_env.world_size
                ckpt.write_text_atomic(path / ckpt.META, json.dumps(meta, indent=1, sort_keys=True, default=str))
            blocked = time.perf_counter() - started
            if self.checkpointer.config.is_async:
                self.mark_writes()
            if self.metrics is not None:
                # Time the training loop waited in the save itself (async: the previous save's write, if still
                # running, and the start of this one's copy to host memory); checkpoint_wait_s follows at the
                # next optimizer step.
                self.metrics.log({"step": done, "checkpoint_save_s": blocked})
            self.window_start += blocked  # tokens_per_s measures training steps only
            self.saved_step = done if self.checkpointer.config.is_async else None
            if failpoints.at("train.crash_after_save_at_step", done):
                os.kill(os.getpid(), signal.SIGKILL)
            if self.dist_env.is_main:
                self.finisher.pending.append(path)
                self.finisher.finish_published()

    recipe = NemoflowPretraining(ConfigNode(cfg))
    recipe.finisher = CheckpointFinisher(run_dir, config.save_top_k, is_checkpoint_incomplete, mirror)
    return recipe
