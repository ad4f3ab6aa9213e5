"""A promoted model serving on a port, made once per module by a real end-to-end run (tiny model)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.support.tiny import TINY_TRAIN

# The CPT run of a refresh, shrunk: 8 steps of 4 x 64 tokens.
TINY_CPT = {
    "max_steps": 8,
    "global_batch_size": 4,
    "micro_batch_size": 4,
    "lr": 0.002,
    "min_lr": 0.0002,
    "warmup_steps": 2,
    "val_check_interval": 4,
    "ckpt_every_n_steps": 4,
    "limit_val_batches": 2,
    "log_every_n_steps": 2,
}


def write_shard(path: Path, chapters: list[str]) -> Path:
    """A SlimPajama-style .jsonl.zst of real text (KJV chapters)."""
    import zstandard

    body = "".join(json.dumps({"text": c}) + "\n" for c in chapters).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(body))
    os.replace(tmp, path)
    return path


class Poller(threading.Thread):
    """Calls the endpoint over and over (a new connection each time) and counts what failed."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.ok = 0
        self.failures: list[str] = []
        self.models_seen: set[str] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        body = json.dumps({"prompt": "In the beginning", "model": self.model, "max_tokens": 2}).encode()
        while not self._halt.is_set():
            try:
                req = urllib.request.Request(
                    self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=30) as resp:
                    payload = json.load(resp)
                    assert payload["choices"], payload
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
                self.failures.append(f"{time.strftime('%X')} {type(exc).__name__}: {exc}")
            time.sleep(0.05)

    def stop(self) -> Poller:
        self._halt.set()
        self.join(60)
        return self


@pytest.fixture(scope="module")
def cpt_env(prefect_server, tmp_path_factory, mixtral_tokenizer_model):
    """work_dir with a promoted model (end-to-end ran once) serving on ``port``; incoming/ is empty."""
    from infra.settings import reload_settings

    root = tmp_path_factory.mktemp("cpt")
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEMOFLOW_WORK_DIR", str(root / "work"))
        mp.setenv("NEMOFLOW_HOME", str(root / "home"))
        reload_settings()
        from flows.end_to_end import EndToEndConfig, end_to_end

        started = time.monotonic()
        # a smaller corpus than the embedded default (all of KJV) keeps the bootstrap short
        from workloads.demo_data import kjv_chapters

        shard = write_shard(root / "base" / "base.jsonl.zst", kjv_chapters()[600:900])
        summary = end_to_end(
            EndToEndConfig(
                train=TINY_TRAIN,
                validation_threshold=9.5,
                data={"name": "base", "sources": [str(shard)]},
                serve={"port": port, "model_name": "nemoflow-cpt"},
            )
        )
        print(f"bootstrap end-to-end: {time.monotonic() - started:.1f}s")
        try:
            yield {
                "work": root / "work",
                "port": port,
                "url": f"http://127.0.0.1:{port}",
                "summary": summary,
                "model_name": "nemoflow-cpt",
            }
        finally:
            from infra import services

            for handle in services.list_services():
                services.stop_service(handle.name)
    reload_settings()


def completion_ok(url: str, model: str) -> bool:
    body = json.dumps({"prompt": "And God said", "model": model, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bool(json.load(resp)["choices"])
