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
