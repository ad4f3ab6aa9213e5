"""Settings, storage and the local job backend: the parts every stage stands on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pydantic import Field, SecretStr, ValidationError

from infra import storage
from infra.backends.local import LocalBackend
from infra.jobs import JobSpec, JobState, Resources, parse_time_limit
from infra.processes import pid_alive
from infra.settings import Settings, SettingsError, redact, reload_settings


def test_settings_read_prefixed_env_and_dotenv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("NEMOFLOW_WORK_DIR=gs://from-dotenv/w\nNEMOFLOW_REGION=europe\n")
    monkeypatch.setenv("NEMOFLOW_REGION", "asia")
    settings = Settings()
    assert settings.work_dir == "gs://from-dotenv/w"
    assert settings.region == "asia"  # the environment wins over .env


def test_secrets_never_print(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue123")
    monkeypatch.setenv("NEMOFLOW_WANDB_API_KEY", "wandbsecret456")
    settings = Settings()
    text = f"{settings} {settings!r} {settings.model_dump()} {settings.model_dump_json()}"
    assert "hf_supersecretvalue123" not in text
    assert "wandbsecret456" not in text
    assert settings.secret_env() == {"HF_TOKEN": "hf_supersecretvalue123", "WANDB_API_KEY": "wandbsecret456"}
    assert redact("token=hf_supersecretvalue123!", settings.secret_values()) == "token=***!"


def test_invalid_setting_is_one_line_naming_the_variable_and_allowed_values(monkeypatch):
    monkeypatch.setenv("NEMOFLOW_REGION", "mars")
    try:
        with pytest.raises(SettingsError) as raised:
            reload_settings()
    finally:
        monkeypatch.delenv("NEMOFLOW_REGION")
        reload_settings()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("NEMOFLOW_REGION='mars' is invalid: input should be 'us', 'europe' or 'asia'")
    assert raised.value.__cause__ is None and raised.value.__suppress_context__  # no pydantic trace chained


@pytest.mark.prefect
def test_a_flow_that_reads_an_invalid_setting_fails_with_that_one_line(prefect_server, monkeypatch):
    from prefect import flow

    @flow(name="reads-settings")
    def reads_settings() -> str:
        from infra.settings import get_settings

        return get_settings().region

    monkeypatch.setenv("NEMOFLOW_REGION", "mars")
    from infra.settings import get_settings

    get_settings.cache_clear()
    try:
        state = reads_settings(return_state=True)
    finally:
        monkeypatch.delenv("NEMOFLOW_REGION")
        reload_settings()
    assert state.is_failed()
    with pytest.raises(
        SettingsError, match=r"^NEMOFLOW_REGION='mars' is invalid: input should be 'us', 'europe' or 'asia'"
    ):
        state.result()


def test_invalid_secret_setting_never_repeats_the_value():
    class Strict(Settings):
        hf_token: SecretStr | None = Field(None, min_length=64)

    with pytest.raises(ValidationError) as raised:
        Strict(hf_token="hf_short_but_secret")
    message = str(SettingsError.from_validation_error(raised.value, Strict))
    assert "hf_short_but_secret" not in message and "NEMOFLOW_HF_TOKEN is invalid" in message


def test_cli_reports_an_invalid_setting_in_one_line_with_exit_2(tmp_path):
    env = dict(os.environ, NEMOFLOW_REGION="mars")
    for command in (["settings"], ["serve", "list"]):
        proc = subprocess.run(
            [sys.executable, "-m", "nemoflow.cli", *command], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        assert proc.stderr.splitlines() == [
            f"nemoflow {command[0]}: error: NEMOFLOW_REGION='mars' is invalid: "
            "input should be 'us', 'europe' or 'asia' (set in the environment or .env)"
        ]


def test_settings_command_shows_variables_and_masks_secrets(tmp_path):
    env = dict(
        os.environ,
        NEMOFLOW_REGION="europe",
        HF_TOKEN="hf_shown_nowhere",
        NEMOFLOW_WORK_DIR=str(tmp_path),
        NEMOFLOW_SLURM_PARTITION="gpu",
        NEMOFLOW_K8S_NAMESPACE="llm",
    )
    text = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "settings"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert text.returncode == 0, text.stderr
    lines = {line.split()[0]: line.split()[1] for line in text.stdout.splitlines() if len(line.split()) > 1}
    assert lines["NEMOFLOW_REGION"] == "europe" and lines["NEMOFLOW_WORK_DIR"] == str(tmp_path)
    assert lines["NEMOFLOW_HF_TOKEN"] == "**********"
    # the executors' options, as the environment fills them
    assert "[slurm]" in text.stdout and lines["NEMOFLOW_SLURM_PARTITION"] == "gpu"
    assert "[k8s]" in text.stdout and lines["NEMOFLOW_K8S_NAMESPACE"] == "llm"
    as_json = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "settings", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    values = json.loads(as_json.stdout)
    assert values["region"] == "europe" and values["hf_token"] == "**********"
    assert values["slurm"]["partition"] == "gpu" and values["k8s"]["namespace"] == "llm"
    assert "hf_shown_nowhere" not in text.stdout + as_json.stdout


@pytest.mark.parametrize("work_dir", ["~/w", "/abs/w/", "file:///abs/w", "gs://bucket/prefix/", "rel/w"])
def test_result_storage_default_is_joined_like_storage_join(work_dir):
    # settings cannot import storage (storage imports settings); the two joins must agree
    assert Settings(work_dir=work_dir).result_storage_uri == storage.join(work_dir, "prefect-results")


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = str(tmp_path / "out" / "file.bin")
    with pytest.raises(RuntimeError):
        with storage.atomic_open(target) as fh:
            fh.write(b"half")
            raise RuntimeError("crash mid-write")
    assert not os.path.exists(target)
    assert os.listdir(tmp_path / "out") == []
    storage.write_bytes(target, b"whole")
    assert open(target, "rb").read() == b"whole"


def test_uri_forms(tmp_path):
    assert storage.local_path(f"file://{tmp_path}/a") == f"{tmp_path}/a"
    assert storage.join("gs://b/x/", "y", "z") == "gs://b/x/y/z"
    assert storage.parent("gs://b/x/y") == "gs://b/x"
    assert storage.join(str(tmp_path), "a") == os.path.join(str(tmp_path), "a")


def test_unwritable_directory_is_named(tmp_path):
    """Both ways ensure_writable fails name the directory: it cannot be created, or it cannot be written."""
    from tests.support.tmpfs import tmpfs

    missing = "/proc/nemoflow-cannot-write/run"  # /proc refuses new directories, even to root
    with pytest.raises(storage.StorageError) as info:
        storage.ensure_writable(missing)
    assert str(info.value).startswith(f"cannot create directory {missing}: "), info.value
    # an existing directory on a read-only file system (chmod does not stop root; a ro mount does)
    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        with pytest.raises(storage.StorageError) as info:
            storage.ensure_writable(str(ro))
        assert str(info.value).startswith(f"directory {ro} is not writable: "), info.value
        assert "Read-only file system" in str(info.value)


@pytest.mark.gcs
def test_gcs_atomic_write_and_fingerprint(gcs_bucket):
    uri = f"{gcs_bucket}/dir/obj.json"
    storage.write_json(uri, {"a": 1})
    assert storage.read_json(uri) == {"a": 1}
    assert storage.fingerprint(uri).startswith(("md5Hash:", "crc32c:"))
    with pytest.raises(RuntimeError):
        with storage.atomic_open(f"{gcs_bucket}/dir/broken.bin") as fh:
            fh.write(b"x" * 10)
            raise RuntimeError("crash")
    names = [storage.basename(u) for u in storage.listdir(f"{gcs_bucket}/dir")]
    assert names == ["obj.json"]


def test_time_limits():
    assert parse_time_limit("90") == 5400
    assert parse_time_limit("01:30:00") == 5400
    assert parse_time_limit("2-00:00:00") == 172800
    with pytest.raises(ValueError, match="1h"):
        parse_time_limit("1h")


def test_local_backend_streams_logs_and_surfaces_exit_codes():
    lines: list[str] = []
    spec = JobSpec(name="ok", command=[sys.executable, "-c", "print('hello'); print('world')"])
    result = LocalBackend().run(spec, on_log=lines.append)
    assert result.state is JobState.COMPLETED and lines == ["hello", "world"]

    spec = JobSpec(name="bad", command=[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    result = LocalBackend().run(spec)
    assert result.state is JobState.FAILED and result.exit_code == 3 and result.log_tail == ["boom"]


def test_local_backend_array_sets_index_and_redacts_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_neverlogme")
    reload_settings()
    lines: list[str] = []
    code = "import os; print(os.environ['NEMOFLOW_ARRAY_INDEX'], os.environ.get('HF_TOKEN'))"
    spec = JobSpec(name="arr", command=[sys.executable, "-c", code], array_size=3, secret_env=["HF_TOKEN"])
    result = LocalBackend().run(spec, on_log=lines.append)
    reload_settings()
    assert result.state is JobState.COMPLETED
    assert sorted(lines) == ["[0] 0 ***", "[1] 1 ***", "[2] 2 ***"]


def test_local_backend_time_limit_kills_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    spec = JobSpec(name="slow", command=[sys.executable, "-c", code], resources=Resources(time="00:01"))
    result = LocalBackend(kill_grace_s=1).run(spec)
    assert result.state is JobState.TIMEOUT
    child = int(pidfile.read_text())
    import time

    time.sleep(0.5)
    assert not pid_alive(child), "the job's child process outlived the job"  # a zombie counts as dead


def test_a_packages_code_fingerprint_covers_every_module_in_it(tmp_path, monkeypatch):
    """A stage's cache key hashes the code that produces its output; code split out of a module into a
    package (infra/images/) must still count, not only the package's __init__."""
    from tasks.common import code_fingerprint

    package = tmp_path / "fingerprinted"
    package.mkdir()
    (package / "__init__.py").write_text("from fingerprinted.part import VALUE\n")
    (package / "part.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_fingerprint("fingerprinted")
    assert code_fingerprint("fingerprinted") == before  # stable for the same code
    (package / "part.py").write_text("VALUE = 2\n")
    assert code_fingerprint("fingerprinted") != before
