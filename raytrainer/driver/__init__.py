"""The driver side: what runs in the process that calls `raytrainer.train` (or the CLI).

It places the workers, watches them, decides what to do about failures and resizes, and
writes the run directory. It never imports torch nor anything under `raytrainer.worker`:
it talks to the workers only through `raytrainer.contract` (tested in tests/test_layout.py).

    api          train(): the entry point, the run directory, the loggers, the controller
    cli          `raytrainer train|resume|bench|plot`
    controller   the state machine that owns a run
    policy       pure decisions: recover or not, whom to blame, whose state, how long to wait
    group        the Ray edge: placement, the actors, state transfer between them
    metrics      the metrics hub and its sinks (progress, metrics.jsonl, TensorBoard)
    loggers      MLflow, W&B and users' own sinks
    storage_check, plot
"""
