"""The Kubernetes manifests under deploy/kubernetes/. No cluster runs here: every object is validated offline
against its schema (core kinds against Kubernetes' own JSON schemas from the kubernetes-validate package; the custom
resources against their CustomResourceDefinition's openAPIV3Schema, vendored under tests/data/kubernetes/ with their
source and version), strictly: a field the schema does not know is an error, as `kubectl apply --validate=strict`
makes it. Then what the objects say is checked against lmserve itself (the flags parse with its CLI, the probes are
routes of its app, the image is the one Dockerfile.gpu builds) and against each other (the pool selects the
Deployment's pods, the picker's Service is the one the pool names, the KV-event topic and port are the ones the
picker subscribes to)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from kubernetes_validate.utils import schema_contents

from lmserve.cli import build_parser
from lmserve.config import ServerConfig, resolve
from lmserve.engine.vllm.options import VllmLaunch
from lmserve.http.app import create_app
from lmserve.service import static_service
from tests.test_containers import exposed_port, final_stage, only

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "data" / "kubernetes"
KUBERNETES = "1.37"
"""The Kubernetes version whose schemas the core kinds are validated against (the newest kubernetes-validate has)."""

CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.yaml",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "inferenceobjective.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.yaml",
    ("serving.kserve.io/v1alpha2", "LLMInferenceService"): "llminferenceservice.yaml",
    ("ray.io/v1", "RayService"): "rayservice.yaml",
}
CORE = {"PersistentVolumeClaim", "Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}

LMSERVE_GAUGES = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
"""The gauges llm-d's picker reads, which lmserve exports under vLLM's names (lmserve/http/metrics.py; the same
names are read from a served /metrics by tests/api/test_metrics.py and tests/test_gateway_e2e.py)."""


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text(encoding="utf-8")) if doc]


def every_object() -> Iterator[tuple[str, int, dict[str, Any]]]:
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for index, doc in enumerate(documents(path.name)):
            yield path.name, index, doc


OBJECTS = list(every_object())


def one(name: str, kind: str, object_name: str | None = None) -> dict[str, Any]:
    [found] = [doc for doc in documents(name)
               if doc["kind"] == kind and object_name in (None, doc["metadata"]["name"])]
    return found


# ---- schemas ---------------------------------------------------------------------------------------------------------


def kubernetes_schema(name: str) -> jsonschema.protocols.Validator:
    """A validator for one of Kubernetes' own (strict) schemas, e.g. `podspec-v1`, its references resolved."""
    version = next(v for v in reversed(kubernetes_validate.utils.all_versions())
                   if kubernetes_validate.utils.major_minor(v) == KUBERNETES)
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = schema_contents(f"{folder}/{name}.json", KUBERNETES)
    definitions = schema_contents(f"{folder}/_definitions.json", KUBERNETES)
    registry: referencing.Registry[Any] = (referencing.Resource.from_contents(definitions)
                                           @ (referencing.Resource.from_contents(schema) @ referencing.Registry()))
    return jsonschema.Draft202012Validator(schema, registry=registry)


POD_SPEC = kubernetes_schema("podspec-v1")


def pod_spec(validator: Any, marked: Any, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    """The `x-lmserve-podspec` keyword of the vendored CRD schemas: a PodSpec, checked with Kubernetes' schema."""
    if marked:
        yield from POD_SPEC.iter_errors(instance)


CrdValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"x-lmserve-podspec": pod_spec})


def strict(schema: Any) -> Any:
    """An openAPIV3Schema that refuses unknown fields: every object with `properties` and no other say about more
    gets additionalProperties false (the API server prunes them; strict field validation refuses them)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: (value if key in ("enum", "default", "example", "required") else strict(value))
              for key, value in schema.items()}
    if "properties" in result and "additionalProperties" not in result and not result.get(
            "x-kubernetes-preserve-unknown-fields"):
        result["additionalProperties"] = False
    if "properties" in schema:
        result["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
    return result


def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    vendored = yaml.safe_load((SCHEMAS / CRDS[(api_version, kind)]).read_text(encoding="utf-8"))
    assert (f"{vendored['group']}/{vendored['version']}", vendored["kind"]) == (api_version, kind)
    return CrdValidator(strict(vendored["openAPIV3Schema"]))


def schema_errors(doc: dict[str, Any]) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(*key).iter_errors(doc)]
    assert doc["kind"] in CORE, f"no schema for {key}"
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [str(exc)]
    return []


@pytest.mark.parametrize(("name", "index", "doc"), OBJECTS,
                         ids=[f"{name}:{doc['kind']}/{doc['metadata']['name']}" for name, _, doc in OBJECTS])
def test_every_object_validates_against_its_schema(name: str, index: int, doc: dict[str, Any]) -> None:
    assert schema_errors(doc) == []


def test_every_file_holds_the_kinds_its_readme_says() -> None:
    kinds = {path.name: sorted({doc["kind"] for doc in documents(path.name)}) for path in MANIFESTS.glob("*.yaml")}
    assert kinds == {
        "lmserve.yaml": ["Deployment", "PersistentVolumeClaim", "Service"],
        "inferencepool.yaml": ["HTTPRoute", "InferenceObjective", "InferencePool"],
        "epp.yaml": ["ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"],
        "llminferenceservice.yaml": ["LLMInferenceService"],
        "rayservice.yaml": ["RayService"],
    }
    readme = (MANIFESTS / "README.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in readme for name in kinds)


@pytest.mark.parametrize(("name", "kind", "path", "bad"), [
    ("inferencepool.yaml", "InferencePool", ["spec", "targetPort"], [{"number": 8000}]),  # a misspelt field
    ("inferencepool.yaml", "InferencePool", ["spec", "endpointPickerRef", "failureMode"], "Open"),
    ("llminferenceservice.yaml", "LLMInferenceService",  # inside a PodSpec: Kubernetes' own schema
     ["spec", "template", "containers", 0, "livenessProbe", "httpGet", "port"], [8000]),
    ("rayservice.yaml", "RayService",
     ["spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "imagee"], "ray:latest"),
    ("rayservice.yaml", "RayService", ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplica"], 4),
    ("lmserve.yaml", "Deployment", ["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet",
                                    "paht"], "/health"),
])
def test_the_validation_refuses_what_kubernetes_would(name: str, kind: str, path: list[Any], bad: Any) -> None:
    doc = copy.deepcopy(one(name, kind))
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = bad
    assert schema_errors(doc)


# ---- what the lmserve containers run --------------------------------------------------------------------------------

POD_IP = "10.1.2.3"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's command and args from its env."""
    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    return re.sub(r"\$\((\w+)\)", value, text)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables as Kubernetes would set them (a pod's IP for status.podIP)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        else:
            env[var["name"]] = "from-a-secret-or-field"
    return env


def lmserve_container() -> dict[str, Any]:
    [container] = one("lmserve.yaml", "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def served(command: list[str], container: dict[str, Any]) -> ServerConfig:
    """What `lmserve serve` makes of a container's command line (argparse exits on a flag it does not have)."""
    env = container_env(container)
    words = [expand(word, env) for word in command]
    assert words[:2] == ["lmserve", "serve"]
    return resolve(vars(build_parser().parse_args(words[1:])), env={})


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def gpu_image_entrypoint() -> list[str]:
    return only(final_stage("Dockerfile.gpu"), "ENTRYPOINT").exec_form()


def test_the_deployment_runs_the_gpu_image_with_flags_lmserve_serve_accepts() -> None:
    container = lmserve_container()
    assert container["image"].split("/")[-1].split(":")[0] == "lmserve-gpu"  # docker build -t lmserve-gpu
    assert "command" not in container  # the image's entrypoint, `lmserve serve --host 0.0.0.0 --port 8000`
    config = served(gpu_image_entrypoint() + container["args"], container)
    assert (config.host, config.port) == ("0.0.0.0", exposed_port("Dockerfile.gpu"))
    assert config.port == ports(container)["http"]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", config.model)  # a hub repository: the vLLM engine


def test_the_deployment_publishes_vllms_kv_events_where_the_picker_subscribes() -> None:
    container = lmserve_container()
    config = served(gpu_image_entrypoint() + container["args"], container)
    [launch] = [record for record in config.launch if isinstance(record, VllmLaunch)]
    assert launch.kv_events_config is not None
    events = json.loads(launch.kv_events_config)
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{ports(container)['kv-events']}"
    assert events["topic"] == f"kv@{POD_IP}:{ports(container)['http']}@{config.model}"  # llm-d's topic for a pod
    precise = epp_config("precise-prefix.yaml")
    producer = plugin(precise, "precise-prefix-cache-producer")["parameters"]["kvEventsConfig"]
    assert events["topic"].startswith(producer["topicFilter"])
    assert producer["discoverPods"] is True and producer["podDiscoveryConfig"]["socketPort"] == ports(container)[
        "kv-events"]


def app_routes() -> set[tuple[str, str]]:
    app = create_app(static_service([]), ServerConfig())
    return {(method, route.path) for route in app.routes for method in getattr(route, "methods", None) or ()}


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}


@pytest.mark.parametrize("where", ["lmserve.yaml", "llminferenceservice.yaml"])
def test_readiness_asks_health_and_liveness_asks_livez_routes_of_lmserve(where: str) -> None:
    if where == "lmserve.yaml":
        container = lmserve_container()
        port = ports(container)["http"]
    else:
        [container] = one(where, "LLMInferenceService")["spec"]["template"]["containers"]
        port = served(container["command"] + container["args"], container).port
    asked = probes(container)
    assert asked["readinessProbe"]["path"] == "/health"  # 503 while the model's engine is down
    assert asked["livenessProbe"]["path"] == asked["startupProbe"]["path"] == "/livez"  # the process is up
    routes = app_routes()
    for probe in asked.values():
        assert ("GET", probe["path"]) in routes
        assert probe["port"] in (port, "http") and probe.get("scheme", "HTTP") == "HTTP"


def test_the_replicas_share_the_store_on_one_read_write_many_volume() -> None:
    claim = one("lmserve.yaml", "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    deployment = one("lmserve.yaml", "Deployment")
    assert deployment["spec"]["replicas"] > 1
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    [mount] = [m for m in lmserve_container()["volumeMounts"] if m["name"] == volume["name"]]
    image_volume = only(final_stage("Dockerfile.gpu"), "VOLUME").args
    image_env = dict(re.findall(r"(\w+)=(\S+)", only(final_stage("Dockerfile.gpu"), "ENV").args))
    assert mount["mountPath"] == image_volume and image_env["LMSERVE_MODELS"].startswith(image_volume + "/")
    comment = (MANIFESTS / "lmserve.yaml").read_text(encoding="utf-8")
    assert "stored responses" in comment and "conversations" in comment and "ReadWriteMany" in comment


def test_the_service_sends_to_the_deployments_http_port() -> None:
    service = one("lmserve.yaml", "Service")
    labels = one("lmserve.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in ("http", ports(lmserve_container())["http"])


# ---- the inference pool and its endpoint picker ---------------------------------------------------------------------


def epp_config(key: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(one("epp.yaml", "ConfigMap")["data"][key])
    return config


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [p for p in config["plugins"] if p["type"] == kind]
    return found


@pytest.mark.parametrize("key", ["default.yaml", "precise-prefix.yaml"])
def test_each_picker_config_refers_only_to_plugins_it_declares(key: str) -> None:
    config = epp_config(key)
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    referred = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    for source in config.get("dataLayer", {}).get("sources", []):
        referred |= {source["pluginRef"]} | {e["pluginRef"] for e in source["extractors"]}
    assert referred <= declared
    assert "max-score-picker" in referred


@pytest.mark.parametrize("key", ["default.yaml", "precise-prefix.yaml"])
def test_the_picker_reads_lmserves_gauges_for_the_engine_type_of_its_pods(key: str) -> None:
    extractor = plugin(epp_config(key), "core-metrics-extractor")["parameters"]
    [engine] = extractor["engineConfigs"]
    names = {engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]}
    assert names == LMSERVE_GAUGES
    labels = one("lmserve.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["engineLabelKey"]] == engine["name"] == extractor["defaultEngine"]
    source = plugin(epp_config(key), "metrics-data-source")["parameters"]
    assert (source["scheme"], source["path"]) == ("http", "/metrics")
    assert ("GET", "/metrics") in app_routes()


def test_the_precise_config_tokenizes_through_the_lmserve_service() -> None:
    producer = plugin(epp_config("precise-prefix.yaml"), "token-producer")["parameters"]
    service = one("lmserve.yaml", "Service")
    assert producer["vllm"]["url"] == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert producer["modelName"] == served(gpu_image_entrypoint() + lmserve_container()["args"],
                                           lmserve_container()).model


def test_the_pool_selects_the_lmserve_pods_and_names_the_pickers_service() -> None:
    pool = one("inferencepool.yaml", "InferencePool")["spec"]
    labels = one("lmserve.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [ports(lmserve_container())["http"]]
    picker = one("epp.yaml", "Service")
    assert pool["endpointPickerRef"]["name"] == picker["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in picker["spec"]["ports"]}


def test_the_picker_watches_the_pool_with_a_config_it_mounts() -> None:
    deployment = one("epp.yaml", "Deployment")["spec"]["template"]["spec"]
    [container] = deployment["containers"]
    args = container["args"]
    pool = one("inferencepool.yaml", "InferencePool")
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-group") + 1] == pool["apiVersion"].split("/")[0]
    config_file = Path(args[args.index("--config-file") + 1])
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_file.parent)]
    [volume] = [v for v in deployment["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == one("epp.yaml", "ConfigMap")["metadata"]["name"]
    assert config_file.name in one("epp.yaml", "ConfigMap")["data"]
    assert deployment["serviceAccountName"] == one("epp.yaml", "RoleBinding")["subjects"][0]["name"]


def test_the_route_and_the_objective_name_the_pool() -> None:
    pool = one("inferencepool.yaml", "InferencePool")
    [rule] = one("inferencepool.yaml", "HTTPRoute")["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                                     pool["metadata"]["name"])
    assert one("inferencepool.yaml", "InferenceObjective")["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


# ---- KServe and KubeRay ---------------------------------------------------------------------------------------------


def test_kserve_runs_lmserve_serve_with_the_same_picker_config() -> None:
    service = one("llminferenceservice.yaml", "LLMInferenceService")["spec"]
    [container] = service["template"]["containers"]
    assert container["name"] == "main"  # the container KServe's template would run `vllm serve` in
    config = served(container["command"] + container["args"], container)
    assert config.model == service["model"]["name"] and config.port == 8000  # KServe's pool targets port 8000
    assert service["router"]["scheduler"]["config"]["inline"] == epp_config("default.yaml")


def test_the_rayservice_runs_lmserves_ray_serve_application() -> None:
    ray = one("rayservice.yaml", "RayService")["spec"]
    [application] = yaml.safe_load(ray["serveConfigV2"])["applications"]
    # The builder (lmserve/replicas/app.py) takes these arguments: it builds the application without a complaint
    # (tests/replicas/test_serve_config_e2e.py runs it under `serve run`).
    from lmserve.config import OPTIONS
    from lmserve.replicas.app import build

    assert application["import_path"] == "lmserve.replicas.app:build"
    assert set(application["args"]) <= set(OPTIONS)
    build(application["args"])
    assert application["args"]["min_replicas"] <= application["args"]["max_replicas"]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", application["args"]["model"])
    [workers] = ray["rayClusterConfig"]["workerGroupSpecs"]
    [container] = workers["template"]["spec"]["containers"]
    assert container_env(container)["LMSERVE_MODELS"].startswith("/cache/")
    [volume] = [v for v in workers["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == one("lmserve.yaml", "PersistentVolumeClaim")[
        "metadata"]["name"]
