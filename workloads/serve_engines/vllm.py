"""vLLM's OpenAI server behind nemoflow's proxy (workloads/serve_engines/proxy.py): continuous batching and
tensor parallel over the job's GPUs; the OpenAI API is vLLM's own, the proxy adds NeMo's REST shape, the
API key check on every route and blue/green."""

from __future__ import annotations

import argparse
import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from workloads.serve_engines.base import ENGINE_HOST, ServeEngine, visible_gpus

log = logging.getLogger("nemoflow.serve")

PYTHON_ENV = "NEMOFLOW_VLLM_PYTHON"  # vLLM's own environment (its pins differ from nemoflow's venv)
# vLLM takes 0.9 of each GPU's memory unless told otherwise, and refuses to start where less is free: the
# blue/green switch of a CPT refresh starts the next server beside the serving one on the same GPUs, so
# nemoflow starts vLLM at a share that leaves room for the next one (--engine-arg=--gpu-memory-utilization=X
# overrides it, for a server that is never switched on its own GPUs).
SWITCH_MEMORY_SHARE = 0.45
# Where the engine's stable model paths live (model_link), one directory per user; node-local by default.
MODEL_LINKS_ENV = "NEMOFLOW_VLLM_MODEL_LINKS"
MODEL_LINK_SLOTS = 8  # servers of one user on one node at once (a blue/green switch holds two)
# What a standby vLLM passes on from outside: its OpenAI API and the routes the proxy uses. Its development routes
# (VLLM_SERVER_DEV_MODE: /collective_rpc runs a method in the engine, /sleep, /update_weights, ...) stay loopback.
# A standby vLLM's KV cache, as a share of the GPU's memory (see standby_kv_cache_bytes).
STANDBY_KV_SHARE = 0.25
STANDBY_ROUTES = ("/v1/", "/tokenize", "/detokenize", "/version", "/metrics", "/ping", "/load", "/health")


class Vllm(ServeEngine):
    """vLLM (``vllm serve``) on the node's GPUs; tensor parallel = the server job's GPUs."""

    engine: Literal["vllm"] = "vllm"
    max_input_len: int | None = Field(
        None, ge=1, description="longest prompt in tokens (with max_output_len: vLLM's --max-model-len)"
    )
    max_output_len: int | None = Field(None, ge=1, description="most tokens generated per request")
    engine_args: list[str] = Field(default_factory=list, description="verbatim extra arguments for vllm serve")
    python: str | None = Field(
        None,
        description="the Python of vLLM's own environment (scripts/setup.sh --engine-venv PATH: PATH/bin/python); "
        f"default ${PYTHON_ENV}, else vllm on PATH",
    )

    tensor_parallel: ClassVar[bool] = True
    can_standby: ClassVar[bool] = True  # --load-format dummy, then reload_weights in place (vllm_load)

    def serve(self, args: argparse.Namespace, checkpoint: Path, model_name: str, api_key: str | None) -> int:
        from workloads.serve_engines.proxy import run_engine

        link = model_link(checkpoint)
        try:
            return run_engine(args, vllm_target(args, checkpoint, model_name, link), checkpoint, api_key)
        finally:
            link.release()


def vllm_argv(
    checkpoint: str,
    *,
    model_name: str,
    port: int,
    tensor_parallel_size: int,
    host: str = ENGINE_HOST,
    max_model_len: int | None = None,
    tokenizer: str | None = None,
    extra: Sequence[str] = (),
    executable: str | Sequence[str] = "vllm",
) -> list[str]:
    """``vllm serve`` for one checkpoint (vLLM's flag names; its parser checked them, see the README).

    >>> vllm_argv("/ckpt", model_name="m", port=9000, tensor_parallel_size=4)[:5]
    ['vllm', 'serve', '/ckpt', '--host', '127.0.0.1']
    """
    argv = [
        *([executable] if isinstance(executable, str) else executable),
        "serve",
        checkpoint,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        model_name,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
    ]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    return argv + list(extra)


def vllm_command(python: str | None = None, executable: str = "vllm", environ=None) -> list[str]:
    """How to start vLLM: from its own environment (``python``, else ``$NEMOFLOW_VLLM_PYTHON``: the ``vllm``
    script beside that Python, else ``PYTHON -m vllm.entrypoints.cli.main``), else ``executable`` on PATH."""
    environ = os.environ if environ is None else environ
    python = python or environ.get(PYTHON_ENV) or None
    if python is None:
        return [executable]
    path = Path(python)
    if not path.is_file():
        where = "engine.python" if environ.get(PYTHON_ENV) != python else f"${PYTHON_ENV}"
        raise FileNotFoundError(f"{where}={python}: no such file (vLLM's environment: scripts/setup.sh --engine-venv)")
    script = path.parent / "vllm"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(path), "-m", "vllm.entrypoints.cli.main"]


def vllm_installed(python: str | None = None, executable: str = "vllm", environ=None) -> bool:
    """Whether vLLM can start here: its own environment has it, or ``executable`` is on PATH, or this Python has it."""
    import importlib.util
    import shutil
    import subprocess

    environ = os.environ if environ is None else environ
    python = python or environ.get(PYTHON_ENV) or None
    if python:
        if not Path(python).is_file():
            return False
        probe = "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
        env = {k: v for k, v in environ.items() if k != "PYTHONPATH"}
        try:
            return subprocess.run([python, "-c", probe], env=env, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    return shutil.which(executable) is not None or importlib.util.find_spec("vllm") is not None


def vllm_env(environ: dict[str, str] | None = None, own_environment: bool = False) -> dict[str, str]:
    """The engine's environment: ours, without any ``VLLM_API_KEY``.

    vLLM gets no API key: it listens on loopback behind the proxy, which checks the key (as NeMo's REST service
    behind it does for Triton). vLLM 0.26 hashes every ``VLLM_*`` variable of its environment into its
    torch.compile cache key and writes those factors, values included, to ``cache_key_factors.json`` in its cache
    directory (``vllm/envs.py`` ``compile_factors``, ``vllm/compilation/backends.py``): a key in its environment
    was written to disk in plain text, and a new key per deploy made every start compile again (the H200's
    second start on the same checkpoint at e5b86ee: 19.7 s of torch.compile and 15 s of kernel warm-up again).

    Ours minus PYTHONPATH when vLLM runs from its own environment (nemoflow's checkout must not shadow its
    packages). ``VLLM_USE_FLASHINFER_SAMPLER=0`` unless set: vLLM's sampler imports flashinfer by default on a
    GPU, and the engine environment leaves flashinfer out (its kernels are compiled with nvcc at first use;
    devtools/engine_env.py); sampling then runs in PyTorch.

    ``TRITON_CACHE_DIR`` = ``<vLLM's cache root>/triton`` unless set: otherwise the first Inductor kernel sets it
    to a directory under the compile cache's hash-keyed one (torch's triton_heuristics), so the V2 model runner's
    own Triton kernels, JIT-compiled in its warm-up (15-21 s on the H200), were compiled again whenever that key
    changed. It is not a ``VLLM_*`` variable: it does not enter vLLM's compile key.
    """
    env = dict(os.environ if environ is None else environ)
    env.pop("VLLM_API_KEY", None)  # an inherited one would be written to disk and switch auth on behind the proxy
    if own_environment:
        env.pop("PYTHONPATH", None)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("TRITON_CACHE_DIR", str(vllm_cache_root(env) / "triton"))
    return env


def vllm_cache_root(env: dict[str, str]) -> Path:
    """vLLM's cache directory in ``env`` (``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm``: vLLM 0.26's ``envs.py``)."""
    home = env.get("HOME") or os.path.expanduser("~")
    given = env.get("VLLM_CACHE_ROOT") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "vllm"
    )
    return Path(given.replace("~", home, 1) if given.startswith("~") else given)


@dataclass
class ModelLink:
    """The path vLLM is given for a checkpoint, and the lock that holds it while the engine runs."""

    path: Path
    fd: int | None = None  # the slot's lock (flock), passed to the engine so it is held as long as either lives

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def model_links_root(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    given = environ.get(MODEL_LINKS_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / f"nemoflow-vllm-{os.getuid()}"


def model_link(checkpoint: Path, root: Path | None = None, slots: int = MODEL_LINK_SLOTS) -> ModelLink:
    """A stable path for ``checkpoint``: ``ROOT/model-N``, a symlink to it, N the first slot no running server holds.

    vLLM keys its torch.compile cache on the model path as given (``ModelConfig.model`` is a hash factor; the
    weights are not) and on config.json (vllm/config/model.py ``compute_hash``, vLLM 0.26): served from each
    checkpoint's own directory, every nightly refresh compiles again (15-20 s on an H200) though its shape is the
    same. Served from one of a few fixed paths, a new checkpoint of the same shape finds the compiled graphs. Each
    server takes a slot with a lock (flock, held by the proxy and the engine, which inherits it, until both
    exit), so the two servers of a blue/green switch hold two paths and a link is never re-pointed under a
    running engine; the next refresh takes the slot the stopped server freed. Node-local by default
    (``$TMPDIR/nemoflow-vllm-UID``; ``$NEMOFLOW_VLLM_MODEL_LINKS`` moves it): the same path string on every node,
    so a compile cache on a shared ``VLLM_CACHE_ROOT`` serves them all. Where no slot can be had the checkpoint's
    own path is used (the engine serves the same; only the cache misses), with one line that says why.
    """
    import fcntl

    root = model_links_root() if root is None else root
    why = f"all {slots} model paths under {root} are held by running servers"
    held = None
    try:
        _private_dir(root)
        for n in range(slots):
            held = os.open(root / f"model-{n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a running server holds it
                os.close(held)
                held = None
                continue
            link = root / f"model-{n}"
            tmp = root / f".model-{n}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            os.symlink(checkpoint, tmp)
            os.replace(tmp, link)  # whole: a reader sees the old target or the new one
            log.info(
                "vLLM serves %s as %s (a stable path: its compile cache outlives the checkpoint)", checkpoint, link
            )
            return ModelLink(link, held)
    except OSError as exc:  # a file system without locks or links: serving goes on, its cache misses
        if held is not None:
            os.close(held)
        why = str(exc)
    log.warning("vLLM is given the checkpoint's own path (its compile cache misses on a new path): %s", why)
    return ModelLink(checkpoint)


def _private_dir(root: Path) -> None:
    """``root`` as a directory of this user only (it may sit in a shared /tmp: a planted link or a directory of
    another user would let them redirect what vLLM loads)."""
    try:
        root.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
        raise PermissionError(f"{root} is not a directory of this user only (${MODEL_LINKS_ENV} moves it)")


def vllm_target(args: argparse.Namespace, checkpoint: Path, model_name: str, link: ModelLink | None = None):
    """The engine as the proxy runs it; vLLM is given ``link``'s stable path for the checkpoint (model_link) when
    there is one."""
    from workloads.serve_engines.proxy import EngineTarget, free_port

    port = args.engine_port or free_port()
    command = vllm_command(getattr(args, "vllm_python", None), args.vllm_executable)
    max_model_len = args.max_input_len + args.max_output_len if args.max_input_len and args.max_output_len else None
    tokenizer = None
    if not _given("--tokenizer", args.engine_arg):
        from workloads.serve_engines.hf_tokenizer import tokenizer_dir

        # the export carries tokenizer.model only: vLLM gets a tokenizer.json whose ids are sentencepiece's
        made = tokenizer_dir(checkpoint)
        tokenizer = str(made) if made else None
    extra = list(args.engine_arg)
    if not _given("--gpu-memory-utilization", extra):
        extra = ["--gpu-memory-utilization", str(SWITCH_MEMORY_SHARE), *extra]
    standby = bool(getattr(args, "standby", False))
    env = vllm_env(own_environment=command != [args.vllm_executable])
    if standby:
        # random weights of config.json's shape: vLLM compiles, captures its graphs and warms up while the model
        # trains; vllm_load replaces the weights in place (the RL weight-sync path), so all of that stays valid
        extra = ["--load-format", "dummy", *extra]
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache, on loopback only
        if not _given("--kv-cache-memory-bytes", extra) and (kv_bytes := standby_kv_cache_bytes()):
            extra = ["--kv-cache-memory-bytes", str(kv_bytes), *extra]
    argv = vllm_argv(
        str(link.path if link else checkpoint),
        model_name=model_name,
        port=port,
        tensor_parallel_size=args.tensor_parallel_size or max(1, visible_gpus()),
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        extra=extra,
        executable=command,
    )
    return EngineTarget(
        "vllm",
        argv,
        env,
        f"http://{ENGINE_HOST}:{port}",
        "/health",
        model_name,
        nemo=nemo_completion,
        openai=True,
        pass_fds=(link.fd,) if link and link.fd is not None else (),
        standby=standby,
        load=vllm_load if standby else None,
        forward_only=STANDBY_ROUTES if standby else None,
    )


def standby_kv_cache_bytes(query=None) -> int | None:
    """A standby vLLM's KV cache size: ``STANDBY_KV_SHARE`` of the smallest visible GPU's memory (nvidia-smi), None
    without one. A standby server starts beside a training job on the same GPU, and vLLM 0.26 sizes its KV cache by
    profiling, which assumes nothing else on the GPU changes meanwhile: what the trainer allocates then is counted
    as vLLM's own, and what it frees (its exit) fails the start ("Error in memory profiling", gpu_worker.py). Given a
    size (``--kv-cache-memory-bytes``, not in vLLM's compile key), vLLM skips that profiling."""
    import subprocess

    if query is None:
        command = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible and all(part.strip().isdigit() for part in visible.split(",")):
            command += ["-i", visible]
        try:
            query = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
    totals = [int(line.strip()) for line in query.splitlines() if line.strip().isdigit()]
    return int(min(totals) * 2**20 * STANDBY_KV_SHARE) if totals else None


async def vllm_load(client, target, checkpoint: str) -> None:
    """A checkpoint's weights into a vLLM started with ``--load-format dummy``, in place: its loader set back to
    reading files (``update_config``), ``reload_weights(weights_path=...)`` (vLLM 0.26's GPUModelRunner: layerwise,
    into the parameters' own storage, so the compiled graphs and captured CUDA graphs stay valid), then its prefix
    cache emptied (blocks computed with the random weights, by its warm-up, must never be reused)."""
    from workloads.serve_engines.proxy import engine_error, json_or_none

    calls = (
        (
            "/collective_rpc",
            {"method": "update_config", "kwargs": {"overrides": {"load_config": {"load_format": "auto"}}}},
        ),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}}),
        ("/reset_prefix_cache", None),
    )
    for path, body in calls:
        response = await client.post(path, json=body, timeout=None)
        if response.status_code != 200:
            raise engine_error(target.kind, response.status_code, json_or_none(response), response.text)


def _given(flag: str, engine_args: list[str]) -> bool:
    """Whether the user's engine arguments set ``flag`` (``--flag VALUE`` or ``--flag=VALUE``)."""
    return any(a.split("=", 1)[0] == flag for a in engine_args)


async def nemo_completion(client, target, prompt: str, sampling) -> str:
    """NeMo's REST shape as a vLLM completion: the prompt counted first (vLLM's /tokenize), so a request
    for more tokens than the context has room for generates what fits instead of failing."""
    import httpx

    from workloads.serve_engines.proxy import engine_error, json_or_none, unreachable
    from workloads.serve_http import bad_request

    max_tokens = sampling.max_tokens
    try:
        counted = await client.post(
            "/tokenize", json={"model": target.model_name, "prompt": prompt}, headers=target.auth_headers()
        )
        if counted.status_code == 200:
            info = counted.json()
            room = int(info["max_model_len"]) - int(info["count"])
            if room < 1:
                raise bad_request(
                    f"This model's maximum context length is {info['max_model_len']} tokens and the prompt "
                    f"has {info['count']} tokens: no room to generate. Shorten the prompt.",
                    param="prompt",
                    code="context_length_exceeded",
                )
            max_tokens = min(max_tokens, room)
    except httpx.HTTPError as exc:
        raise unreachable(target, exc) from exc
    payload: dict[str, Any] = {"model": target.model_name, "prompt": prompt, "max_tokens": max_tokens}
    if sampling.greedy:
        payload["temperature"] = 0.0
    else:
        payload.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.top_k > 1:
            payload["top_k"] = sampling.top_k
    try:
        response = await client.post("/v1/completions", json=payload, headers=target.auth_headers())
    except httpx.HTTPError as exc:
        raise unreachable(target, exc) from exc
    body = json_or_none(response)
    if response.status_code != 200 or not isinstance(body, dict):
        raise engine_error(target.kind, response.status_code, body, response.text)
    return body["choices"][0]["text"]
