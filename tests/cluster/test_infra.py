"""infra/: the KubeRay manifests against KubeRay's real CRD schemas (../shared/kuberay-crds, or the same files in
infra/k8s/crds) and Ray Serve's deploy schema, and against the repository they deploy: image, entrypoints, import paths, env vars, volumes, services."""
import copy
import functools
import gzip
import importlib
import re
import shlex
import shutil
import subprocess
import tomllib

import jsonschema
import pytest
import yaml

from conftest import REPO
from flexdraft.core.config import from_dict
from flexdraft.serving.config import ServeConfig

K8S = REPO / "infra" / "k8s"
CRDS = REPO.parent / "shared" / "kuberay-crds"
KINDS = {"RayJob": "rayjobs", "RayCluster": "rayclusters", "RayService": "rayservices"}
WORKLOADS = {"rayjob-pipeline.yaml": "RayJob", "raycluster-sweeps.yaml": "RayCluster",
             "serve/rayservice.yaml": "RayService"}
# the manifests (kustomize applies them: infra/k8s, then infra/k8s/serve; infra/k8s/image names the image)
MANIFESTS = sorted(str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def strict(schema):
    """The CRD schema as `kubectl apply --validate=strict` applies it: an object with declared properties admits no
    other field (the API server would drop a misspelt one silently; strict validation refuses it)."""
    schema = copy.deepcopy(schema)

    def walk(s):
        if isinstance(s, dict):
            if (s.get("type") == "object" and "properties" in s and "additionalProperties" not in s
                    and not s.get("x-kubernetes-preserve-unknown-fields")):
                s["additionalProperties"] = False
            for v in s.values():
                walk(v)
        elif isinstance(s, list):
            for v in s:
                walk(v)

    walk(schema)
    return schema


def crd_text(kind: str) -> str:
    """KubeRay's CRD of `kind`: the shared copy beside the repository when there, else the repository's own."""
    shared = CRDS / f"ray.io_{KINDS[kind]}.yaml"
    if shared.is_file():
        return shared.read_text()
    return gzip.decompress((K8S / "crds" / f"ray.io_{KINDS[kind]}.yaml.gz").read_bytes()).decode()


@functools.cache
def crd_schema(kind: str) -> dict:
    crd = yaml.load(crd_text(kind), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # (1 MB: C is 10x faster)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def workload(name: str) -> dict:
    (doc,) = docs(name)
    return doc


def pod_templates(doc: dict) -> list[dict]:
    """Every pod template of a RayJob / RayCluster / RayService / Deployment."""
    spec = doc["spec"]
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    if doc["kind"] == "Deployment":
        return [spec["template"]]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def containers(doc: dict) -> list[dict]:
    return [c for t in pod_templates(doc) for c in t["spec"]["containers"]]


def serve_app(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


ALL = [d for name in MANIFESTS for d in docs(name)]


@pytest.mark.skipif(not CRDS.is_dir(), reason="no shared copy of KubeRay's CRDs beside this checkout to compare with")
def test_the_repositorys_crds_are_kuberays():
    """infra/k8s/crds holds the shared KubeRay CRDs unchanged (the tests below use it where no shared copy is)."""
    for kind, plural in KINDS.items():
        ours = gzip.decompress((K8S / "crds" / f"ray.io_{plural}.yaml.gz").read_bytes())
        assert ours == (CRDS / f"ray.io_{plural}.yaml").read_bytes(), kind


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_validate_against_kuberays_crds_and_a_typo_does_not(name):
    """Each workload is a valid ray.io/v1 object of its kind under strict validation, with a CPU and a GPU worker
    group; a misspelt field and a wrongly typed one in it are refused (so the check is not vacuous)."""
    doc, kind = workload(name), WORKLOADS[name]
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    schema = crd_schema(kind)
    jsonschema.validate(doc, schema)
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
    groups = {g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]
              for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"} and "nvidia.com/gpu" in groups["gpu"] and "nvidia.com/gpu" not in groups["cpu"]

    typo = copy.deepcopy(doc)
    group = (typo["spec"].get("rayClusterSpec") or typo["spec"].get("rayClusterConfig") or typo["spec"])
    group["workerGroupSpecs"][0]["maxReplica"] = group["workerGroupSpecs"][0].pop("maxReplicas")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(typo, schema)
    wrong = copy.deepcopy(doc)
    (wrong["spec"].get("rayClusterSpec") or wrong["spec"].get("rayClusterConfig") or wrong["spec"])[
        "headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema)


def test_the_mlflow_deployment_pod_is_a_valid_pod_template():
    """The MLflow Deployment's pod template against the PodTemplateSpec schema KubeRay's CRD embeds (Kubernetes'
    own), strictly; its Service selects it and targets its port; its probes ask /health."""
    deployment, = [d for d in docs("mlflow.yaml") if d["kind"] == "Deployment"]
    service, = [d for d in docs("mlflow.yaml") if d["kind"] == "Service"]
    pod_schema = crd_schema("RayCluster")["properties"]["spec"]["properties"]["headGroupSpec"]["properties"]["template"]
    jsonschema.validate(deployment["spec"]["template"], pod_schema)
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["containerPort"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_serve_config_v2_is_serve_config_yamls_app_and_valid_for_ray_serve(monkeypatch):
    """serveConfigV2 passes Ray Serve's ServeDeploySchema, and its application is serve/config.yaml's: the same
    import path (which imports), deployment and user_config (a valid ServeConfig), differing only where a GPU
    cluster must (the proxy on every node and all interfaces, replicas of a GPU, up to 4 of them) and in the
    drafter, which comes from the model registry."""
    from ray.serve.schema import ServeDeploySchema

    cfg = serve_app(workload("serve/rayservice.yaml"))
    ServeDeploySchema.model_validate(cfg)
    ours = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    (app,), (local,) = cfg["applications"], ours["applications"]
    module, attr = app["import_path"].split(":")
    monkeypatch.syspath_prepend(str(REPO))  # as the image's PYTHONPATH=/app
    assert callable(getattr(importlib.import_module(module), attr))
    (dep,), (local_dep,) = app["deployments"], local["deployments"]
    from_dict(ServeConfig, dep["user_config"])
    assert dep["ray_actor_options"]["num_gpus"] == 1 and dep["autoscaling_config"]["max_replicas"] == 4
    assert dep["user_config"]["drafter"] == "models:/flexdraft-drafter-smollm2@champion"  # (no shared volume)
    for d in (dep, local_dep):
        d.pop("ray_actor_options")
        d["autoscaling_config"].pop("max_replicas")
        for key in ("drafter", "drafter_version"):
            d["user_config"].pop(key, None)
    assert app == local
    assert cfg["proxy_location"] == "EveryNode" and cfg["http_options"]["host"] == "0.0.0.0"


def kustomization(folder: str) -> dict:
    return yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())


def test_images_and_ray_versions_are_the_repositorys():
    """Every container runs `flexdraft`, the name infra/k8s/image maps to the built image (by default
    flexdraft:<pyproject version>, the tag the Dockerfile's build command gives); the two kustomizations apply every
    manifest once, both through that component; every Ray cluster declares the Ray version pyproject pins; the
    Dockerfile installs through the Makefile."""
    version = PYPROJECT["project"]["version"]
    ray_pin = next(re.search(r"==([\d.]+)", d).group(1) for d in PYPROJECT["project"]["dependencies"]
                   if d.startswith("ray["))
    images = {c["image"] for d in ALL if d["kind"] in (*KINDS, "Deployment") for c in containers(d)}
    assert images == {"flexdraft"}
    (image,) = kustomization("image")["images"]
    assert image == {"name": "flexdraft", "newName": "flexdraft", "newTag": version}
    applied = kustomization(".")["resources"] + ["serve/" + r for r in kustomization("serve")["resources"]]
    assert sorted(applied) == MANIFESTS
    assert kustomization(".")["components"] == ["image"] and kustomization("serve")["components"] == ["../image"]
    dockerfile = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    assert f"-t flexdraft:{version} " in dockerfile and "RUN make install" in dockerfile
    assert "WORKDIR /app" in dockerfile and "PYTHONPATH=/app" in dockerfile
    for name in WORKLOADS:
        doc = workload(name)
        cluster = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
        assert cluster["rayVersion"] == ray_pin


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl (its built-in kustomize) is not installed")
def test_one_edit_sets_every_containers_image(tmp_path):
    """Your own image, set once in infra/k8s/image, is what `kubectl kustomize` renders into every container of
    both kustomizations (RayJob, RayCluster and RayService pod templates included), and nothing else changes."""
    copy_ = tmp_path / "k8s"
    shutil.copytree(K8S, copy_, ignore=shutil.ignore_patterns("crds"))
    component = copy_ / "image" / "kustomization.yaml"
    component.write_text(component.read_text().replace("newName: flexdraft", "newName: registry.example.com/team/flexdraft")
                         .replace(f'newTag: "{PYPROJECT["project"]["version"]}"', 'newTag: "2.0-rc1"'))
    rendered = []
    for folder in (copy_, copy_ / "serve"):
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rendered += [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(rendered) == len(ALL)
    images = {c["image"] for d in rendered if d["kind"] in (*KINDS, "Deployment") for c in containers(d)}
    assert images == {"registry.example.com/team/flexdraft:2.0-rc1"}
    for d in rendered:
        for c in containers(d) if d["kind"] in (*KINDS, "Deployment") else []:
            c["image"] = "flexdraft"
    key = lambda d: (d["kind"], d["metadata"]["name"])
    assert sorted(rendered, key=key) == sorted(ALL, key=key)


def _commands(name: str) -> list[list[str]]:
    """The RayJob's entrypoint and every `-- flexdraft ...` a manifest's comments tell users to submit."""
    text = (K8S / name).read_text()
    found = [shlex.split(c) for c in re.findall(r"-- (flexdraft [^\n#]+)", text)]
    doc = workload(name)
    if "entrypoint" in doc["spec"]:
        found.append(shlex.split(doc["spec"]["entrypoint"]))
    return found


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_entrypoints_are_commands_of_this_repository(name):
    """Each command a manifest runs or documents is a console script of pyproject whose arguments the CLI accepts,
    and every /app/... path in it is a file of the repository (the image's /app)."""
    from flexdraft.cli.main import build_parser

    for argv in _commands(name):
        assert argv[0] in PYPROJECT["project"]["scripts"], argv
        build_parser().parse_args(argv[1:])  # SystemExit (a failed test) for an unknown subcommand or flag
        for arg in argv[1:]:
            if arg.startswith("/app/"):
                assert (REPO / arg.removeprefix("/app/")).is_file(), arg
    assert _commands(name) or name == "serve/rayservice.yaml"


def test_env_vars_volumes_and_services_agree():
    """Every env var set in a manifest is read somewhere in the repository; every claim a pod mounts is declared
    in infra/k8s; MLFLOW_TRACKING_URI names the MLflow Service and its port; FLEXDRAFT_HOME lies on the mounted
    shared volume."""
    sources = "\n".join(p.read_text() for d in ("platform/flexdraft", "serve", "jobs", "tuning")
                        for p in (REPO / d).rglob("*.py"))
    sources += (REPO / "Makefile").read_text() + (REPO / "serve" / "config.yaml").read_text()
    claims = {d["metadata"]["name"] for d in ALL if d["kind"] == "PersistentVolumeClaim"}
    service, = [d for d in ALL if d["kind"] == "Service"]
    for d in ALL:
        if d["kind"] not in (*KINDS, "Deployment"):
            continue
        env = {e["name"]: e.get("value") for c in containers(d) for e in c.get("env", [])}
        if d["kind"] == "RayService":
            env.update(serve_app(d)["applications"][0]["runtime_env"]["env_vars"])
        for name in env:
            assert name in sources, f"{d['metadata']['name']}: env var {name} is read nowhere in the repository"
        for t in pod_templates(d):
            for v in t["spec"].get("volumes", []):
                if "persistentVolumeClaim" in v:
                    assert v["persistentVolumeClaim"]["claimName"] in claims
        if d["kind"] in KINDS:
            assert env["MLFLOW_TRACKING_URI"] == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
            mounts = {m["mountPath"] for c in containers(d) for m in c["volumeMounts"]}
            assert any(env["FLEXDRAFT_HOME"].startswith(m + "/") for m in mounts)


def test_deployments_are_hardened_as_a_platform_team_expects():
    """Every Ray cluster uses Ray's token authentication from a Secret; every pod runs as a non-root user with
    seccomp RuntimeDefault and every container without privilege escalation or capabilities; the Serve app,
    which binds 0.0.0.0, cannot start without its API key Secret; Ray's control-plane ports answer only Ray
    pods and the KubeRay operator; the MLflow server forks no job consumers; the image is built in two stages,
    compilers only in the first, and runs as uid 1000."""
    for name in WORKLOADS:
        doc = workload(name)
        cluster = doc["spec"].get("rayClusterSpec") or doc["spec"].get("rayClusterConfig") or doc["spec"]
        assert cluster["authOptions"] == {"mode": "token", "secretName": "flexdraft-ray-token"}, name
    for d in ALL:
        if d["kind"] not in (*KINDS, "Deployment"):
            continue
        for t in pod_templates(d):
            pod = t["spec"]["securityContext"]
            assert pod["runAsNonRoot"] and pod["runAsUser"] == 1000 and pod["seccompProfile"]["type"] == "RuntimeDefault"
            for c in t["spec"]["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    service = workload("serve/rayservice.yaml")
    keys = [e for c in containers(service) for e in c["env"] if e["name"] == "FLEXDRAFT_API_KEY"]
    assert keys and all(not e["valueFrom"]["secretKeyRef"].get("optional", False) for e in keys)
    assert serve_app(service)["http_options"]["host"] == "0.0.0.0"

    ray_policy, = [d for d in docs("networkpolicy.yaml") if d["metadata"]["name"] == "flexdraft-ray"]
    assert ray_policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}
    for rule in ray_policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        open_to_any_pod = any(peer.get("podSelector") == {} and "namespaceSelector" not in peer
                              for peer in rule["from"])
        if not ports:  # every port: Ray pods and the pods KubeRay makes, nobody else
            assert all(peer["podSelector"]["matchLabels"] for peer in rule["from"])
            assert all("namespaceSelector" not in peer for peer in rule["from"])
        assert not ({6379, 8265, 10001} & ports and open_to_any_pod)
        if open_to_any_pod:
            assert ports == {8000}

    mlflow, = [d for d in docs("mlflow.yaml") if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in containers(mlflow)[0]["env"]}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    dockerfile = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    build, final = dockerfile.split("\nFROM ")[1:]
    assert build.startswith("python:3.11-slim AS build") and "build-essential" in build
    assert "build-essential" not in final and "COPY --from=build" in final
    assert re.search(r"^USER 1000:1000$", final, re.M)
