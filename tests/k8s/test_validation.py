"""Invalid values fail before anything is written, as one line naming the field (issue #12's render rows).

Names follow Kubernetes' DNS-1123/1035 rules, sizes its quantity grammar; what is
accepted here must also pass kubernetes-validate --strict for 1.30 and 1.37.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import yaml

from infra.jobs import JobSpec, Mount, Resources, ServiceSpec
from infra.k8s import validation as v
from infra.k8s.manifests import job_objects, service_objects, to_dict, workspace_pvc
from infra.k8s.options import K8sOptions, K8sOptionsError
from infra.k8s.render import ConfigError, ManifestWriteError, load_yaml_config, write_manifests
from nemoflow.cli import main as cli
from tests.k8s.test_manifests import validate
from tests.support.require import need


@pytest.mark.parametrize(
    "options, field, value",
    [
        ({"namespace": "Bad_Namespace!"}, "k8s.namespace", "Bad_Namespace!"),
        ({"namespace": "a" * 64}, "k8s.namespace", "a" * 64),
        ({"namespace": "team.llm"}, "k8s.namespace", "team.llm"),  # a label, not a subdomain
        ({"shm_size": "lots"}, "k8s.shm_size", "lots"),
        ({"shm_size": "0"}, "k8s.shm_size", "0"),
        ({"pvc_size": "1 Ti"}, "k8s.pvc_size", "1 Ti"),
        ({"pvc_size": "1TB"}, "k8s.pvc_size", "1TB"),
        ({"pvc_name": "Work_Space"}, "k8s.pvc_name", "Work_Space"),
        ({"secret_name": "-secrets"}, "k8s.secret_name", "-secrets"),
        ({"service_account": "nemo flow"}, "k8s.service_account", "nemo flow"),
        ({"scheduler_name": "runai_scheduler"}, "k8s.scheduler_name", "runai_scheduler"),
        ({"pvc_storage_class": "RWX"}, "k8s.pvc_storage_class", "RWX"),
        ({"image_pull_secrets": ["ngc", "NGC"]}, "k8s.image_pull_secrets[1]", "NGC"),
        ({"secret_names": {"HF_TOKEN": "hf secret"}}, "k8s.secret_names['HF_TOKEN']", "hf secret"),
        ({"image": "nvcr.io/nvidia/NeMo:25.02"}, "k8s.image", "nvcr.io/nvidia/NeMo:25.02"),
        ({"workspace_mount": "nemo-workspace"}, "k8s.workspace_mount", "nemo-workspace"),
        ({"labels": {"team": "LLM team"}}, "k8s.labels['team']", "LLM team"),
        ({"labels": {"-team": "llm"}}, "k8s.labels key", "-team"),
        ({"node_selector": {"nvidia.com/gpu.product": "H100 80GB"}}, "k8s.node_selector", "H100 80GB"),
        ({"image_pull_policy": "Sometimes"}, "k8s.image_pull_policy", "Sometimes"),
        ({"tolerations": [{"key": "gpu", "operator": "Maybe"}]}, "k8s.tolerations.0.operator", "Maybe"),
        ({"nodez": 2}, "k8s.nodez", "unknown option"),
    ],
)
def test_invalid_option_is_one_line_naming_the_field(options, field, value):
    with pytest.raises(K8sOptionsError) as info:
        K8sOptions.from_mapping(options)
    message = str(info.value)
    assert "\n" not in message
    assert field in message and value in message, message


def test_option_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("NEMOFLOW_K8S_SHM_SIZE", "lots")
    with pytest.raises(K8sOptionsError, match=r"NEMOFLOW_K8S_SHM_SIZE 'lots' is not a Kubernetes quantity"):
        K8sOptions()


def test_several_invalid_options_are_all_named():
    with pytest.raises(K8sOptionsError) as info:
        K8sOptions(namespace="Bad_Namespace!", shm_size="lots")
    assert "k8s.namespace" in str(info.value) and "k8s.shm_size" in str(info.value)


@pytest.mark.parametrize("text", ["64Gi", "1Ti", "1.5Gi", "500m", "100", "1e9", "2E3", "+1Ki", ".5", "128M", "3k"])
def test_quantities_kubernetes_accepts(text):
    assert v.quantity(text, "q") > 0


@pytest.mark.parametrize("text", ["lots", "1 Gi", "1GB", "1gi", "Gi", "", "1.5.0Gi", "1Gi ", "--1", "1e", "0x10"])
def test_quantities_kubernetes_refuses(text):
    with pytest.raises(ValueError, match=r"^size .* is not a Kubernetes quantity"):
        v.quantity(text, "size")


def test_name_rules():
    assert v.dns1123_label("a" * 63, "n") and v.dns1123_subdomain("a." * 126 + "a", "n")
    for bad in ["a" * 64, "A", "a_b", "-a", "a-", "a.b", ""]:
        with pytest.raises(ValueError, match="DNS-1123 label"):
            v.dns1123_label(bad, "n")
    with pytest.raises(ValueError, match="DNS-1123 subdomain"):
        v.dns1123_subdomain("a" * 254, "n")
    assert v.dns1123_subdomain("nemo.workspace-1", "n")
    with pytest.raises(ValueError, match="DNS-1035"):
        v.dns1035_label("1-serve", "n")
    assert v.qualified_name("nvidia.com/gpu.product", "k") and v.label_value("", "v") == ""


def test_job_fields_are_named_with_their_job():
    with pytest.raises(ValueError, match=r"^train: resources.mem 'lots' is not like 16G"):
        job_objects(JobSpec(name="train", command=["x"], resources=Resources(mem="lots")), K8sOptions())
    with pytest.raises(ValueError, match=r"^train: env name 'MY VAR'"):
        job_objects(JobSpec(name="train", command=["x"], env={"MY VAR": "1"}), K8sOptions())
    with pytest.raises(ValueError, match=r"^train: mount target of /nemo-workspace/d 'data'"):
        job_objects(
            JobSpec(name="train", command=["x"], mounts=[Mount(source="/nemo-workspace/d", target="data")]),
            K8sOptions(),
        )
    # a Service name must start with a letter (DNS-1035); a Job name need not
    assert job_objects(JobSpec(name="1train", command=["x"]), K8sOptions())
    with pytest.raises(ValueError, match=r"service name '1serve' is not a valid Service name"):
        service_objects(ServiceSpec(name="1serve", command=["x"], port=8000), K8sOptions())
    with pytest.raises(ValueError, match=r"rendezvous Service"):
        job_objects(JobSpec(name="2train", command=["x"], resources=Resources(nodes=2)), K8sOptions())


def test_edge_values_accepted_here_pass_strict_schema_validation():
    """The other direction: what the validators let through is valid for the API (1.30 and 1.37)."""
    options = K8sOptions(
        namespace="n" * 63,
        pvc_name="nemo.workspace-1",
        pvc_size="1.5Ti",
        pvc_storage_class="standard-rwx",
        shm_size="512Mi",
        labels={"example.com/team": "llm_Team.1", "empty": ""},
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists"}],
        image_pull_secrets=["ngc.registry"],
        secret_names={"HF_TOKEN": "hf.token"},
        service_account="nemoflow",
        scheduler_name="runai-scheduler",
    )
    job = JobSpec(
        name="t" * 63,
        command=["x"],
        env={"A.B-c_d": "1"},
        secret_env=["HF_TOKEN", "WANDB_API_KEY"],
        resources=Resources(mem="1.5G", cpus_per_task=4, gpus_per_node=8, time="1-00:00:00"),
        container_image="localhost:5000/team/nemoflow:0.1.0-cpu",
        mounts=[Mount(source="/nemo-workspace/data", target="/data", read_only=True)],
    )
    objects = [
        workspace_pvc(options),
        *job_objects(job, options),
        *job_objects(job.model_copy(update={"array_size": 4}), options),
        *job_objects(job.model_copy(update={"resources": Resources(nodes=2, gpus_per_node=8)}), options, name="tr-1"),
        *service_objects(ServiceSpec(name="s" * 63, command=["x"], port=8000), options),
    ]
    for obj in objects:
        validate(to_dict(obj))


def test_render_refuses_bad_names_and_quantities_writing_nothing(tmp_path, capsys, monkeypatch):
    from infra.settings import reload_settings

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", "/nemo-workspace/nemoflow")  # a run's paths on the PVC
    reload_settings()
    out = tmp_path / "out"
    for config, field in [
        ({"executor": {"kind": "k8s", "namespace": "Bad_Namespace!"}}, "k8s.namespace 'Bad_Namespace!'"),
        ({"executor": {"kind": "k8s", "shm_size": "lots"}}, "k8s.shm_size 'lots'"),
        ({"executor": {"kind": "k8s", "pvc_size": "huge"}}, "k8s.pvc_size 'huge'"),
        ({"train": {"mem": "lots"}}, "resources.mem 'lots'"),
    ]:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        assert cli(["render", "--out", str(out), "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and field in err and "Traceback" not in err, err
        assert not out.exists(), f"{config}: something was written"


def test_yaml_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("nodes: 2\nk8s:\n  namespace: llm\n   scheduler_name: x\n")
    with pytest.raises(ConfigError) as info:
        load_yaml_config(str(bad))
    assert "\n" not in str(info.value)
    assert str(bad) in str(info.value) and "line 4" in str(info.value)
    bad.write_text("- nodes\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_yaml_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml_config(str(tmp_path / "missing.yaml"))
    bad.write_bytes(b"nodes: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_yaml_config(str(bad))
    bad.write_text("")
    assert load_yaml_config(str(bad)) == {}
    bad.write_text("nodes: 2\nk8s: {namespace: llm}\n")
    assert load_yaml_config(str(bad)) == {"nodes": 2, "k8s": {"namespace": "llm"}}


@contextlib.contextmanager
def read_only_mount(path):
    path.mkdir()
    need(os.geteuid() == 0, "root (to mount a read-only tmpfs)", "run the tests as root, as CI does")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_out_on_a_read_only_file_system_is_one_line(tmp_path, capsys):
    spec = JobSpec(name="x", command=["true"])
    with read_only_mount(tmp_path / "ro") as ro:
        with pytest.raises(ManifestWriteError, match="Read-only file system") as info:
            write_manifests([spec], K8sOptions(), str(ro / "manifests"))
        assert "\n" not in str(info.value) and str(ro / "manifests") in str(info.value)
        # through the command line: exit 2, one line, no traceback
        env = {**os.environ, "NEMOFLOW_WORK_DIR": "/nemo-workspace/nemoflow"}  # a run's paths on the PVC
        proc = subprocess.run(
            [sys.executable, "-m", "nemoflow", "render", "--out", str(ro)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Read-only file system" in lines[0] and str(ro) in lines[0], proc.stderr
