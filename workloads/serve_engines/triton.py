"""NeMo's Triton deploy (``deploy_triton.py``: the checkpoint exported to TensorRT-LLM, served on Triton with
NeMo's REST service, the seed's path) behind nemoflow's proxy (workloads/serve_engines/proxy.py). NeMo's REST
service speaks only the NeMo shape: the proxy answers it, ``/v1/models`` and ``/health``; OpenAI routes get a
404 that says so. In the NeMo container."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from workloads.serve_engines.base import ENGINE_HOST, ServeEngine, visible_gpus

DEFAULT_SCRIPT = "/opt/NeMo/scripts/deploy/nlp/deploy_triton.py"
DEFAULT_LEN = 256  # NeMo's default max_input_len and max_output_len


class Triton(ServeEngine):
    """NeMo's Triton deploy script on the node's GPUs; tensor parallel = the server job's GPUs."""

    engine: Literal["triton"] = "triton"
    max_input_len: int | None = Field(
        None, ge=1, description=f"longest prompt in tokens (NeMo's default {DEFAULT_LEN})"
    )
    max_output_len: int | None = Field(
        None, ge=1, description=f"most tokens generated per request (NeMo's default {DEFAULT_LEN})"
    )
    engine_args: list[str] = Field(default_factory=list, description="verbatim extra arguments for deploy_triton.py")

    tensor_parallel: ClassVar[bool] = True

    def serve(self, args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
        from workloads.serve_engines.proxy import run_engine

        return run_engine(args, triton_target(args, checkpoint, model_name), checkpoint, api_key)


def triton_argv(
    checkpoint: str,
    *,
    model_name: str,
    model_type: str,
    triton_port: int,
    service_port: int,
    tensor_parallel_size: int,
    max_input_len: int,
    max_output_len: int,
    host: str = ENGINE_HOST,
    script: str = DEFAULT_SCRIPT,
    model_repository: str | None = None,
    extra: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """NeMo's ``deploy_triton.py`` exporting a Hugging Face checkpoint to TensorRT-LLM, serving it on
    Triton with NeMo's REST service (the seed's path). Flag names are NeMo's.

    ``--start_rest_service`` is ``type=bool`` in NeMo's parser: any non-empty string is true, so it
    is given "True". ``model_type`` is the checkpoint's architecture (``LlamaForCausalLM``,
    ``MixtralForCausalLM``), the key of NeMo's Hugging Face export table.
    """
    argv = [
        python,
        script,
        "--hf_model_id_path",
        checkpoint,
        "--model_type",
        model_type,
        "--triton_model_name",
        model_name,
        "--triton_port",
        str(triton_port),
        "--triton_http_address",
        host,
        "--tensor_parallelism_size",
        str(tensor_parallel_size),
        "--max_input_len",
        str(max_input_len),
        "--max_output_len",
        str(max_output_len),
        "--start_rest_service",
        "True",
        "--service_http_address",
        host,
        "--service_port",
        str(service_port),
    ]
    if model_repository:
        argv += ["--triton_model_repository", model_repository]
    return argv + list(extra)


def triton_cwd(script: str) -> str:
    """NeMo's checkout root: deploy_triton.py writes, and its REST service reads, the relative path
    ``nemo/deploy/service/config.json``, so the script must run from there."""
    return str(Path(script).resolve().parents[3])


def checkpoint_architecture(checkpoint: Path) -> str:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        return str(config["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SystemExit(
            f"serve: --engine triton needs {checkpoint}/config.json with an 'architectures' entry "
            f"(the Hugging Face export's model type): {exc}"
        ) from exc


def triton_target(args: argparse.Namespace, checkpoint: Path, model_name: str):
    from workloads.serve_engines.proxy import EngineTarget, free_port

    triton_port = args.engine_port or free_port()
    service_port = free_port()
    max_output_len = args.max_output_len or DEFAULT_LEN
    argv = triton_argv(
        str(checkpoint),
        model_name=model_name,
        model_type=checkpoint_architecture(checkpoint),
        triton_port=triton_port,
        service_port=service_port,
        tensor_parallel_size=args.tensor_parallel_size or max(1, visible_gpus()),
        max_input_len=args.max_input_len or DEFAULT_LEN,
        max_output_len=max_output_len,
        script=args.triton_script,
        model_repository=args.triton_model_repository,
        extra=args.engine_arg,
        python=sys.executable,
    )
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    return EngineTarget(
        "triton",
        argv,
        env,
        f"http://{ENGINE_HOST}:{service_port}",
        "/v1/triton_health",
        model_name,
        nemo=nemo_completion,
        api_key=None,  # NeMo's REST service has no key; it listens on loopback only
        cwd=triton_cwd(args.triton_script),
        max_output_len=max_output_len,
        engine_url=f"http://{ENGINE_HOST}:{triton_port}",
    )


async def nemo_completion(client, target, prompt: str, sampling) -> str:
    """NeMo's REST shape passed to NeMo's REST service, which speaks it (max_tokens capped at max_output_len)."""
    import httpx

    from workloads.serve_engines.proxy import engine_error, json_or_none, unreachable

    payload = {
        "model": target.model_name,
        "prompt": prompt,
        "max_tokens": min(sampling.max_tokens, target.max_output_len or sampling.max_tokens),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    try:
        response = await client.post("/v1/completions/", json=payload)
    except httpx.HTTPError as exc:
        raise unreachable(target, exc) from exc
    body = json_or_none(response)
    # NeMo's REST service answers failures as 200 {"error": "An exception occurred"}
    if response.status_code != 200 or not isinstance(body, dict) or "output" not in body:
        raise engine_error(target.kind, response.status_code, body, response.text)
    return body["output"]
