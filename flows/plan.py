"""The jobs and the server one end-to-end run submits, built by the stages' own builders.

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

from flows.end_to_end import EndToEndConfig, validation_resources
from infra import storage
from infra.executors import get_backend
from infra.jobs import JobSpec, ServiceSpec
from infra.sources import expand_sources
from tasks.checkpoint import build_validate_job, report_path
from tasks.data import build_tokenize_job
from tasks.image import default_dest
from tasks.refs import DatasetRef
from tasks.serve import build_serve_spec, deployment_fingerprint
from tasks.train_engines import TrainInputs


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


def planned_specs(config: EndToEndConfig) -> list[tuple[str, JobSpec | ServiceSpec]]:
    """(stage, spec) for every job and service of one run, in pipeline order."""
    backend = get_backend(config.executor)
    image = backend.planned_image(config.image.source, config.image.dest or default_dest(), config.image.convert)
    dataset, parts = planned_dataset(config)
    data = config.data
    dataset_uri = storage.parent(dataset.manifest_uri)
    tokenize = build_tokenize_job(
        storage.join(dataset_uri, "tokenized", "array-plan.json"),
        parts,
        data.workers,
        image,
        [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else [],
    )
    inputs = TrainInputs(dataset=dataset, image=image)
    engine = config.train.prepared(inputs)
    train = engine.job(inputs)
    checkpoint = engine.expected_result(inputs)
    validate = build_validate_job(
        checkpoint,
        dataset,
        config.validation_threshold,
        report_path(checkpoint, config.validation_threshold),
        image,
        resources=validation_resources(config.train),
    )
    serve = build_serve_spec(
        checkpoint,
        config.serve.port,
        config.serve.model_name,
        backend.bind_host,
        image,
        deployment_fingerprint(
            checkpoint, config.serve.port, config.serve.model_name, config.executor, image, config.serve.engine
        ),
        config.serve.engine,
    )
    return [("tokenize", tokenize), ("pretrain", train), ("validate", validate), ("serve", serve)]
