"""Stage: smoke-test a deployed endpoint with the request the seed scripts send.

    result = smoke_test(endpoint)                       # the seed's request; SmokeTestFailed on failure
    result = smoke_test(endpoint, shape="openai")       # an OpenAI completion instead
    result = smoke_test(endpoint, api_key_env="NEMOFLOW_SERVE_API_KEY")

``shape="seed"`` (the default) is the seed's request byte for byte: NeMo's REST shape in front of
Triton, at the trailing-slash path, read back as ``{"output": ...}``::

    curl -X POST {url}/v1/chat/completions/ -H 'Content-Type: application/json' \\
      -d '{"prompt": "...", "model": "...", "max-tokens": 2048, "top_p": 0, "top_k": 0.9, "temperature": 1.0}'

(what those values mean is in workloads/serve_http.py: greedy decoding, as NeMo's Triton path does).
``shape="openai"`` posts ``{"model", "prompt", "max_tokens", "temperature": 0}`` to
``/v1/completions`` and reads ``choices[0].text``.

It passes when a non-empty continuation comes back within ``timeout_s``. Transient failures
(connection refused or reset, 429/502/503/504) are retried with exponential backoff (tenacity) for
up to ``retry_s``; a failure that persists raises naming the endpoint, the attempts and the last
lines of the server's log (local servers). Either way a markdown artifact shows the request, the
output, the latency and the status. The API key, when the endpoint wants one, is read from the
environment variable ``api_key_env`` names; only that name appears in logs and the artifact.

Caching: a result stays valid while the same server process (same registry
entry: pid and start time) serves the endpoint; a redeployed or restarted
server is tested again. Endpoints outside the local registry are always tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from dataclasses import dataclass
from typing import Literal

import httpx
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import INPUTS, CachePolicy
from pydantic import BaseModel
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from infra import phases
from infra.executors import get_backend
from tasks import gpu_time
from tasks.common import code_fingerprint, logger
from tasks.refs import EndpointRef

DEFAULT_PROMPT = "In the beginning God created"
Shape = Literal["seed", "openai"]
SEED_PATH = "/v1/chat/completions/"
OPENAI_PATH = "/v1/completions"
SEED_MAX_TOKENS = 2048
RETRY_STATUSES = frozenset({429, 502, 503, 504})
LOG_LINES = 15


class SmokeTestFailed(RuntimeError):
    pass


class SmokeResult(BaseModel):
    url: str
    model: str
    prompt: str
    output: str
    latency_s: float
    passed: bool
    status: str
    shape: str = "seed"
    http_status: int | None = None
    attempts: int = 1
    completion_tokens: int | None = None
    finish_reason: str | None = None


class Transient(Exception):
    """A failure worth another try: the server may be starting, restarting or busy."""

    def __init__(self, result: SmokeResult):
        super().__init__(result.status)
        self.result = result


def seed_request(model: str, prompt: str, max_tokens: int = SEED_MAX_TOKENS) -> dict:
    """The seed's body, keys in the seed's order, its sampling values unchanged."""
    return {"prompt": prompt, "model": model, "max-tokens": max_tokens, "top_p": 0, "top_k": 0.9, "temperature": 1.0}


def openai_request(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def request_for(shape: Shape, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    if shape == "seed":
        return SEED_PATH, seed_request(model, prompt, max_tokens)
    if shape == "openai":
        return OPENAI_PATH, openai_request(model, prompt, max_tokens)
    raise ValueError(f"smoke test: unknown shape {shape!r}; use 'seed' (NeMo REST, the default) or 'openai'")


def curl_command(url: str, path: str, body: dict, api_key_env: str | None = None) -> str:
    """The request as a shell command; the key only as a reference to its variable."""
    auth = f' -H "Authorization: Bearer ${api_key_env}"' if api_key_env else ""
    return (
        f"curl -X POST {url.rstrip('/')}{path} -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(json.dumps(body))}"
    )


def read_api_key(api_key_env: str | None) -> str | None:
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env, "").strip()
    if not key:
        raise SmokeTestFailed(
            f"smoke test: the endpoint's API key is expected in the environment variable {api_key_env}, "
            "which is not set here"
        )
    return key


def run_smoke(
    endpoint: EndpointRef,
    body: dict,
    timeout_s: float,
    *,
    shape: Shape = "seed",
    path: str | None = None,
    api_key: str | None = None,
) -> SmokeResult:
    """Send the request once and judge the answer; never raises. A status the server may get over
    (no connection, 429/502/503/504) comes back as a failed result with ``transient`` semantics
    decided by :func:`is_transient`."""
    path = path or (SEED_PATH if shape == "seed" else OPENAI_PATH)
    url = endpoint.url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    result = dict(url=endpoint.url, model=endpoint.model, prompt=body["prompt"], output="", passed=False, shape=shape)
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException:
        return SmokeResult(
            **result, latency_s=time.monotonic() - started, status=f"no answer from {url} within {timeout_s:g}s"
        )
    except httpx.HTTPError as exc:
        return SmokeResult(
            **result, latency_s=time.monotonic() - started, status=f"could not reach {url}: {type(exc).__name__}: {exc}"
        )
    latency = time.monotonic() - started
    result.update(latency_s=latency, http_status=response.status_code)
    try:
        payload = response.json()
    except ValueError:
        return SmokeResult(
            **result, status=f"HTTP {response.status_code} from {url} with a non-JSON body: {response.text[:200]!r}"
        )
    if response.status_code != 200:
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        return SmokeResult(**result, status=f"HTTP {response.status_code} from {url}: {message or payload}")
    if shape == "seed":
        text = payload.get("output") if isinstance(payload, dict) else None
        if not isinstance(text, str):
            return SmokeResult(**result, status=f"{url} answered without an 'output' string: {str(payload)[:200]}")
        result["output"] = text
    else:
        try:
            choice = payload["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            return SmokeResult(**result, status=f"{url} answered without choices[0].text: {str(payload)[:200]}")
        result.update(
            output=text,
            finish_reason=choice.get("finish_reason"),
            completion_tokens=(payload.get("usage") or {}).get("completion_tokens"),
        )
    if not text.strip():
        return SmokeResult(
            **result,
            status=f"{url} returned an empty completion (finish_reason={result.get('finish_reason')!r}, "
            f"completion_tokens={result.get('completion_tokens')})",
        )
    if latency > timeout_s:
        return SmokeResult(**result, status=f"answered after {latency:.1f}s, over the {timeout_s:g}s limit")
    result["passed"] = True
    return SmokeResult(**result, status="passed")


def is_transient(result: SmokeResult) -> bool:
    """No connection at all, or a status that says 'not now' (busy, loading, a proxy's engine restarting)."""
    if result.passed:
        return False
    if result.http_status is None:
        return result.status.startswith("could not reach")
    return result.http_status in RETRY_STATUSES


def smoke_with_retries(
    endpoint: EndpointRef,
    body: dict,
    timeout_s: float,
    *,
    shape: Shape = "seed",
    api_key: str | None = None,
    retry_s: float = 60,
    wait_max_s: float = 10,
    on_retry=None,
) -> SmokeResult:
    """:func:`run_smoke`, again with exponential backoff while the failure is transient."""
    attempts = 0

    def once() -> SmokeResult:
        nonlocal attempts
        attempts += 1
        result = run_smoke(endpoint, body, timeout_s, shape=shape, api_key=api_key)
        result.attempts = attempts
        if is_transient(result):
            raise Transient(result)
        return result

    def before_sleep(state) -> None:
        if on_retry is not None:
            on_retry(state.attempt_number, state.outcome.exception().result.status, state.next_action.sleep)

    retrying = Retrying(
        retry=retry_if_exception_type(Transient),
        stop=stop_after_delay(retry_s),
        wait=wait_exponential(multiplier=0.5, max=wait_max_s),
        before_sleep=before_sleep,
        reraise=False,
    )
    try:
        return retrying(once)
    except RetryError as exc:
        result = exc.last_attempt.exception().result
        result.status = f"{result.status} (still failing after {attempts} attempts over {retry_s:g}s)"
        return result


def server_log_tail(endpoint: EndpointRef, lines: int = LOG_LINES) -> list[str]:
    """The last lines of the server's log, as its backend has them (a file, a job's output, a pod's log)."""
    if not endpoint.handle:
        return []
    try:
        return get_backend(endpoint.executor).service_log_tail(endpoint.handle, lines)
    except Exception:  # noqa: BLE001 - the log only decorates a failure; never replace it
        return []


def _report(result: SmokeResult, path: str, body: dict, api_key_env: str | None, log_lines: list[str]) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    log_block = "\n".join(log_lines)
    server_log = f"\n**Last server log lines**\n\n```text\n{log_block}\n```\n" if log_lines else ""
    return f"""# Smoke test {verdict}: `{result.model}`

| | |
|---|---|
| endpoint | {result.url}{path} |
| request shape | {result.shape} |
| status | {result.status} |
| latency | {result.latency_s:.2f} s |
| attempts | {result.attempts} |
| HTTP status | {result.http_status} |
| completion tokens | {result.completion_tokens} |
| finish reason | {result.finish_reason} |

**Prompt**

```text
{result.prompt}
```

**Output**

```text
{result.output}
```
{server_log}
Reproduce:

```bash
{curl_command(result.url, path, body, api_key_env)}
```
"""


@dataclass
class SameServerProcess(CachePolicy):
    """Inputs + code + the identity of the running server behind the endpoint, as its backend reports
    it (process and start time, Slurm job id, what a Deployment serves).

    No key at all (so no caching) when that server is not running and healthy: a
    compound policy would silently drop a None part and cache on the inputs alone.
    """

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        endpoint = inputs.get("endpoint")
        if endpoint is None or not endpoint.handle:
            return None
        try:
            info = get_backend(endpoint.executor).service(endpoint.handle)
        except Exception:  # noqa: BLE001 - a backend that cannot be asked: test again
            return None
        if info is None or info.url != endpoint.url or not info.healthy:
            return None
        parts = [
            INPUTS.compute_key(task_ctx, inputs, flow_parameters, **kwargs) or "",
            code_fingerprint("tasks.smoke"),
            f"{info.job_id}-{info.details.get('proc_start')}-{info.fingerprint}",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


@task(
    name="smoke-test",
    task_run_name="smoke-test {endpoint.model}",
    persist_result=True,
    cache_policy=SameServerProcess(),
)
def smoke_test(
    endpoint: EndpointRef,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = SEED_MAX_TOKENS,
    timeout_s: float = 60,
    shape: Shape = "seed",
    api_key_env: str | None = None,
    retry_s: float = 60,
) -> SmokeResult:
    """Send the seed's request (or an OpenAI completion); pass on a non-empty continuation within
    ``timeout_s``, retrying transient failures for ``retry_s``."""
    log = logger()
    api_key_env = api_key_env or getattr(endpoint, "api_key_env", None)
    api_key = read_api_key(api_key_env)
    path, body = request_for(shape, endpoint.model, prompt, max_tokens)
    log.info("smoke test: %s", curl_command(endpoint.url, path, body, api_key_env))

    def on_retry(attempt: int, status: str, sleep_s: float) -> None:
        log.warning("smoke test attempt %d: %s; retrying in %.1fs", attempt, status, sleep_s)

    # The server's accelerators are held for the generation: timed for the run's gpu-time artifact (the
    # flow knows the server's resources; this record names none).
    with gpu_time.clocked(None) as clock, clock.part(phases.GENERATION):
        result = smoke_with_retries(
            endpoint, body, timeout_s, shape=shape, api_key=api_key, retry_s=retry_s, on_retry=on_retry
        )
    log_lines = [] if result.passed else server_log_tail(endpoint)
    create_markdown_artifact(
        key="smoke-test-" + "".join(c if c.isalnum() else "-" for c in endpoint.model.lower()).strip("-"),
        markdown=_report(result, path, body, api_key_env, log_lines),
        description=f"smoke test of {endpoint.model}: {'passed' if result.passed else 'FAILED'}",
    )
    if not result.passed:
        tail = ("\nlast server log lines:\n" + "\n".join(log_lines)) if log_lines else ""
        raise SmokeTestFailed(f"smoke test of {endpoint.model} at {endpoint.url}{path} failed: {result.status}{tail}")
    log.info("smoke test passed in %.2fs (attempt %d): %r", result.latency_s, result.attempts, result.output)
    return result
