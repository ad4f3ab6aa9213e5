"""Stage: smoke-test a deployed endpoint with the request the seed scripts send.

    result = smoke_test(endpoint)       # raises SmokeTestFailed with a clear message

The request is the seed's ``curl`` (NeMo/Triton deploy style, hyphenated ``max-tokens``)::

    curl -X POST {url}/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "...", "model": "...", "max-tokens": 20, "temperature": 0.7, "top_p": 0.9, "top_k": 1}'

It passes when a non-empty completion comes back within ``timeout_s``. Either
way a markdown artifact shows the prompt, the output, the latency and the status.

Caching: a result stays valid while the same server process (same registry
entry: pid and start time) serves the endpoint; a redeployed or restarted
server is tested again. Endpoints outside the local registry are always tested.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import dataclass

import httpx
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import INPUTS, CachePolicy
from pydantic import BaseModel

from infra.executors import get_backend
from tasks.common import code_fingerprint, logger
from tasks.refs import EndpointRef

DEFAULT_PROMPT = "In the beginning God created"


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
    http_status: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


def seed_request(endpoint: EndpointRef, prompt: str, max_tokens: int, temperature: float, top_p: float, top_k: int):
    return {
        "prompt": prompt,
        "model": endpoint.model,
        "max-tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }


def curl_command(url: str, body: dict) -> str:
    return f"curl -X POST {url}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"


def run_smoke(endpoint: EndpointRef, body: dict, timeout_s: float) -> SmokeResult:
    """Send the request and judge the answer; never raises (the status says what went wrong)."""
    url = endpoint.url.rstrip("/") + "/v1/completions"
    started = time.monotonic()
    result = dict(url=endpoint.url, model=endpoint.model, prompt=body["prompt"], output="", passed=False)
    try:
        response = httpx.post(url, json=body, timeout=timeout_s)
    except httpx.TimeoutException:
        return SmokeResult(
            **result, latency_s=time.monotonic() - started, status=f"no answer from {url} within {timeout_s:g}s"
        )
    except httpx.HTTPError as exc:
        return SmokeResult(**result, latency_s=time.monotonic() - started, status=f"could not reach {url}: {exc}")
    latency = time.monotonic() - started
    result.update(latency_s=latency, http_status=response.status_code)
    try:
        payload = response.json()
    except ValueError:
        return SmokeResult(
            **result, status=f"HTTP {response.status_code} from {url} with a non-JSON body: {response.text[:200]!r}"
        )
    if response.status_code != 200:
        message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
        return SmokeResult(**result, status=f"HTTP {response.status_code} from {url}: {message or payload}")
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
            status=f"{url} returned an empty completion (finish_reason={choice.get('finish_reason')!r}, "
            f"completion_tokens={result['completion_tokens']})",
        )
    if latency > timeout_s:
        return SmokeResult(**result, status=f"answered after {latency:.1f}s, over the {timeout_s:g}s limit")
    result["passed"] = True
    return SmokeResult(**result, status="passed")


def _report(result: SmokeResult, body: dict) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    return f"""# Smoke test {verdict}: `{result.model}`

| | |
|---|---|
| endpoint | {result.url} |
| status | {result.status} |
| latency | {result.latency_s:.2f} s |
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

Reproduce:

```bash
{curl_command(result.url, body)}
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
    max_tokens: int = 20,
    timeout_s: float = 30,
    temperature: float = 0.7,
    top_p: float = 0.9,
    top_k: int = 1,
) -> SmokeResult:
    """Send the seed's completion request; pass on a non-empty completion within ``timeout_s``."""
    log = logger()
    body = seed_request(endpoint, prompt, max_tokens, temperature, top_p, top_k)
    log.info("smoke test: %s", curl_command(endpoint.url, body))
    result = run_smoke(endpoint, body, timeout_s)
    create_markdown_artifact(
        key="smoke-test-" + "".join(c if c.isalnum() else "-" for c in endpoint.model.lower()).strip("-"),
        markdown=_report(result, body),
        description=f"smoke test of {endpoint.model}: {'passed' if result.passed else 'FAILED'}",
    )
    if not result.passed:
        raise SmokeTestFailed(f"smoke test of {endpoint.model} at {endpoint.url} failed: {result.status}")
    log.info("smoke test passed in %.2fs: %r", result.latency_s, result.output)
    return result
