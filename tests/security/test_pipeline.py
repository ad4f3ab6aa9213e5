"""A real run, as its own process, with signed URLs passed by reference and a permissive inherited umask.

prepare-dataset downloads two shards from a local server that answers only requests carrying the
signature (one query from a Prefect Secret block, one value from an environment variable), then a
two-step pretrain runs on NVIDIA NeMo AutoModel in a job. Afterwards:

* the signature, HF_TOKEN and the endpoint key appear nowhere: not in the Prefect database file,
  the flow runs' parameters as the API (the UI) shows them, artifacts, logs, the run's output,
  or any file the run wrote;
* every file and directory the run wrote (datasets, sidecars, Prefect results, AutoModel's
  checkpoint) has the configured mode and group, although the process started with umask 000.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid

import pytest

from tests.conftest import REPO
from tests.security.leaks import find_leaks, read_all, run_family
from tests.support.fault_server import FaultServer
from tests.support.require import missing
from workloads.demo_data import write_slimpajama_layout

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.filterwarnings("ignore:.*Transformer Engine")]

TOKEN = "sigSENTINEL" + uuid.uuid4().hex
SENTINELS = {
    "signature": TOKEN,
    "HF_TOKEN": "hf_SENTINEL" + uuid.uuid4().hex,
    "NEMOFLOW_SERVE_API_KEY": "sk-SENTINEL" + uuid.uuid4().hex,
}


def _team_group() -> tuple[str, int]:
    """A group other than ours that we may give files to (root may use any)."""
    import grp

    if os.geteuid() != 0:
        others = [g for g in os.getgroups() if g != os.getegid()]
        if not others:
            missing("root or a supplementary group (to check NEMOFLOW_GROUP)", "run the tests as root, as CI does")
        return str(others[0]), others[0]
    group = grp.getgrnam("users")
    return group.gr_name, group.gr_gid


def test_signed_urls_by_reference_leave_no_secret_and_files_get_the_team_mode(prefect_server, work_dir, tmp_path):
    from prefect import get_client
    from prefect.blocks.system import Secret
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    group, gid = _team_group()
    served = tmp_path / "bucket"
    write_slimpajama_layout(served, chunks=4, shards_per_chunk=2)  # a quarter of the KJV in chunk1
    block = "signed-query-" + uuid.uuid4().hex[:8]
    Secret(value=f"X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={TOKEN}").save(block, overwrite=True)

    with FaultServer(served, require_query={"X-Goog-Signature": TOKEN}) as server:
        base = server.url("/train/chunk1")
        sources = [
            f"{base}/example_train_0.jsonl.zst?<secret:{block}>",
            f"{base}/example_train_1.jsonl.zst?X-Goog-Signature=<env:NEMOFLOW_TEST_SIGNATURE>",
        ]
        import requests

        assert requests.get(f"{base}/example_train_0.jsonl.zst", timeout=10).status_code == 403
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            NEMOFLOW_WORK_DIR=str(work_dir),
            NEMOFLOW_UMASK="007",
            NEMOFLOW_GROUP=group,
            NEMOFLOW_TEST_SIGNATURE=TOKEN,
            HF_TOKEN=SENTINELS["HF_TOKEN"],
            NEMOFLOW_SERVE_API_KEY=SENTINELS["NEMOFLOW_SERVE_API_KEY"],
            OMP_NUM_THREADS="1",
        )
        env.pop("WANDB_API_KEY", None)
        proc = subprocess.run(
            [sys.executable, "-m", "tests.security.flows", json.dumps(sources)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            preexec_fn=lambda: os.umask(0),  # a runtime that hands out world-writable files
        )
        gets = [r for r in server.requests if r.method == "GET"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["state"] == "Completed", proc.stderr[-5000:]

    # The downloads worked, with the signature (the server refuses anything else).
    served_ok = {r.path for r in gets if r.status == 200}
    assert served_ok == {"/train/chunk1/example_train_0.jsonl.zst", "/train/chunk1/example_train_1.jsonl.zst"}
    assert outcome["result"]["documents"] > 0 and os.path.isdir(outcome["result"]["checkpoint"])

    # ---------------------------------------------------------------- no secret at rest
    with get_client(sync_client=True) as client:
        family = run_family(client, [outcome["flow_run_id"]])
        assert family[0].parameters == {"sources": sources}  # the references, as the UI shows them
        subflow = [r for r in family if r.name != family[0].name and r.flow_id != family[0].flow_id]
        assert any(f"<secret:{block}>" in json.dumps(r.parameters) for r in subflow), "prepare-dataset records refs"
        logs = read_all(
            client, "read_logs", log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in family]))
        )
        # the data stage logs the fetch job (one array for both shards), so the search below reads real lines
        assert any("downloading and extracting 2 shard(s)" in log.message for log in logs), "the downloads were logged"
    texts = {"the run's stdout": proc.stdout, "the run's stderr": proc.stderr}
    assert find_leaks(SENTINELS, flow_run_ids=[outcome["flow_run_id"]], work_dir=work_dir, texts=texts) == []
    # the search does look where the run left things: the reference (no secret) is found in each place
    reference = {"ref": f"example_train_0.jsonl.zst?<secret:{block}>"}  # the first source, as prepare logs it
    found = find_leaks(reference, flow_run_ids=[outcome["flow_run_id"]], work_dir=work_dir)
    assert {"ref in prefect.db", "ref in a log line of the run"} <= set(found)
    assert any(f.startswith("ref in the parameters of flow run") for f in found)
    assert any(f.startswith("ref in datasets/signed/") for f in found)  # the sidecars and manifest

    # ---------------------------------------------------------------- explicit modes on shared storage
    wrong = []
    for root, dirs, files in os.walk(work_dir):
        for name in [*dirs, *files]:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            want = (0o2770,) if stat.S_ISDIR(st.st_mode) else (0o660, 0o770)
            if mode not in want or st.st_gid != gid:
                wrong.append(f"{os.path.relpath(path, work_dir)}: {mode:04o} gid {st.st_gid}")
    top = os.stat(work_dir)
    assert (stat.S_IMODE(top.st_mode), top.st_gid) == (0o2770, gid)
    assert wrong == []
    written = {os.path.relpath(os.path.join(r, f), work_dir) for r, _, fs in os.walk(work_dir) for f in fs}
    # what was checked: the dataset, its sidecars, Prefect's results and AutoModel's checkpoint
    assert any(p.endswith("_text_document.bin") for p in written)
    assert any(p.endswith(".jsonl.zst.meta.json") for p in written)
    assert any(p.startswith("prefect-results") for p in written)
    assert any(p.endswith(".safetensors") for p in written) and any("optim" in p for p in written)
