"""`ray submit` entry point: train on a `ray up` cluster from its head node.

    ray submit cluster/aws-gpu.yaml cluster/submit_train.py -- configs/digits.yaml --set scaling.num_workers=4

`ray submit` copies this file to the head and runs it there with the arguments
after `--` (those of `raytrainer train`). It runs from the project copy `ray up`
synced to the head (RAYTRAINER_PROJECT, default ~/raytrainer) and ships that copy
to the workers as the job's working dir, so task code (examples/, your package)
imports on every worker. Exit status: raytrainer's (0 done, 1 failed, 2 config).
"""

import os
import sys

import ray

from raytrainer.driver.cli import main

if __name__ == "__main__":
    os.chdir(os.environ.get("RAYTRAINER_PROJECT", os.path.expanduser("~/raytrainer")))
    sys.path.insert(0, os.getcwd())
    ray.init(address="auto", runtime_env={"working_dir": "."}, logging_level="WARNING")
    sys.exit(main(["train", *sys.argv[1:]]))
