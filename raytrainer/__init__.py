"""raytrainer: elastic, fault-tolerant, data-parallel PyTorch training on Ray."""

from .driver.api import Result, train, train_loop
from .callbacks import Callback, RunContext
from .config import Config, load_config
from .errors import ConfigError, NonFiniteLoss, PlacementError, RaytrainerError, Stopped, TaskError, WorkerError
from .driver.metrics import RunInfo, Sink
from .task import Task

__all__ = [
    "Callback",
    "RunContext",
    "Config",
    "ConfigError",
    "NonFiniteLoss",
    "PlacementError",
    "RaytrainerError",
    "Result",
    "RunInfo",
    "Sink",
    "Stopped",
    "Task",
    "TaskError",
    "WorkerError",
    "load_config",
    "train",
    "train_loop",
]
__version__ = "0.1.0"
