"""Tasks that fail the way users' tasks do before training starts (imported by workers by name)."""

from .tasks import RegressionTask


class DatasetFileTask(RegressionTask):
    """Reads its training set from a file, as most users' tasks do."""

    def __init__(self, path="data/train.pt", **kwargs):
        super().__init__(**kwargs)
        self.path = path

    def train_dataset(self):
        with open(self.path, "rb") as f:  # a FileNotFoundError where it is missing
            return f.read()


class BrokenInitTask(RegressionTask):
    """A task whose constructor raises (a bad argument, a missing credential)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        raise RuntimeError("BrokenInitTask cannot start: no tokenizer configured")
