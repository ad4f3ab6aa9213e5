"""The jobs and the server one end-to-end run submits, built by the stages' own builders.

The stages and their order are the flow's own (flows/end_to_end.py ``STAGES``): each stage that submits a
job or a service names it, and :data:`BUILDERS` builds it as that stage's task module does.

    for stage, spec in planned_specs(EndToEndConfig(executor="k8s")): ...

``nemoflow render`` writes these through the executor's backend
(:meth:`infra.jobs.Backend.render`): the manifests or sbatch scripts are the
ones a run submits. Two things exist only after earlier stages ran: the blend
weights (from the tokenized files' sizes, which name the training run
directory) and the best checkpoint's step. When the dataset or the run already
exists they are read from it, so a render after ``prepare-dataset`` names the
real run directory; otherwise the blend is planned with equal weights and the
checkpoint is the run's last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from flows.end_to_end import STAGES, EndToEndConfig, validation_resources
from infra import storage
from infra.executors import get_backend
from infra.jobs import Backend, ImageRef, JobSpec, ServiceSpec
from infra.sources import expand_sources
from tasks.checkpoint import build_validate_job, report_path
from tasks.data import build_tokenize_job
from tasks.image import default_dest
from tasks.refs import CheckpointRef, DatasetRef
from tasks.serve import build_serve_spec, deployment_fingerprint
from tasks.train_engines import TrainEngine, TrainInputs


def planned_dataset(config: EndToEndConfig) -> tuple[DatasetRef, int]:
    """The prepared dataset as the data stage will hand it on (read back when it exists), and its part count."""
    data = config.data.resolved(materialize=False)
    dataset_uri = data.dataset_uri()
    manifest_uri = storage.join(dataset_uri, "manifest.json")
    if storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        parts = manifest["parts"]
        return (
            DatasetRef(
                prefixes=[p["prefix"] for p in parts],
                blend=manifest["blend"],
                manifest_uri=manifest_uri,
                tokenizer=manifest["tokenizer"],
                documents=sum(p["documents"] for p in parts),
                tokens=sum(p["tokens"] for p in parts),
                bytes=sum(p["bytes_in"] for p in parts),
            ),
            len(parts),
        )
    sources = expand_sources(data.sources, chunks=data.chunks, shards=data.shards)
    count = max(1, math.ceil(len(sources) / data.shards_per_file))
    prefixes = [
        storage.join(dataset_uri, "tokenized", f"part-{i:05d}_{key}_document")
        for i in range(count)
        for key in data.json_keys
    ]
    blend: list = []
    for prefix in prefixes:
        blend += [round(1 / len(prefixes), 6), prefix]
    ref = DatasetRef(
        prefixes=prefixes,
        blend=blend,
        manifest_uri=manifest_uri,
        tokenizer=data.tokenizer,
        documents=0,
        tokens=0,
        bytes=0,
    )
    return ref, count


@dataclass
class _Planned:
    """What one run's stages hand each other, as planned before any of them ran."""

    config: EndToEndConfig
    backend: Backend
    image: ImageRef
    dataset: DatasetRef
    parts: int

    @cached_property
    def inputs(self) -> TrainInputs:
        return TrainInputs(dataset=self.dataset, image=self.image)

    @cached_property
    def engine(self) -> TrainEngine:
        return self.config.train.prepared(self.inputs)

    @cached_property
    def checkpoint(self) -> CheckpointRef:
        return self.engine.expected_result(self.inputs)


def _tokenize_job(run: _Planned) -> JobSpec:
    dataset_uri = storage.parent(run.dataset.manifest_uri)
    return build_tokenize_job(
        storage.join(dataset_uri, "tokenized", "array-plan.json"),
        run.parts,
        run.config.data.workers,
        run.image,
        [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else [],
    )


def _train_job(run: _Planned) -> JobSpec:
    return run.engine.job(run.inputs)


def _validate_job(run: _Planned) -> JobSpec:
    threshold = run.config.validation_threshold
    return build_validate_job(
        run.checkpoint,
        run.dataset,
        threshold,
        report_path(run.checkpoint, threshold),
        run.image,
        resources=validation_resources(run.config.train),
    )


def _serve_spec(run: _Planned) -> ServiceSpec:
    config, serve = run.config, run.config.serve
    fingerprint = deployment_fingerprint(
        run.checkpoint, serve.port, serve.model_name, config.executor, run.image, serve.engine
    )
    return build_serve_spec(
        run.checkpoint, serve.port, serve.model_name, run.backend.bind_host, run.image, fingerprint, serve.engine
    )


# What each stage of flows/end_to_end.py STAGES submits, by the name it submits it under.
BUILDERS: dict[str, Callable[[_Planned], JobSpec | ServiceSpec]] = {
    "tokenize": _tokenize_job,
    "pretrain": _train_job,
    "validate": _validate_job,
    "serve": _serve_spec,
}


def planned_specs(config: EndToEndConfig) -> list[tuple[str, JobSpec | ServiceSpec]]:
    """(stage, spec) for every job and service of one run, in the pipeline's order (the flow's STAGES)."""
    backend = get_backend(config.executor)
    image = backend.planned_image(config.image.source, config.image.dest or default_dest(), config.image.convert)
    dataset, parts = planned_dataset(config)
    run = _Planned(config, backend, image, dataset, parts)
    return [(stage.submits, BUILDERS[stage.submits](run)) for stage in STAGES if stage.submits]
