"""The multiprocessing context of a worker's own processes: its loader processes
(input/input.py) and its checkpoint writer (state/writer.py). See input/input.py's module
doc for why a fork server, not fork."""

from __future__ import annotations

from . import _internals, scratch


def loader_context():
    """forkserver (torch and the input module preloaded) where the platform has it. Its
    sockets go in a scratch folder of this process's (scratch.py), which the next worker on
    the node removes if this one is killed, rather than in a folder of multiprocessing's
    own, which only a normal exit removes (_internals.use_multiprocessing_folder)."""
    import multiprocessing

    _internals.use_multiprocessing_folder(scratch.make)
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # The main module too (a Ray worker script; guarded like any multiprocessing main), once
    # in the server rather than in every loader process. The input module by name, not
    # imported: the loader processes run its functions (input/input.py, above this module).
    ctx.set_forkserver_preload(["__main__", "torch", "raytrainer.worker.input.input"])
    return ctx
