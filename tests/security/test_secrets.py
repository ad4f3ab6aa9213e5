"""Credentials by reference (infra/secrets.py): the validator, its JSON-schema twin, resolution and redaction.

The transfer test downloads for real from a local server that answers only with the signature.
"""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict

from infra import secrets
from infra.secrets import CredentialInParameter, SecretError, check_no_credentials, credential_problem, resolve
from tests.support.fault_server import FaultServer

TOKEN = "sigSENTINEL" + uuid.uuid4().hex  # never to be seen outside the request that carries it

ALLOWED = [
    "https://huggingface.co/datasets/x/resolve/main/train/chunk1/example_train_0.jsonl.zst",
    "https://h/f.jsonl.zst?download=true",
    "https://h/f.jsonl.zst?<secret:signed-query>",
    "https://h/f.jsonl.zst?X-Goog-Signature=<env:SIGNATURE>",
    "https://h/f.jsonl.zst?download=true&token=<env:T>",
    "https://user:<env:PASSWORD>@h/f.jsonl.zst",
    "https://<env:USER>:<secret:password>@h/f.jsonl.zst",
    "https://<secret:token>@h/f.jsonl.zst",
    "https://h/chunk{chunk}/example_train_{shard}.jsonl.zst?<secret:q>",
    "gs://bucket/raw/**/*.jsonl.zst",
    "gs://bucket/raw/part-?.jsonl.zst",
    "/data/raw/part-?.jsonl",
    "/data/with@sign/file.jsonl",
    "docker://nvcr.io/nvidia/nemo:25.02",
    "nvcr.io/nvidia/nemo@sha256:" + "a" * 64,
    "ubuntu@sha256:" + "b" * 64,
    "localhost:5000/team/img@sha256:" + "c" * 64,
    "gs://vmds-containers-<region>/nemo/nemo-20250721.sqsh",
    "python-env",
]
REFUSED = {
    f"https://storage.googleapis.com/b/f.jsonl.zst?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={TOKEN}": (
        "X-Goog-Algorithm, X-Goog-Signature"
    ),
    f"https://acct.blob.core.windows.net/c/f.jsonl.zst?sv=2022&sig={TOKEN}": "sv, sig",
    f"HTTPS://h/f?token={TOKEN}": "token",
    f"https://h/f?download_token={TOKEN}": "download_token",
    f"https://h/f?X-Goog-Signature=<env:S>{TOKEN}": "X-Goog-Signature",
    f"https://h/f?token={TOKEN}#part": "token",
    f"https://alice:{TOKEN}@h/f.jsonl.zst": "user info",
    f"https://{TOKEN}@h/f.jsonl.zst": "user info",
    f"docker://alice:{TOKEN}@nvcr.io/nvidia/nemo:25.02": "NEMOFLOW_REGISTRY_PASSWORD",
    f"alice:{TOKEN}@nvcr.io/nvidia/nemo:25.02": "NEMOFLOW_REGISTRY_PASSWORD",
}


@pytest.mark.parametrize("value", ALLOWED)
def test_allowed_values_pass_both_the_validator_and_the_schema_pattern(value):
    assert credential_problem(value) is None
    assert check_no_credentials(value) == value
    # jsonschema is what a Prefect server runs on a deployment's parameters
    jsonschema.validate(value, {"type": "string", "pattern": secrets.NO_CREDENTIALS_PATTERN})


# ids without the random TOKEN: every pytest-xdist worker must collect the same test names
@pytest.mark.parametrize(("value", "named"), list(REFUSED.items()), ids=[v.replace(TOKEN, "TOKEN") for v in REFUSED])
def test_literal_credentials_are_refused_by_both_without_being_repeated(value, named):
    with pytest.raises(CredentialInParameter) as info:
        check_no_credentials(value, "sources[0]")
    message = str(info.value)
    assert "\n" not in message and message.startswith("sources[0]: ")
    assert TOKEN not in message
    assert named in message
    if "NEMOFLOW_REGISTRY" not in named:
        assert "<secret:NAME>" in message and "<env:NAME>" in message
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, {"type": "string", "pattern": secrets.NO_CREDENTIALS_PATTERN})


def test_the_pattern_uses_no_python_only_syntax():
    # The Prefect UI validates with JavaScript regexes: no inline flags, named groups or possessive forms.
    assert not re.search(r"\(\?[aiLmsux]|\(\?P<|\(\?<[=!]", secrets.NO_CREDENTIALS_PATTERN)


def test_image_config_refuses_a_signed_url_naming_the_field_only():
    from pydantic import ValidationError

    from tasks.image import ImageConfig

    with pytest.raises(ValidationError) as info:
        ImageConfig(source=f"https://h/nemo.sqsh?X-Goog-Signature={TOKEN}")
    assert TOKEN not in str(info.value)
    assert info.value.errors()[0]["type"] == secrets.CREDENTIAL_ERROR
    assert ImageConfig(source="https://h/nemo.sqsh?<secret:nemo-image-query>").source.endswith(
        "<secret:nemo-image-query>"
    )
    schema = json.dumps(ImageConfig.model_json_schema())
    assert json.dumps(secrets.NO_CREDENTIALS_PATTERN) in schema


def test_stage_image_cli_refuses_a_literal_before_any_flow_run(capsys, prefect_server):
    from prefect import get_client

    from nemoflow.cli import main

    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs(limit=200))
    assert main(["stage-image", f"https://h/nemo.sqsh?X-Goog-Signature={TOKEN}", "--backend", "local"]) == 2
    err = capsys.readouterr().err
    assert "X-Goog-Signature" in err and "<secret:NAME>" in err and TOKEN not in err
    with get_client(sync_client=True) as client:
        assert len(client.read_flow_runs(limit=200)) == before


def test_resolve_env_and_blocks_and_hide_every_resolved_value():
    from infra import transfer
    from infra.settings import redact

    secrets.forget()
    blocks = {"signed-query": f"X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={TOKEN}"}
    url = "https://u:<env:PW>@h/f.jsonl.zst?<secret:signed-query>"
    resolved = resolve(url, environ={"PW": "hunter2-password"}, load_block=blocks.__getitem__)
    assert resolved == f"https://u:hunter2-password@h/f.jsonl.zst?{blocks['signed-query']}"
    assert resolve("https://h/plain.jsonl") == "https://h/plain.jsonl"
    # whatever a client prints afterwards loses the values: whole, URL-quoted, or one parameter alone
    line = f"GET {resolved} failed; signature {TOKEN}; quoted {blocks['signed-query'].replace('&', '%26')}"
    for text in (redact(line), transfer.redact(line)):
        assert TOKEN not in text and "hunter2-password" not in text
    secrets.forget()
    assert TOKEN in redact(f"signature {TOKEN}")


def test_unresolvable_references_name_the_reference_only():
    with pytest.raises(SecretError, match=r"<env:NO_SUCH_VAR>: environment variable NO_SUCH_VAR is not set"):
        resolve("https://h/f?<env:NO_SUCH_VAR>", environ={})
    with pytest.raises(SecretError, match="not an environment variable name"):
        resolve("https://h/f?<env:1bad>", environ={"1bad": "x"})

    def missing(name):
        raise SecretError(f"<secret:{name}>: no Prefect Secret block named {name!r}")

    with pytest.raises(SecretError, match="<secret:gone>"):
        resolve("https://h/f?<secret:gone>", load_block=missing)


def test_secret_blocks_resolve_through_the_prefect_api(prefect_server):
    from prefect.blocks.system import Secret

    secrets.forget()
    name = "nemoflow-test-" + uuid.uuid4().hex[:8]
    Secret(value=f"X-Goog-Signature={TOKEN}").save(name, overwrite=True)
    assert resolve(f"https://h/f?<secret:{name}>") == f"https://h/f?X-Goog-Signature={TOKEN}"
    with pytest.raises(SecretError, match=r"no Prefect Secret block named 'nemoflow-absent'"):
        resolve("https://h/f?<secret:nemoflow-absent>")
    secrets.forget()


def test_download_by_reference_reaches_a_server_that_wants_the_signature(tmp_path, monkeypatch, work_dir):
    from infra.fetch import FetchError, download

    secrets.forget()
    root = tmp_path / "srv"
    root.mkdir()
    (root / "shard.jsonl").write_bytes(b'{"text": "in the beginning"}\n' * 100)
    monkeypatch.setenv("NEMOFLOW_TEST_SIGNATURE", TOKEN)
    lines: list[str] = []
    with FaultServer(root, require_query={"X-Goog-Signature": TOKEN}) as server:
        bare = server.url("/shard.jsonl")
        import requests

        assert requests.get(bare, timeout=10).status_code == 403  # the signature is required
        result = download(
            bare + "?X-Goog-Signature=<env:NEMOFLOW_TEST_SIGNATURE>", str(tmp_path / "out.jsonl"), log=lines.append
        )
        assert [r.status for r in server.requests_for("/shard.jsonl") if r.method == "GET"][-1] == 200
        # a missing variable fails in one line naming it, without a request
        monkeypatch.delenv("NEMOFLOW_TEST_SIGNATURE")
        secrets.forget()
        with pytest.raises(FetchError, match="NEMOFLOW_TEST_SIGNATURE is not set"):
            download(bare + "?X-Goog-Signature=<env:NEMOFLOW_TEST_SIGNATURE>", str(tmp_path / "again.jsonl"))
    assert (tmp_path / "out.jsonl").read_bytes() == (root / "shard.jsonl").read_bytes()
    for recorded in (result.model_dump_json(), *lines, (tmp_path / "out.jsonl.meta.json").read_text()):
        assert TOKEN not in recorded
    assert result.url.endswith("?X-Goog-Signature=<env:NEMOFLOW_TEST_SIGNATURE>")  # the reference is no secret
    secrets.forget()


@pytest.mark.prefect
def test_a_server_enforcing_the_schema_refuses_a_literal_before_storing_it(prefect_server):
    """A deployment run (UI, API, `prefect deployment run`) with a literal never reaches the database."""
    import os

    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from tests.security.flows import schema_check

    deployment_id = schema_check.to_deployment(name="schema-check").apply()
    literal = {"image": {"source": f"https://h/nemo.sqsh?X-Goog-Signature={TOKEN}"}}
    by_reference = {"image": {"source": "https://h/nemo.sqsh?<secret:nemo-image-query>"}}
    with get_client(sync_client=True) as client:
        with pytest.raises(PrefectHTTPStatusError) as info:
            client.create_flow_run_from_deployment(deployment_id, parameters=literal)
        assert info.value.response.status_code == 409
        run = client.create_flow_run_from_deployment(deployment_id, parameters=by_reference)
        assert client.read_flow_run(run.id).parameters == by_reference
        client.delete_flow_run(run.id)
    database = os.path.join(os.environ["PREFECT_HOME"], "prefect.db")
    for path in (database, database + "-wal"):
        if os.path.exists(path):
            with open(path, "rb") as fh:
                assert TOKEN.encode() not in fh.read()


class _Sources(BaseModel):
    """The shape PrepareConfig.sources / CptRefreshConfig.sources take (a spec or a list)."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    sources: secrets.CredentialFree | list[secrets.CredentialFree] | None = None


def test_command_line_options_take_references_and_refuse_literals_in_one_line():
    import argparse

    from nemoflow.options import ModelOptions, OptionsError

    parser = argparse.ArgumentParser()
    options = ModelOptions(_Sources)
    options.add_to(parser)
    refs = ["https://h/a.jsonl.zst?<secret:signed-a>", "https://h/b.jsonl.zst?X-Goog-Signature=<env:SIG_B>"]
    assert options.build(parser.parse_args(["--sources", *refs])).sources == refs
    for literal in (f"https://h/a.jsonl.zst?X-Goog-Signature={TOKEN}", f"https://u:{TOKEN}@h/a.jsonl.zst"):
        with pytest.raises(OptionsError) as info:
            options.build(parser.parse_args(["--sources", refs[0], literal]))
        message = str(info.value)
        assert message.startswith("--sources: ") and "<secret:NAME>" in message
        assert TOKEN not in message and "valid list" not in message and "\n" not in message


def test_an_image_is_staged_from_a_signed_url_by_reference(tmp_path, monkeypatch, work_dir):
    """infra/images/ copies through the same transfer stack: probe and copy resolve, records keep the reference."""
    from infra import images
    from tests.image.conftest import make_squashfs

    secrets.forget()
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "os-release").write_text('NAME="signed"\n')
    served = tmp_path / "www"
    served.mkdir()
    make_squashfs(rootfs, served / "nemo.sqsh")
    monkeypatch.setenv("NEMOFLOW_TEST_SIGNATURE", TOKEN)
    lines: list[str] = []
    with FaultServer(served, require_query={"X-Goog-Signature": TOKEN}, checksums=("x-goog-hash",)) as server:
        source = server.url("/nemo.sqsh") + "?X-Goog-Signature=<env:NEMOFLOW_TEST_SIGNATURE>"
        staged = images.copy_image(source, str(tmp_path / "images"), log=lines.append)
        assert {r.status for r in server.requests if r.method == "GET"} == {200}
    assert (tmp_path / "images" / "nemo.sqsh").read_bytes() == (served / "nemo.sqsh").read_bytes()
    sidecar = (tmp_path / "images" / "nemo.sqsh.meta.json").read_text()
    assert staged.source.endswith("/nemo.sqsh?<query hidden>")  # image records show no query at all
    for text in (sidecar, staged.source, *lines):
        assert TOKEN not in text
    secrets.forget()


def _config(module: str, name: str, **kwargs):
    import importlib

    return getattr(importlib.import_module(module), name)(**kwargs)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: _config("flows.prepare_dataset", "PrepareConfig", sources=v),
        lambda v: _config("flows.prepare_dataset", "PrepareConfig", sources=["/data/a.jsonl.zst", v]),
        lambda v: _config("flows.end_to_end", "EndToEndConfig", data={"sources": v}),
        lambda v: _config("flows.cpt_refresh", "CptRefreshConfig", sources=v),
        lambda v: _config("tasks.sft", "ChatDataConfig", source=v),
        lambda v: _config("tasks.sft", "ChatDataConfig", held_out=v),
    ],
    ids=["prepare", "prepare-list", "end-to-end", "cpt-refresh", "sft-source", "sft-held-out"],
)
def test_every_source_parameter_refuses_literal_credentials_and_takes_references(make):
    """Flow configs whose fields name data sources: a literal signed URL never reaches Prefect's records,
    not even in the validation error (Prefect stores it as the run's state message)."""
    from pydantic import ValidationError

    make("https://h/a.jsonl.zst?X-Goog-Signature=<env:SIG>")  # a reference is fine
    short = "s1gNATURE7"  # short enough that pydantic would show it whole in input_value=...
    with pytest.raises(ValidationError) as info:
        make(f"https://h/a.jsonl.zst?X-Goog-Signature={short}")
    assert "<secret:NAME>" in str(info.value)
    assert short not in str(info.value)
