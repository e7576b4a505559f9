"""The worker side: what runs in each training process (a Ray actor per GPU or CPU slot).

It builds the user's task, joins the process group, and runs the step and epoch loop. It
never imports anything under `raytrainer.driver`: it answers the driver through the
methods `raytrainer.contract` lists (tested in tests/test_layout.py). The loop and what it
uses know no Ray.

    actor        the Worker actor: setup, run, the control calls, state transfer
    loop         the step and epoch loop (plain torch)
    state        the training state: model, optimizer, scheduler, scaler, EMA
    strategy     DDP or FSDP2, chosen by trainer.strategy; sharded: FSDP2's pieces
    window       metrics reduced across ranks, carried in DDP's gradient all-reduce
    input        loader processes over the BatchPlan; raydata: Ray Data streams
    saver        checkpoints written by the workers (sync or async)
    snapshot     peer snapshots of sharded state in host memory
    dist         process groups: form, leave, abort
    chaos, schedule, stopping, syncbn
"""
