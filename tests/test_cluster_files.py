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
    from raytrainer.driver.localray import RAY_SETTINGS

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
