"""Every `ray up` file in cluster/ is valid for Ray's own launcher: the raw file
against ray-schema.json (no unknown keys), then as `ray up` prepares it (defaults
filled in) through Ray's validate_config. No cloud is contacted."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from .conftest import ROOT

FILES = sorted(Path(ROOT, "cluster").glob("*.yaml"))


def schema():
    import json

    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_there_are_cluster_files():
    assert {f.name for f in FILES} >= {"aws-gpu.yaml", "onprem.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cluster_file_validates_against_rays_schema(path):
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, schema())
    validate_config(prepare_config(copy.deepcopy(config)))
    # Never open the dashboard (and its job server) to the network.
    for command in config["head_start_ray_commands"]:
        if "ray start" in command:
            assert "--dashboard-host=127.0.0.1" in command


def test_the_aws_file_has_a_cpu_head_and_elastic_gpu_workers():
    config = yaml.safe_load(Path(ROOT, "cluster", "aws-gpu.yaml").read_text())
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert all(t["min_workers"] < t["max_workers"] for t in workers)


def test_the_schema_check_catches_a_typo():
    config = yaml.safe_load(Path(ROOT, "cluster", "onprem.yaml").read_text())
    config["idle_timeout_minute"] = config.pop("idle_timeout_minutes")
    with pytest.raises(jsonschema.ValidationError, match="idle_timeout_minute"):
        jsonschema.validate(config, schema())


def _start_commands(config):
    return config["head_start_ray_commands"] + config["worker_start_ray_commands"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_nodes_ray_starts_with_the_settings_a_ray_raytrainer_starts_has(path):
    from raytrainer.driver.localray import CLUSTER_SETTINGS as RAY_SETTINGS

    config = yaml.safe_load(path.read_text())
    starts = [c for c in _start_commands(config) if "ray start" in c]
    assert len(starts) == 2  # the head's and the workers'
    for command in starts:
        missing = [f"{k}={v}" for k, v in RAY_SETTINGS.items() if f"{k}={v}" not in command]
        assert not missing, f"{path.name}: `{command}` lacks {missing}"


def test_the_aws_storage_the_walkthrough_uses_is_on_every_node():
    """Every run.storage path the walk-through's commands (cluster/README.md and the file's
    header) use is made on the head and mounted on every GPU node by their setup commands."""
    import re

    text = Path(ROOT, "cluster", "README.md").read_text() + Path(ROOT, "cluster", "aws-gpu.yaml").read_text()
    paths = set(re.findall(r"run\.storage=(/[\w/]+)", text))
    assert paths, "the walk-through names no run.storage"
    config = yaml.safe_load(Path(ROOT, "cluster", "aws-gpu.yaml").read_text())
    head = " ".join(config["setup_commands"] + config["head_setup_commands"])
    workers = " ".join(config["setup_commands"] + config["worker_setup_commands"])
    for storage in paths:
        root = "/" + storage.strip("/").split("/")[0] + "/" + storage.strip("/").split("/")[1]
        assert f"mkdir -p {root}" in head and re.search(rf"^{re.escape(root)} ", "\n".join(
            line.strip("'") for line in re.findall(r"echo '([^']*)'", head)), re.M), \
            f"the head does not make and export {root} (run.storage={storage})"
        assert re.search(rf"mount -t nfs4 \$RAY_HEAD_IP:{re.escape(root)} {re.escape(root)}", workers), \
            f"the GPU nodes do not mount {root} (run.storage={storage})"


def test_ray_up_on_aws_gets_boto3_from_the_aws_extra():
    import re

    (aws,) = re.findall(r'^aws = \[(.*)\]$', Path(ROOT, "pyproject.toml").read_text(), re.M)
    assert '"boto3' in aws
    assert '".[aws]"' in Path(ROOT, "cluster", "README.md").read_text()


# ---------------------------------------------------------------------- KubeRay (cluster/kuberay)

KUBERAY = Path(ROOT, "cluster", "kuberay")
KUBERAY_VERSIONS = ("v1.6.0", "v1.7.0")  # authOptions (token auth) came in 1.6


def kube(name):
    return yaml.safe_load((KUBERAY / name).read_text())


def pods(spec):
    yield spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["template"]["spec"]


def test_the_rayjob_runs_the_rayclusters_spec():
    assert kube("rayjob.yaml")["spec"]["rayClusterSpec"] == kube("raycluster.yaml")["spec"]


def test_the_kuberay_pods_are_what_raytrainer_relies_on():
    from raytrainer.driver.localray import CLUSTER_SETTINGS as RAY_SETTINGS

    spec = kube("raycluster.yaml")["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no worker lands on the head
    claim = kube("storage.yaml")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in pods(spec):
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert {k: env.get(k) for k in RAY_SETTINGS} == RAY_SETTINGS, container["name"]
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts.get("/mnt/shared") == claim["metadata"]["name"], container["name"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in head["env"]}["RAY_JOB_STOP_WAIT_TIME_S"] == "120"
    assert all("nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
               for g in spec["workerGroupSpecs"])


def test_a_rayjob_retry_continues_its_run():
    """The retry runs the same entrypoint from the same directory with RAYTRAINER_RUN_ID set
    to the RayJob's name, on the shared volume: the run's identity is the same."""
    import re

    job = kube("rayjob.yaml")
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["RAYTRAINER_RUN_ID"] == job["metadata"]["name"]
    workdir = re.search(r"^WORKDIR (\S+)$", Path(ROOT, "cluster", "Dockerfile").read_text(), re.M).group(1)
    cd, config = re.match(r"cd (\S+) && raytrainer train (\S+) ", spec["entrypoint"]).groups()
    assert cd == workdir and Path(ROOT, config).is_file()
    assert "run.storage=/mnt/shared/" in spec["entrypoint"]


def test_the_image_has_the_ray_the_clusters_run():
    import re

    dockerfile = Path(ROOT, "cluster", "Dockerfile").read_text()
    image_ray = re.search(r"^FROM rayproject/ray:([\d.]+)-", dockerfile, re.M).group(1)
    assert kube("raycluster.yaml")["spec"]["rayVersion"] == image_ray
    aws = yaml.safe_load(Path(ROOT, "cluster", "aws-gpu.yaml").read_text())
    assert f'"ray[default]=={image_ray}"' in " ".join(aws["setup_commands"])


def _closed(schema):
    """A CRD's schema as the API server applies it to what it keeps, with unknown keys an error
    (the server would drop them silently: a typo'd key never reaches KubeRay)."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        if schema.get("x-kubernetes-int-or-string"):
            schema.pop("type", None)
        for value in schema.values():
            _closed(value)
    elif isinstance(schema, list):
        for value in schema:
            _closed(value)
    return schema


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
def test_the_manifests_validate_against_kuberays_crds(version):
    """KubeRay's published CRDs (ray.io_rayclusters.yaml, ray.io_rayjobs.yaml of each release,
    from its repository's ray-operator/config/crd/bases) are not in any package this project
    installs: they are read from shared/kuberay/<version>/ beside the checkout."""
    crds = Path(ROOT).parent / "shared" / "kuberay" / version
    if not crds.is_dir():
        pytest.skip(f"KubeRay {version}'s CRDs are not in {crds}")
    for kind, name in (("RayCluster", "raycluster.yaml"), ("RayJob", "rayjob.yaml")):
        crd = yaml.safe_load((crds / f"ray.io_{kind.lower()}s.yaml").read_text())
        schema = _closed(copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
        schema["properties"].pop("status", None)
        jsonschema.validate(kube(name), schema)
