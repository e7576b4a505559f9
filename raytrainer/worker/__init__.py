"""The worker side: what runs in each training process (a Ray actor per GPU or CPU slot).

It builds the user's task, joins the process group, and runs the step and epoch loop. It
never imports anything under `raytrainer.driver`: it answers the driver through the
methods `raytrainer.contract` lists (tested in tests/test_layout.py). The loop and what it
uses know no Ray.

Sub-packages by concern, in their one import direction: each imports only those after it
(tests/test_layout.py holds it), never one before, not even for type checking.

    process/     the Worker actor and its control channel: setup, forming, kept and orphaned processes
    userloop/    your own loop (task.loop): fn(ctx), and the sharded state it saves
    loop/        a Task's step and epoch loop (plain torch): step, validation, metrics, recovery
    input/       loader processes over the BatchPlan; Ray Data streams
    state/       the training state: DDP/FSDP2, snapshots, copies, hand-over, checkpoints
    (this level) the base every package may use: _internals (the gateway to private torch
                 and Ray names), dist (process groups), busy, scratch, pids, loaders
"""
