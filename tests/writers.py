"""Checkpoint stores for the asynchronous writer's tests: its process imports them by name."""

import os
import time

from raytrainer.checkpoint import Checkpoints


class FailingCheckpoints(Checkpoints):
    """Writes fail from step `fail_from` on (a full disk, a lost bucket)."""

    def __init__(self, *args, fail_from: int):
        super().__init__(*args)
        self.fail_from = fail_from

    def write(self, step, state, metrics):
        if step >= self.fail_from:
            raise OSError(f"no space left on device (step {step})")
        return super().write(step, state, metrics)


class SlowCheckpoints(Checkpoints):
    """Each write announces itself (a file named by the writer's pid) and takes a minute."""

    def __init__(self, *args, marker: str):
        super().__init__(*args)
        self.marker = marker

    def write(self, step, state, metrics):
        with open(self.marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(self.marker + ".tmp", self.marker)  # whole, or not there
        time.sleep(60)
        return super().write(step, state, metrics)
