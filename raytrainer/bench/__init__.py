"""`raytrainer bench`: raytrainer against raw torch DDP (the floor) and Ray Train (the peer).

Every contender trains the same job (an MLP regressing a fixed random linear map,
the same seeded data, global batch and per-epoch sample order, SGD, Gloo on CPU,
one intra-op thread per rank) in a fresh subprocess,

    python -m raytrainer.bench _contender NAME SPEC_JSON RESULT_JSON

so "process start to first finished step" includes everything a user waits for:
the interpreter, imports, starting Ray, starting the workers, forming the group.
Each contender records the wall-clock time at the end of every optimizer step on
rank 0 (raytrainer: the `time` of its metrics.jsonl rows), and every step's
metrics travel to the driver, so steps/s is measured with that cost included.
Each contender runs with its best settings for that: Ray Train with a short controller
poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, --ray-train-poll-s; its default 2 s caps a
report every step at 0.5 steps/s). Each run records the settings it ran with, and rank 0
takes a snapshot of its threads mid-run (torch's intra- and inter-op threads, the
process's threads, its nice value), which the report prints beside the table.

Repetitions are interleaved (raw, Ray Train, raytrainer, then rotated) so a
slow minute on the machine does not land on one contender. Medians are reported.

The worker-SIGKILL figures come from separate kill runs (scenario "kill", Ray Train
and raytrainer only: raw DDP has no recovery), so the start-up and steps/s runs stay
undisturbed; see kill.py for how the kill is delivered.

The input figures (scenario "input") train on a dataset whose every sample costs I/O
latency (a sleep) and some decoding CPU: raw DDP reads it with DataLoader(num_workers=k)
and the BatchPlan's micro-batch index lists as its batch_sampler, raytrainer with
`data.num_workers: k` (the same sampler, see input.py) and, in the same contender
process before that, with `data.num_workers: 0` (each sample read in the training thread).

The checkpoint-stall figures (scenario "stall") come from two raytrainer training runs
of a wider model with Adam, checkpointing every few steps, synchronously and with
checkpoint.async: the extra time of rank 0's steps around each save over ordinary steps
(see rt.save_stalls), so an async save's writer thread competes for the cores with training
as it would in a real run.

The faults figures come from one raytrainer run with faults_count faults from outside
at random moments (kills, kills right after a recovery, double kills, kills of rank 0,
freezes), and from a node lost from an elastic run on a local multi-node Ray: the p50,
p95 and max of the time from a fault to the first step after it, the steps lost, whether
the final weights are bit-identical or within float tolerance of an undisturbed run's,
the steps/s after the node loss over those before it at the same world size, and the
pause of growing back (see faults.py).

The grow figure comes from a run on a local multi-node Ray (ray.cluster_utils: one
1-CPU raylet per worker, on this machine) with max_workers one above --workers: a node
is added once training runs, and the pause is the gap between rank 0's last step at
the old size and its first at the new one (raytrainer only; see report.notes()).

Files: spec.py (the settings), job.py (the job all contenders train), kill.py (the kill
runs' kill), raw.py, ray_train.py, rt.py (raytrainer), faults.py (raytrainer's faults
run), report.py (the figures and the table), run.py (the contender processes, the
report), command.py (the command line), __main__.py (a contender process's entry).
"""

from .command import add_arguments, main, spec_from_args
from .faults import FAULT_KINDS, fault_plan
from .job import BenchTask
from .report import FIGURES, Figure, format_table, summarize
from .run import machine, run_bench
from .spec import CONTENDERS, LABELS, SCENARIOS, SMOKE, BenchError, BenchSpec

__all__ = ["BenchError", "BenchSpec", "BenchTask", "CONTENDERS", "FAULT_KINDS", "FIGURES", "Figure", "LABELS",
           "SCENARIOS", "SMOKE", "add_arguments", "fault_plan", "format_table", "machine", "main", "run_bench",
           "spec_from_args", "summarize"]
