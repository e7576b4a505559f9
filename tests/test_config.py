import importlib.util
import os

import pytest
import yaml

from raytrainer.config import dump_config, load_config
from raytrainer.errors import ConfigError

BASE = {
    "task": {"target": "tests.tasks:RegressionTask", "args": {"lr": 0.1}},
    "trainer": {"max_epochs": 2, "global_batch_size": 32},
    "scaling": {"num_workers": 2},
}


def test_defaults_and_types():
    cfg = load_config(BASE)
    assert cfg.trainer.max_epochs == 2 and cfg.trainer.micro_batch_size is None
    assert cfg.scaling.use_gpu == "auto" and cfg.scaling.placement == "PACK"
    assert cfg.task.args == {"lr": 0.1}


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task: {target: 'a.b:C'}\ntrainer: {max_steps: 5}\n")
    cfg = load_config(path, ["trainer.max_steps=7", "scaling.num_workers=4", "task.args.n=3",
                             "scaling.use_gpu=false", "scaling.placement_timeout_s=2"])
    assert cfg.trainer.max_steps == 7 and cfg.scaling.num_workers == 4
    assert cfg.task.args == {"n": 3} and cfg.scaling.use_gpu is False
    assert cfg.scaling.placement_timeout_s == 2.0  # int widened to float


@pytest.mark.parametrize("overrides, words", [
    (["trainer.max_epoch=3"], ["trainer.max_epoch", "allowed keys", "max_epochs"]),
    (["trainerx.a=1"], ["trainerx", "allowed keys", "trainer"]),
    (["trainer.global_batch_size=abc"], ["trainer.global_batch_size", "int"]),
    (["trainer.global_batch_size=true"], ["trainer.global_batch_size", "int"]),
    (["scaling.placement=RANDOM"], ["scaling.placement", "'PACK'", "'SPREAD'"]),
    (["scaling.use_gpu=maybe"], ["scaling.use_gpu", "'auto'", "bool"]),
    (["scaling.backend=mpi"], ["scaling.backend", "'nccl'", "'gloo'"]),
    (["trainer.global_batch_size=2", "scaling.max_workers=3"], ["3 workers", "global_batch_size=2"]),
    (["scaling.min_workers=3", "scaling.max_workers=2"], ["scaling.min_workers=3", "max_workers=2"]),
    (["scaling.max_workers=0"], ["scaling.max_workers=0", ">= 1"]),
    (["trainer.strategy=fsdp", "trainer.sync_batchnorm=true"], ["sync_batchnorm", "strategy=fsdp", "LayerNorm"]),
    (["trainer.fsdp={shard: [Block]}"], ["trainer.fsdp is set", "strategy is ddp"]),
    (["trainer.strategy=zero"], ["trainer.strategy", "'ddp'", "'fsdp'"]),
    (["trainer.strategy=fsdp", "trainer.fsdp.param_dtype=int8"], ["trainer.fsdp.param_dtype", "'bf16'"]),
    (["trainer.batch_policy=per_worker", "trainer.global_batch_size=33"],
     ["batch_policy=per_worker", "33 does not split", "2 workers"]),
    (["trainer.batch_policy=linear"], ["trainer.batch_policy", "'fixed_global'", "'per_worker'"]),
    (["scaling.replace_timeout_s=0"], ["scaling.replace_timeout_s", "> 0"]),
    (["failure.chaos=[{action: kill, step: 1, rank: 2}]"], ["rank=2", "at most 2 workers"]),
    (["trainer.max_epochs=null"], ["max_epochs or trainer.max_steps"]),
    (["trainer.max_steps=0", "trainer.max_epochs=null"], ["trainer.max_steps=0", "positive"]),
    (["task.target=nocolon"], ["task.target", "package.module:ClassName"]),
    (["run.storage=nosuch://bucket/x"], ["run.storage='nosuch://bucket/x'", "no filesystem is known for nosuch://",
                                         "s3", "gs", "fsspec"]),
    (["run.resume=nosuch://bucket/x/checkpoints/step-00000001"], ["run.resume=", "nosuch://"]),
    (["checkpoint.keep_last=0"], ["checkpoint.keep_last=0", "resume needs"]),
    (["checkpoint.asynch=true"], ["checkpoint.asynch", "async"]),
    (["noequals"], ["section.key=value"]),
    (["loggers=[{type: neptune}]"], ["loggers[0].type", "'tensorboard'", "'mlflow'", "'wandb'"]),
    (["loggers=[{type: mlflow}, {type: wandb, tracking_uri: x}]"],
     ["loggers[1].tracking_uri does not apply to type 'wandb'", "project", "mode"]),
    (["loggers=[{type: wandb, mode: shared}]"], ["loggers[0].mode", "'online'", "'offline'"]),
    (["loggers=[{args: {a: 1}}]"], ["loggers[0].type/target", "exactly one"]),
    (["loggers=[{type: mlflow, target: a.b:C}]"], ["loggers[0].type/target", "exactly one"]),
    (["loggers=[{target: nocolon}]"], ["loggers[0].target", "package.module:ClassName"]),
    (["loggers=[{type: tensorboard, experiment: x}]"], ["loggers[0].experiment", "type 'tensorboard'"]),
    (["loggers=[{type: mlflow, tracking_url: x}]"], ["loggers[0].tracking_url", "tracking_uri"]),
    (["loggers=[{type: mlflow, close_timeout_s: 0}]"], ["loggers[0].close_timeout_s", "> 0"]),
    (["loggers={type: mlflow}"], ["loggers", "list"]),
])
def test_bad_values_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(BASE, overrides)
    for word in words:
        assert word in str(info.value)


def test_worker_count_bounds_default_to_num_workers_and_one():
    # A Task with a fixed global batch trains the same maths at any size: it goes on with
    # one worker rather than fail for want of room, and grows back to num_workers.
    fixed = load_config(BASE).scaling
    assert (fixed.min_workers, fixed.size, fixed.max_workers) == (1, 2, 2)
    grows = load_config(BASE, ["scaling.max_workers=3"]).scaling
    assert (grows.min_workers, grows.size, grows.max_workers) == (1, 2, 3)
    floor = load_config(BASE, ["scaling.min_workers=2"]).scaling
    assert (floor.min_workers, floor.size, floor.max_workers) == (2, 2, 2)
    # Where a smaller world would train a smaller global batch, the run keeps its size.
    per_worker = load_config(BASE, ["trainer.batch_policy=per_worker"]).scaling
    assert (per_worker.min_workers, per_worker.size) == (2, 2)
    # An elastic config that names its bounds only starts at min_workers.
    bounded = load_config(BASE, ["scaling.num_workers=1", "scaling.min_workers=2", "scaling.max_workers=4"]).scaling
    assert (bounded.min_workers, bounded.size, bounded.max_workers) == (2, 2, 4)
    # Any split of the batch is valid now: 33 over 2 workers, micro-batches of 5.
    assert load_config(BASE, ["trainer.global_batch_size=33", "trainer.micro_batch_size=5"])
    # per_worker keeps each worker's batch of 1: the global batch grows with the workers.
    assert load_config(BASE, ["trainer.global_batch_size=2", "scaling.max_workers=3",
                              "trainer.batch_policy=per_worker"])


def test_num_workers_set_alone_resizes_a_resolved_fixed_size_config():
    # A run's config.yaml holds the bounds resolved from num_workers: they follow an override.
    resolved = dump_config(load_config(BASE))
    raw = yaml.safe_load(resolved)
    assert load_config(raw, ["scaling.num_workers=1"]).scaling.max_workers == 1
    both = load_config(raw, ["scaling.num_workers=3", "scaling.max_workers=4"]).scaling
    assert (both.min_workers, both.size, both.max_workers) == (1, 3, 4)  # bounds given with it stand
    kept = yaml.safe_load(dump_config(load_config(BASE, ["trainer.batch_policy=per_worker"])))
    assert kept["scaling"]["min_workers"] == 2  # resolved to its size, and following it
    assert load_config(kept, ["scaling.num_workers=4"]).scaling.min_workers == 4
    elastic = load_config(BASE, ["scaling.max_workers=3"]).to_dict()
    with pytest.raises(ConfigError, match="elastic .*scaling.max_workers=3.*set scaling.min_workers"):
        load_config(elastic, ["scaling.num_workers=1"])


def test_an_earlier_run_dirs_warm_spare_reads_as_warm_spares(tmp_path):
    # config.yaml of a run written before failure.warm_spares must still resume
    old = dict(BASE, failure={"warm_spare": False})
    with pytest.warns(FutureWarning, match="failure.warm_spares: 0"):
        assert load_config(old).failure.warm_spares == 0
    with pytest.raises(ConfigError, match="both set"):
        load_config(dict(BASE, failure={"warm_spare": True, "warm_spares": 2}))


def test_missing_file_and_missing_section(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="missing required key 'trainer'"):
        load_config({"task": {"target": "a:B"}})


def test_overrides_do_not_touch_the_input():
    load_config(BASE, ["trainer.max_epochs=9"])
    assert BASE["trainer"]["max_epochs"] == 2


def test_loggers_default_to_tensorboard_and_take_each_kind():
    assert [lg.type for lg in load_config(BASE).loggers] == ["tensorboard"]
    assert load_config(BASE, ["loggers=[]"]).loggers == []
    cfg = load_config(BASE, ["loggers=[{type: mlflow, tracking_uri: 'http://127.0.0.1:5000', experiment: e, "
                             "run_name: r, log_checkpoints: true}, {type: wandb, project: p, mode: offline}, "
                             "{type: tensorboard}, {target: 'tests.tasks:RecordingSink', args: {path: x}}]"])
    mlflow, wandb, tensorboard, mine = cfg.loggers
    assert (mlflow.tracking_uri, mlflow.experiment, mlflow.run_name, mlflow.log_checkpoints) == (
        "http://127.0.0.1:5000", "e", "r", True)
    assert (wandb.project, wandb.mode, wandb.close_timeout_s) == ("p", "offline", 60.0)
    assert (mine.target, mine.args) == ("tests.tasks:RecordingSink", {"path": "x"})
    # config.yaml round-trips (a resume reads it back)
    from raytrainer.config import dump_config

    assert load_config(yaml.safe_load(dump_config(cfg))).loggers == cfg.loggers


def test_relative_paths_are_made_absolute_against_the_users_directory_and_uris_stay():
    from raytrainer.config import resolve_paths

    config = load_config(BASE, ["run.storage=runs", "run.resume=../other/runs/x/checkpoints/step-00000010"])
    resolve_paths(config, "/home/u/projB")
    assert config.run.storage == "/home/u/projB/runs" and config.run.cwd == "/home/u/projB"
    assert config.run.resume == "/home/u/other/runs/x/checkpoints/step-00000010"
    assert "cwd" not in config.to_dict()["run"]  # not a key: config.yaml records the absolute storage only
    for storage, resolved in (("~/runs", os.path.expanduser("~/runs")),
                              ("s3://bucket/runs", "s3://bucket/runs"), ("/abs/runs", "/abs/runs")):
        config = load_config(BASE, [f"run.storage={storage}"])
        resolve_paths(config, "/home/u/projB")
        assert config.run.storage == resolved and config.run.resume == "auto"


@pytest.mark.parametrize("storage", ["gs://bucket/runs", "abfs://container@account.dfs.core.windows.net/runs",
                                     "hdfs://namenode:8020/runs", "ftp://user:pw@127.0.0.1:2121/runs",
                                     "gs://anonymous@bucket/runs?scheme=http&endpoint_override=127.0.0.1:1"])
def test_a_storage_uri_of_any_scheme_pyarrow_or_fsspec_opens_is_accepted_without_reaching_it(storage):
    # Nothing listens at these addresses: the check only asks which filesystem would open them.
    assert load_config(BASE, [f"run.storage={storage}"]).run.storage == storage


def test_a_scheme_whose_fsspec_package_is_missing_names_the_package_to_install():
    import fsspec

    fsspec.register_implementation("rtmissing", "raytrainer_no_such_package.FileSystem", errtxt="absent")
    with pytest.raises(ConfigError) as info:
        load_config(BASE, ["run.storage=rtmissing://bucket/runs"])
    assert "run.storage='rtmissing://bucket/runs'" in str(info.value)
    assert "pip install raytrainer_no_such_package" in str(info.value)


def test_az_without_adlfs_names_the_azure_extra():
    if importlib.util.find_spec("adlfs") is not None:
        pytest.skip("adlfs is installed here, so az:// opens: the missing-package message cannot show")
    with pytest.raises(ConfigError) as info:
        load_config(BASE, ["run.storage=az://container/runs"])
    assert 'pip install "raytrainer[azure]"' in str(info.value) and "adlfs" in str(info.value)


# ---------------------------------------------------------------------------- task.args' types

SEQUENCE = {"task": {"target": "tests.tasks:SequenceTask"}, "trainer": {"max_steps": 5}}


def test_task_args_from_yaml_take_the_types_the_task_annotates(tmp_path):
    """PyYAML reads 3e-4 as a string: coerced to the float SequenceTask.__init__ annotates."""
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  target: tests.tasks:SequenceTask\n  args: {lr: 3e-4, hidden: '8', scale: 1, "
                    "sizes: ['1', 2], shuffle: 'true', tag: v1, untyped: 3e-4}\ntrainer: {max_steps: 5}\n")
    args = load_config(path).task.args
    assert args["lr"] == 3e-4 and args["hidden"] == 8 and args["scale"] == 1.0 and args["sizes"] == [1, 2]
    assert args["shuffle"] is True and args["tag"] == "v1"
    assert args["untyped"] == "3e-4"  # not a parameter of the task: the worker's signature check says so
    with pytest.raises(ConfigError, match=r"task.args.lr='fast' has the wrong type: tests.tasks:SequenceTask"
                                          r".__init__ annotates it as float"):
        load_config({**SEQUENCE, "task": {**SEQUENCE["task"], "args": {"lr": "fast"}}})


def test_task_args_set_on_the_command_line_take_the_annotated_types():
    cfg = load_config(SEQUENCE, ["task.args.lr=1e-3", "task.args.scale=null"])
    assert cfg.task.args == {"lr": 1e-3, "scale": None}
    with pytest.raises(ConfigError, match=r"task.args.tag=2 has the wrong type.*as str; give a value of that "
                                          r"type \(quoted, in YAML\)"):
        load_config(SEQUENCE, ["task.args.tag=2"])
    with pytest.raises(ConfigError, match=r"task.args.sizes=\[1, 'x'\] has the wrong type.*as list\[int\] \| null"):
        load_config(SEQUENCE, ["task.args.sizes=[1, x]"])


def test_task_args_the_driver_cannot_type_are_typed_on_the_worker():
    from raytrainer.task import build_task

    cfg = load_config({**SEQUENCE, "task": {"target": "tests.tasks:InheritedSequenceTask", "args": {"lr": "3e-4"}}})
    assert cfg.task.args == {"lr": "3e-4"}  # its __init__ is inherited: the source does not say
    assert build_task(cfg.task).lr == 3e-4
    with pytest.raises(ConfigError, match=r"task.args.lr='fast' has the wrong type"):
        build_task(load_config({**SEQUENCE, "task": {"target": "tests.tasks:InheritedSequenceTask",
                                                     "args": {"lr": "fast"}}}).task)


def test_task_args_of_a_task_passed_by_value_are_typed_on_the_driver():
    import raytrainer
    from raytrainer import Task

    class Local(Task):  # <locals>: shipped by value, its source unread
        def __init__(self, lr: float = 0.1):
            self.lr = lr

    with pytest.raises(ConfigError, match=r"task.args.lr='fast' has the wrong type.*annotates it as float"):
        raytrainer.train({**SEQUENCE, "task": {"target": Local, "args": {"lr": "fast"}}}, progress=False)
