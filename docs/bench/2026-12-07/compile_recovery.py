"""trainer.compile across a recovery (docs/results/2026-12-07-compile.md).

Each repetition is a fresh run (a fresh inductor cache: the first compile is cold) of 2
CPU workers training tests.tasks:CompiledTask with inductor; rank 1 is SIGKILLed after
step 4 and (recovery: exact) a new process takes its place. Printed per run, from the
`compiled` events and the metric rows: the first compiled step (cold, both ranks at
once), the replacement's first step (its compile, from the run's cache) and its cache
hits, the survivor's graph count before and after, and the steps' times before the kill
and after the recovery. An uncompiled run of the same shape gives the eager step time.

    python docs/bench/2026-12-07/compile_recovery.py [repetitions] [storage] [spare] [kill step]

`spare`: steps paced at 0.1 s and the kill after step 150, so that the warm spare
(failure.warm_spares: 1, the default) is up, built and compiled ahead when it comes, and
the recovery is `fast` (the spare takes the place at once).
"""

import json
import statistics
import sys
import tempfile

import raytrainer


SPARE = len(sys.argv) > 3 and sys.argv[3] == "spare"
KILL = int(sys.argv[4]) if len(sys.argv) > 4 else 150 if SPARE else 4  # the kill comes after this step
STEPS = KILL + 26


def config(storage, name, compile_):
    return {
        "task": {"target": "tests.tasks:CompiledTask",
                 "args": {"num_samples": 16384, "sleep_s": 0.1 if SPARE else 0.0}},
        "trainer": {"max_steps": STEPS, "global_batch_size": 64, "log_every_n_steps": 1, "compile": compile_},
        "scaling": {"num_workers": 2},
        "failure": {"chaos": [{"action": "kill", "step": KILL, "rank": 1}], "recovery": "fast" if SPARE else "exact",
                    "step_timeout_s": 120},
        "run": {"name": name, "storage": storage},
    }


def step_ms(rows, first, last):
    """Median milliseconds between consecutive rows of steps first..last."""
    times = {r["step"]: r["time"] for r in rows if "loss" in r}
    gaps = [(times[s] - times[s - 1]) * 1000 for s in range(first + 1, last + 1) if s in times and s - 1 in times]
    return round(statistics.median(gaps), 2) if gaps else None


def one(storage, i, compile_):
    on = compile_ is not None
    name = f"compile-{'spare-' if SPARE else ''}{i}-{'on' if on else 'off'}"
    result = raytrainer.train(config(storage, name, compile_), progress=False)
    events = [e for e in result.events if e["event"] == "compiled"]
    recovered = next(e for e in result.events if e["event"] == "recovered")
    out = {"compile": on, "recovery_s": recovered["seconds"], "spares": recovered.get("spares"),
           "steps_before_kill_ms": step_ms(result.history, KILL - 3, KILL),
           "steps_after_recovery_ms": step_ms(result.history, KILL + 2, STEPS),
           "first_step_after_recovery_ms": step_ms(result.history, KILL, KILL + 1)}
    if events:
        first, after = events[0]["workers"], events[-1]["workers"]
        joined = after[1] if len(after) > 1 else {}  # none where the survivor went on alone
        keys = ("first_step_ms", "new_graphs", "fx_cache_hits", "fx_cache_misses", "aot_cache_hits", "aot_cache_misses")
        out.update(first_compile_ms=[w["first_step_ms"] for w in first], replacement={k: joined.get(k) for k in keys},
                   survivor_graphs=[first[0]["compiled_graphs"], after[0]["compiled_graphs"]])
    return out


if __name__ == "__main__":
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    storage = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="compile-bench-")
    for i in range(reps):
        for compile_ in ({}, None):
            print(json.dumps(one(storage, i, compile_)), flush=True)
