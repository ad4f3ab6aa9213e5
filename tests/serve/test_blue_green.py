"""Blue/green under load: the CPT zero-downtime switch (``tasks.promote.switch_serving`` ->
``LocalBackend.switch_service``) with real servers while 8 clients keep calling the public port.

Each client opens a new connection for every request (the case that once saw ``Connection reset by peer``:
a connection queued on the server that was leaving). Every request a client sent and did not get a
complete 200 answer for is counted; the goal is 0. The fault table's row counts the switches that
happened (the old server's process is gone) and, as data lost, the requests that got no answer.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest
import torch

from infra import processes, services
from tests.conftest import free_port
from tests.support import fault_ledger
from workloads.serve_engines.vllm import PYTHON_ENV

from .conftest import MODEL_NAME

CLIENTS = 8
PAUSE_S = 0.05  # between a client's requests: 8 clients still keep several connections open at any moment,
# and leave the 2 cores enough room to start the next server within seconds


class Client(threading.Thread):
    """Calls /v1/completions over and over, a new connection each time; records every outcome."""

    def __init__(self, url: str, number: int):
        super().__init__(daemon=True, name=f"client-{number}")
        self.url = url
        self.sent: list[float] = []  # start time of every request sent
        self.answered: set[int] = set()  # indexes of the requests answered completely
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        body = json.dumps({"prompt": "In the beginning", "model": MODEL_NAME, "max_tokens": 2}).encode()
        while not self.halt.is_set():
            index = len(self.sent)
            self.sent.append(time.monotonic())
            request = urllib.request.Request(
                self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    payload = json.load(answer)
                    if answer.status == 200 and payload["choices"][0]["text"] is not None:
                        self.answered.add(index)
                    else:
                        self.failures.append(f"request {index}: status {answer.status}: {payload}")
            except Exception as exc:  # noqa: BLE001 - every failure a client sees is counted and asserted on
                self.failures.append(f"request {index}: {type(exc).__name__}: {exc}")
            self.halt.wait(PAUSE_S)


@pytest.mark.slow
@pytest.mark.faults
def test_switches_under_eight_concurrent_clients_fail_no_request(prefect_server, work_dir, tiny_checkpoint):
    switch_twice_under_load(tiny_checkpoint, None, f"blue/green switch (CPT) under {CLIENTS} concurrent clients")


@pytest.mark.gpu
@pytest.mark.faults
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run it on a GPU machine)")
@pytest.mark.skipif(
    not os.environ.get(PYTHON_ENV), reason="set NEMOFLOW_VLLM_PYTHON to vLLM's environment (a GPU node's install)"
)
def test_vllm_switches_on_one_gpu_under_eight_concurrent_clients_fail_no_request(
    prefect_server, work_dir, tmp_path, mixtral_tokenizer_model
):
    """The same switch with vLLM serving on one GPU: the next vLLM starts beside the serving one on the same
    GPU (each takes the engine's default share of its memory), then takes the port. A model whose attention
    heads vLLM's kernels take (head size 64); ``--enforce-eager`` starts each server without compiling (what is
    measured here is the switch, not the engine's speed)."""
    from infra.jobs import Resources
    from tests.support.tiny_models import tiny_llama
    from workloads.serve_engines import Vllm

    wide = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=512)  # head size 64
    checkpoint = tiny_llama(tmp_path / "llama-h256", mixtral_tokenizer_model, 1234, **wide)
    engine = Vllm(engine_args=["--enforce-eager", "--max-model-len=512"], resources=Resources(gpus_per_node=1))
    switch_twice_under_load(checkpoint, engine, f"blue/green switch (CPT), vLLM on one GPU, {CLIENTS} clients")


def switch_twice_under_load(checkpoint_dir, engine, row_name: str) -> None:
    from tasks.promote import switch_serving
    from tasks.refs import CheckpointRef

    port = free_port()
    checkpoint = CheckpointRef(uri=str(checkpoint_dir), step=0)
    row = fault_ledger.open_row(row_name)
    serving = switch_serving.fn(checkpoint, "m-blue-0", None, port, MODEL_NAME, engine=engine)
    clients = [Client(serving.url, i) for i in range(CLIENTS)]
    windows = []
    try:
        for client in clients:
            client.start()
        time.sleep(1)
        for generation in (1, 2):  # the first server is replaced, then the one that replaced it (a relay)
            old = services.get_service(serving.service)
            started = time.monotonic()
            serving = switch_serving.fn(checkpoint, f"m-green-{generation}", serving, port, MODEL_NAME, engine=engine)
            windows.append((started, time.monotonic()))
            assert services.get_service(old.name) is None
            row.injected += not processes.pid_alive(old.pid)  # the old server is gone: the switch happened
            time.sleep(1)
    finally:
        for client in clients:
            client.halt.set()
        for client in clients:
            client.join(90)
        for entry in services.list_services():
            services.stop_service(entry.name, grace_s=5)

    sent = {(c.name, i): "answered" for c in clients for i in range(len(c.sent))}
    answered = {(c.name, i): "answered" for c in clients for i in c.answered}
    lost = row.compare(sent, answered)
    during = [sum(1 for t in c.sent if any(a <= t <= b for a, b in windows)) for c in clients]
    failures = [f for c in clients for f in c.failures]
    print(
        f"{len(sent)} requests from {CLIENTS} clients, {sum(during)} sent during the 2 switches "
        f"({', '.join(f'{b - a:.1f}s' for a, b in windows)}); {lost} without an answer"
    )
    assert not failures, failures[:10]
    assert lost == 0
    assert all(n >= 3 for n in during), during  # every client kept calling while each switch ran
