"""Dataset preparation stage: download -> extract -> concatenate -> tokenize -> blend.

Built for SlimPajama's 59,166 shards: the flow process only orchestrates, and its cost per
shard is a dictionary lookup, not a Prefect task run.

- :func:`check_shards` (in the flow, one pass): the sources' identities (a ``stat`` per local
  file, one listing per GCS folder; HTTP(S) sources are trusted as recorded unless
  ``revalidate``), compared with the shard manifest (workloads/shard_manifest.py): every shard
  whose record is missing or stale is pending.
- :func:`fetch_shards` (one task run): ONE job array downloads and extracts the pending shards,
  spread over the array's tasks (workloads/fetch_array.py: local processes, a Slurm array, an
  Indexed Job); then the tasks' journals are merged into the manifest, and shards that failed
  are shown (artifact ``failed-shards``) and named in the error. Not called when nothing is
  pending.
- :func:`tokenize_parts` (one task run): ONE job array concatenates and tokenizes every part
  (``shards_per_file`` shards) not already tokenized with the same identity.
- :func:`write_blend` (one task run): NeMo blend weights and the manifest.

A re-run with nothing changed therefore makes two task runs (both ``Cached``), whatever the
number of shards; the Prefect database grows by a bounded amount per run. Progress is one
progress artifact, updated from the array tasks' progress files while the jobs run.

Layout under the dataset URI (``<work_dir>/datasets/<name>`` by default)::

    raw/<chunk>/<shard>.jsonl.zst      downloaded shards (+ .meta.json sidecars from infra.fetch)
    extracted/<chunk>/<shard>.jsonl    streamed out of the .zst (+ .shard.json: the shard's record)
    shards/manifest.jsonl              every shard's record, read by the flow in one go
    shards/journal/, shards/plans/     the fetch job's plan and reports (transient)
    concat/part-00000.jsonl            N shards per part, deterministic order
    tokenized/part-00000_text_document.bin/.idx (+ .stats.json)
    blend.json       NeMo data_prefix as JSON: [w1, "prefix1", w2, "prefix2", ...]
    data_prefix.txt  the same list as NeMo's auto_blend.py prints it
    manifest.json    everything above, machine-readable (DatasetManifest)

One module per step; callers import the package (``from tasks.data import ...``), which names them all
except the knobs (``fetching.MIN_SHARDS_PER_FETCH_TASK``, ...): set those on their module.

* ``records.py``     what the steps hand each other (:class:`DatasetManifest`, :class:`PartKey`), :class:`Progress`
* ``checking.py``    :func:`check_shards` and the parts' keys (which parts are pending)
* ``fetching.py``    :func:`write_fetch_plan`, :func:`fetch_shards` (download + extract)
* ``tokenizing.py``  :func:`tokenize_parts` (concatenate + tokenize)
* ``blending.py``    :func:`write_blend`, :func:`blend_weights`, :func:`auto_blend_text`, :func:`publish_table`
"""

from __future__ import annotations

from tasks.data.blending import auto_blend_text, blend_weights, publish_table, write_blend, write_json_streaming
from tasks.data.checking import (
    ShardCheck,
    check_shards,
    concat_uri,
    extracted_uri,
    iter_identities,
    output_base,
    part_done,
    part_identity,
    part_inputs,
    part_keys,
    raw_uri,
    settle_parts,
    url_scheme,
)
from tasks.data.fetching import (
    build_fetch_job,
    fetch_shards,
    fetch_task_count,
    job_paths,
    new_plan_id,
    planned_fetch_job,
    secret_env,
    write_fetch_plan,
)
from tasks.data.records import DatasetManifest, FetchSummary, PartInput, PartKey, Progress, ShardsFailed
from tasks.data.tokenizing import (
    build_tokenize_job,
    shards_digest,
    tokenize_cache_policy,
    tokenize_parts,
    tokenized_so_far,
)

__all__ = [
    "DatasetManifest",
    "FetchSummary",
    "PartInput",
    "PartKey",
    "Progress",
    "ShardCheck",
    "ShardsFailed",
    "auto_blend_text",
    "blend_weights",
    "build_fetch_job",
    "build_tokenize_job",
    "check_shards",
    "concat_uri",
    "extracted_uri",
    "fetch_shards",
    "fetch_task_count",
    "iter_identities",
    "job_paths",
    "new_plan_id",
    "output_base",
    "part_done",
    "part_identity",
    "part_inputs",
    "part_keys",
    "planned_fetch_job",
    "publish_table",
    "raw_uri",
    "secret_env",
    "settle_parts",
    "shards_digest",
    "tokenize_cache_policy",
    "tokenize_parts",
    "tokenized_so_far",
    "url_scheme",
    "write_blend",
    "write_fetch_plan",
    "write_json_streaming",
]
