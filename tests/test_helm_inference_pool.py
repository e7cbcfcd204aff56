"""The chart's Kubernetes Inference Gateway resources (values `inferenceGateway`): an
InferencePool over the gateway pods, InferenceObjectives that mean the same priorities to the
endpoint picker and to Conveyor, the engine-type pod label and the picker's EndpointPickerConfig
naming Conveyor's metrics.

`helm template` renders them; kubernetes-validate --strict checks the built-in kinds (as
tests/test_helm.py does) and the strict JSON schemas under tests/assets/crd-schemas (the CRDs'
openAPIV3Schema, kubeconform's layout) check the custom ones, offline.
"""

# ruff: noqa: F811 (helm, the fixture of tests/test_helm.py, is each test's argument)
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator
from prometheus_client.parser import text_string_to_metric_families
from test_helm import (  # noqa: F401 (helm: the fixture)
    CI_VALUES,
    FULLNAME,
    KUBE_VERSION,
    MINIMAL,
    NAMESPACE,
    SCHEMA_ERROR,
    SERVER_SETTINGS,
    find,
    helm,
    one,
    pod_spec,
    render,
    template,
)
from test_metrics import fake_snapshot

from gateway.metrics import Metrics
from gateway.settings import ServeSettings
from runtime.engine_client import EngineInfo

SCHEMAS = Path(__file__).resolve().parent / "assets" / "crd-schemas"
EPP = "router-epp"
ENABLED = (
    "--set inferenceGateway.enabled=true",
    f"--set inferenceGateway.endpointPicker.serviceName={EPP}",
)
CUSTOM_KINDS = {"InferencePool", "InferenceObjective"}
ENGINE_LABEL = "llm-d.ai/engine-type"


def crd_validator(doc: dict) -> Draft7Validator:
    group, version = doc["apiVersion"].split("/")
    path = SCHEMAS / group / f"{doc['kind'].lower()}_{version}.json"
    assert path.is_file(), f"no schema for {doc['apiVersion']} {doc['kind']}"
    return Draft7Validator(yaml.safe_load(path.read_text()))


def assert_valid(validator: Draft7Validator, instance: dict) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, errors


def epp_config(docs: list[dict]) -> dict:
    configmap = one(docs, "ConfigMap", f"{FULLNAME}-epp-config")
    return yaml.safe_load(configmap["data"]["conveyor-plugins.yaml"])


def plugin(config: dict, plugin_type: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found


# ---- off by default -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values_file", [None, *CI_VALUES], ids=["defaults", *(p.name for p in CI_VALUES)]
)
def test_off_by_default(helm: Path, values_file: Path | None):
    docs = render(helm, values_file)
    assert not [d for d in docs if d["kind"] in CUSTOM_KINDS]
    assert find(docs, "ConfigMap", f"{FULLNAME}-epp-config") == []
    labels = one(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert ENGINE_LABEL not in labels
    assert "CONVEYOR_INFERENCE_OBJECTIVES" not in one(docs, "ConfigMap", FULLNAME)["data"]


# ---- what the picker reads ----------------------------------------------------------------------
def test_custom_resources_pass_their_crd_schemas_and_the_rest_kubernetes_validate(
    helm: Path, tmp_path: Path
):
    proc = template(helm, MINIMAL, sets=ENABLED)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    custom = [d for d in docs if d["kind"] in CUSTOM_KINDS]
    assert {d["kind"] for d in custom} == CUSTOM_KINDS
    for doc in custom:
        assert_valid(crd_validator(doc), doc)
        assert doc["metadata"]["namespace"] == NAMESPACE
    core = [d for d in docs if d["kind"] not in CUSTOM_KINDS]
    manifest = tmp_path / "core.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    validator = shutil.which(
        "kubernetes-validate", path=str(Path(sys.executable).parent)
    ) or shutil.which("kubernetes-validate")
    assert validator, "kubernetes-validate is not installed"
    cmd = [validator, "--strict", "--kubernetes-version", KUBE_VERSION, "--no-warn", str(manifest)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(core), result.stdout


def test_the_pool_selects_the_gateway_pods_on_their_serving_port(helm: Path):
    docs = render(helm, MINIMAL, sets=ENABLED)
    pool = one(docs, "InferencePool", FULLNAME)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    template_labels = one(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    for job in find(docs, "Job"):  # the pool must not pick the migration pod
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert not spec["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod_spec(one(docs, "Deployment", FULLNAME))["containers"]
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert numbers == [port] and len(set(numbers)) == len(numbers)  # the CRD's CEL rule
    assert spec["appProtocol"] == "http"
    ref = spec["endpointPickerRef"]
    assert ref == {
        "kind": "Service",
        "name": EPP,
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    source = plugin(epp_config(docs), "metrics-data-source")["parameters"]
    assert source == {"scheme": "http", "path": "/metrics"}  # served on that same port


def test_objectives_mean_the_same_priority_to_the_picker_and_to_conveyor(helm: Path):
    docs = render(helm, MINIMAL, sets=ENABLED)
    objectives = {d["metadata"]["name"]: d for d in find(docs, "InferenceObjective")}
    assert set(objectives) == {"critical", "standard", "sheddable"}
    for objective in objectives.values():
        assert objective["apiVersion"] == "llm-d.ai/v1alpha2"
        assert objective["spec"]["poolRef"]["name"] == FULLNAME
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    assert set(data) <= SERVER_SETTINGS and "inference_objectives" in ServeSettings.model_fields
    setting = data["CONVEYOR_INFERENCE_OBJECTIVES"]
    conveyor = ServeSettings(inference_objectives=setting).inference_objectives
    assert conveyor == {"critical": 0, "standard": 1, "sheddable": 2}
    picker = {name: d["spec"]["priority"] for name, d in objectives.items()}
    by_conveyor = sorted(conveyor, key=conveyor.get)  # most urgent first
    by_picker = sorted(picker, key=picker.get, reverse=True)  # higher is more urgent there
    assert by_conveyor == by_picker == ["critical", "standard", "sheddable"]
    for name, objective in objectives.items():
        assert objective["metadata"]["annotations"]["conveyor.dev/priority"] == str(conveyor[name])


def test_picker_priority_defaults_to_the_negated_priority(helm: Path):
    sets = (*ENABLED, '--set-json inferenceGateway.objectives=[{"name":"batch","priority":5}]')
    docs = render(helm, MINIMAL, sets=sets)
    assert one(docs, "InferenceObjective", "batch")["spec"]["priority"] == -5
    assert one(docs, "ConfigMap", FULLNAME)["data"]["CONVEYOR_INFERENCE_OBJECTIVES"] == "batch=5"


def test_the_older_api_group(helm: Path):
    sets = (*ENABLED, "--set inferenceGateway.apiGroup=inference.networking.x-k8s.io")
    docs = render(helm, MINIMAL, sets=sets)
    for objective in find(docs, "InferenceObjective"):
        assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        assert_valid(crd_validator(objective), objective)
    assert epp_config(docs)["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"


def test_the_engine_config_names_metrics_conveyor_serves(helm: Path):
    docs = render(helm, MINIMAL, sets=ENABLED)
    config = epp_config(docs)
    schema = SCHEMAS / "endpoint-picker" / "endpointpickerconfig_v1alpha1.json"
    assert_valid(Draft7Validator(yaml.safe_load(schema.read_text())), config)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    profile_refs = {p["pluginRef"] for s in config["schedulingProfiles"] for p in s["plugins"]}
    assert profile_refs <= {p.get("name", p["type"]) for p in config["plugins"]}
    extractor = plugin(config, "core-metrics-extractor")["parameters"]
    (engine,) = extractor["engineConfigs"]
    labels = one(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["engineLabelKey"]] == engine["name"] == extractor["defaultEngine"]
    assert engine == {
        "name": "conveyor",
        "queuedRequestsSpec": "conveyor:num_requests_waiting",
        "runningRequestsSpec": "conveyor:num_requests_running",
        "kvUsageSpec": "conveyor:kv_cache_usage_perc",
        "cacheInfoSpec": "conveyor:cache_config_info",
    }
    info = EngineInfo(("m",), 256, 100, 16 * 16, block_size=16, weight_bytes_per_token=1000)
    text = Metrics().render(fake_snapshot(waiting=[0]), info).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert families[engine[key]].type == "gauge", key
    (cache_info,) = families["conveyor:cache_config_info"].samples
    assert cache_info.labels == {"block_size": "16", "num_gpu_blocks": "16"}


# ---- refusals -----------------------------------------------------------------------------------
BAD_VALUES = {
    "no-picker-service": (("--set inferenceGateway.enabled=true",), "serviceName"),
    "failure-mode": (
        (*ENABLED, "--set inferenceGateway.endpointPicker.failureMode=Open"),
        "failureMode",
    ),
    "api-group": ((*ENABLED, "--set inferenceGateway.apiGroup=example.com"), "apiGroup"),
    "objective-name": (
        (*ENABLED, '--set-json inferenceGateway.objectives=[{"name":"Gold","priority":0}]'),
        "objectives",
    ),
    "objective-typo": (
        (*ENABLED, '--set-json inferenceGateway.objectives=[{"name":"a","prio":0}]'),
        "objectives",
    ),
    "port": ((*ENABLED, "--set inferenceGateway.endpointPicker.port=0"), "port"),
    "unknown-key": ((*ENABLED, "--set inferenceGateway.pool=x"), "inferenceGateway"),
}


@pytest.mark.parametrize("case", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(helm: Path, case: tuple[tuple[str, ...], str]):
    sets, where = case
    proc = template(helm, MINIMAL, sets=sets)
    assert proc.returncode != 0 and SCHEMA_ERROR in proc.stderr, proc.stderr
    assert where in proc.stderr, proc.stderr


def test_objectives_ordered_differently_or_twice_fail_to_render(helm: Path):
    crossed = '[{"name":"a","priority":0,"pickerPriority":0},{"name":"b","priority":1,"pickerPriority":5}]'
    proc = template(
        helm, MINIMAL, sets=(*ENABLED, f"--set-json inferenceGateway.objectives={crossed}")
    )
    assert proc.returncode != 0
    assert "a is more urgent than b for Conveyor" in proc.stderr, proc.stderr
    twice = '[{"name":"a","priority":0},{"name":"a","priority":1}]'
    proc = template(
        helm, MINIMAL, sets=(*ENABLED, f"--set-json inferenceGateway.objectives={twice}")
    )
    assert proc.returncode != 0 and "a appears twice" in proc.stderr, proc.stderr
