#!/usr/bin/env bash
# The oldest torch and Ray that raytrainer claims, tested: builds a venv with exactly the
# floors of pyproject.toml (torch>=X, ray[train]>=Y: read from the file, so the claim and the
# test cannot drift apart) and runs the tests that exercise what changes between versions:
# the private names and Gloo's errors (test_internals), the process group, the loop and DDP,
# checkpoints, a 2-worker run on Ray, recoveries (kills, a hang, no survivor), a node drained
# for preemption (Ray's draining-nodes state), and that FSDP on this torch is a clear
# ConfigError. Then it installs the oldest torch FSDP needs (strategy.FSDP.NEEDS_TORCH) and
# runs the FSDP tests on it.
#
# Not part of .ci/run: PyPI has only CUDA builds of these torch releases (their CUDA
# libraries are needed to import torch at all), about 3 GB to download per torch, and the
# tests take ~10 minutes on a 2-core VM.
#   bash .ci/oldest.sh [VENV_DIR]        (default .venv-oldest, gitignored; reused if there)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-oldest}
floor() {  # the version after `NAME>=` in pyproject.toml's dependencies
    python3 - "$1" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    m = re.fullmatch(rf"{re.escape(sys.argv[1])}(\[[^]]*\])?>=([0-9.]+)", dep.replace(" ", ""))
    if m:
        print(m.group(2))
        break
else:
    sys.exit(f"pyproject.toml has no {sys.argv[1]}>=X dependency")
PY
}
torch_floor=$(floor torch)
ray_floor=$(floor ray)
echo "+ oldest claimed: torch==$torch_floor ray==$ray_floor"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q "torch==$torch_floor" "ray[train,default]==$ray_floor"
pip install -q --no-deps -e .
# The project's other needs, at the versions pip picks next to the old ones.
pip install -q pyyaml "pytest>=8" "scikit-learn>=1.3" matplotlib "moto[server]>=5.2.3"
python -c "import torch, ray; print('+ torch', torch.__version__, 'ray', ray.__version__)"
python -m pytest -q -p no:cacheprovider \
    tests/test_internals.py tests/test_layout.py tests/test_dist.py tests/test_loop.py tests/test_checkpoint.py \
    tests/test_driver_bytes.py tests/test_train.py::test_two_workers_write_the_run_directory \
    tests/test_fault_tolerance.py \
    tests/test_preemption.py::test_a_node_drained_for_preemption_is_left_before_its_deadline \
    --deselect tests/test_fault_tolerance.py::test_kills_with_loader_processes_end_bit_identical_and_leave_none_behind \
    tests/test_strategy.py::test_fsdp_on_a_torch_too_old_for_it_is_a_config_error_naming_the_version

# Deselected above: with every CUDA build of torch tried (2.7, 2.9, 2.11; Ray 2.40 and
# 2.60), the fork server of a SIGKILLed worker's loader processes outlives it (parent 1)
# with its loader processes; with the CPU build of 2.13 it exits. Not a version floor:
# an open issue of loader processes under CUDA builds (docs/notes-fence.md).
fsdp_floor=$(python -c "from raytrainer.worker.state.strategy import FSDP; print(FSDP.NEEDS_TORCH)")
echo "+ FSDP: torch==$fsdp_floor"
pip install -q "torch==$fsdp_floor"
python -c "import torch, ray; print('+ torch', torch.__version__, 'ray', ray.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_internals.py tests/test_strategy.py tests/test_snapshot.py \
    tests/test_sharded.py tests/test_fsdp.py::test_fsdp_rows tests/test_fsdp.py::test_fsdp_checkpoints_are_sharded_and_committed
