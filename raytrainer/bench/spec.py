"""The bench's settings: BenchSpec (every flag of `raytrainer bench`), its smoke values,
the scenarios and the contenders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RaytrainerError

CONTENDERS = ("raw", "ray_train", "raytrainer")
LABELS = {"raw": "raw DDP", "ray_train": "Ray Train", "raytrainer": "raytrainer"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
"""The folder that holds this raytrainer package: contenders' workers import it from there."""
SCENARIOS = ("train", "join", "kill", "stall", "grow", "input", "faults", "peers")
FSDP_SCENARIOS = ("train", "peers")
"""What --strategy fsdp measures: the train scenario against raw FSDP2, and recovery from
peer snapshots against recovery from a checkpoint (sharded state only)."""
STRATEGIES = ("ddp", "fsdp")


class BenchError(RaytrainerError):
    """A contender failed or timed out; the message carries the tail of its log."""


@dataclass(kw_only=True)
class BenchSpec:
    workers: int = 2
    hidden: int = 256
    """Width of the MLP's hidden layers."""
    layers: int = 2
    """Number of hidden layers."""
    in_dim: int = 32
    global_batch_size: int = 64
    samples: int = 4096
    steps: int = 3000
    """Optimizer steps of the train runs of raw DDP and raytrainer (about 10 s): long enough
    that the last half is steady state (see steady_from)."""
    ray_train_steps: int = 300
    """Optimizer steps for Ray Train (20 while it ran with its default 2 s poll, at 0.5 steps/s)."""
    ray_train_poll_s: float = 0.001
    """Ray Train's controller poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; Ray's default 2 s).
    Each ray.train.report() puts its result in a one-slot queue that only the controller's
    poll empties, so a report every step runs at most one step per poll: a short poll is
    Ray Train's best setting for per-step metrics: below about 0.01 s the poll no longer
    bounds its steps/s (docs/results/2026-12-07-the-house.md keeps the figures)."""
    window_steps: int = 200
    """The steady-state steps/s of a train run is the median of the rates of consecutive
    windows of this many steps (from steady_from on); the report gives their spread too."""
    cpu_sample_s: float = 0.2
    """How often the bench reads the CPU time of every process of a contender run
    (bench.cpu; 0: never): the CPU table's figures."""
    repetitions: int = 3
    warmup_fraction: float = 0.1
    """Leading share of the steps left out of a rate (allocator, caches, first collectives)."""
    steady_from: float = 0.5
    """The steady-state steps/s of a train run counts its steps from this share on. The first
    seconds of a run are start-up: Ray's daemons settle and raytrainer's warm spare imports
    torch on the same cores, which slows raytrainer's first steps on a small machine and
    not raw DDP's (docs/results/2026-12-07-the-house.md keeps the figures). The first tenth
    of the run has a figure of its own."""
    timeout_s: float = 600.0
    """Per contender run; a run past it is killed and the bench fails."""
    seed: int = 0
    checkpoint_mb: int = 64
    """Model size of the stall runs (a 2-layer MLP that wide, trained with Adam, whose
    state adds twice as much to each checkpoint)."""
    stall_steps: int = 40
    """Optimizer steps of each stall run (one with synchronous checkpoints, one async)."""
    stall_checkpoint_every: int = 10
    """The stall runs save every this many steps: each save but the last has steps after it."""
    kill_steps: int = 400
    """Optimizer steps of the kill runs (Ray Train and raytrainer alike)."""
    kill_step: int = 325
    """The last worker is SIGKILLed from outside once it starts this step: in steady state
    by then (see kill_pace_s), and mid-way between two checkpoints."""
    kill_pace_s: float = 0.02
    """Each step of the kill runs, both contenders', takes at least this long, so that the
    kill lands seconds into training (6.5 s at the defaults), as a failure in a real run
    would: raytrainer's warm spare, started once training runs, has imported torch, and
    Ray's daemons have settled. Unpaced, the kill came 1.5 s after the first step."""
    kill_checkpoint_every: int = 50
    """Both contenders checkpoint every this many steps in the kill runs (Ray Train also
    reports only then: the least it can report and still checkpoint)."""
    grow_steps: int = 2000
    """Optimizer steps of the grow run; paced at 20 ms a step or more until the group has
    grown (adding a node takes seconds), then free."""
    input_steps: int = 300
    """Optimizer steps of the input runs with loader processes (raw DDP and raytrainer): about
    7 s (150 were 3.5 s, in which a slow second of the machine moved the ratio by 10%)."""
    input_steps_no_loaders: int = 40
    """Optimizer steps of raytrainer's input run with data.num_workers 0 (each is slow)."""
    input_workers: int = 4
    """Loader processes per rank in the input runs (raw DDP's DataLoader num_workers too)."""
    input_io_ms: float = 2.0
    """I/O latency of one sample in the input runs (a sleep: no CPU)."""
    input_decode_rounds: int = 4
    """Decoding CPU of one sample: 64x64 matrix products (about 15 us each on a laptop core)."""
    faults_workers: int = 3
    """Workers of the faults runs: 3, so that a double kill leaves a survivor holding the state."""
    faults_count: int = 20
    """Faults of the faults run, from outside at random moments: kills, kills right after a
    recovery, double kills, kills of rank 0 and freezes, in turn (see faults.py)."""
    faults_steps: int = 12000
    """Optimizer steps of the faults run (and its undisturbed twin): paced at kill_pace_s while
    faults are due (about 35 steps/s), unpaced after; faults stop at 90% of them."""
    node_steps: int = 5000
    """Optimizer steps of the node run (paced at 50 ms but in its two measured windows)."""
    node_window_steps: int = 1000
    """Unpaced steps at 2 workers measured before a node is lost and after."""
    faults_step_timeout_s: float = 3.0
    """failure.step_timeout_s of the faults runs: how long a frozen worker goes unnoticed."""
    scenarios: str = "train,join,kill,stall,grow,input,faults"
    """Which measurements to run: train (start-up, steps/s), join (raytrainer's start-up
    in a later run: joining the local Ray a first run kept), kill (worker SIGKILL), stall (checkpoint
    stall inside training, sync and async), grow (elastic grow by one worker), input (a slow dataset
    through loader processes), faults (faults_count faults in one run, against an undisturbed
    one, and a node lost from an elastic run), peers (--strategy fsdp: a kill recovered from peer snapshots and from a checkpoint,
    and the snapshots' cost in steps/s); comma-separated."""
    parallel: int = 1
    """Contender runs at a time. Above 1 the runs share the machine, so their figures say
    nothing about each contender: for checking that the bench works (--smoke), not for
    measuring. The kill and faults runs still run one at a time: their faults must land on time."""
    strategy: str = "ddp"
    """ddp, or fsdp: FSDP2 (fully_shard on each Linear and on the root) in raw torch against
    raytrainer with trainer.strategy: fsdp, without Ray Train; the train and peers scenarios."""

    def __post_init__(self):
        for key in ("workers", "hidden", "layers", "in_dim", "global_batch_size", "samples", "steps",
                    "ray_train_steps", "repetitions", "checkpoint_mb", "stall_steps", "stall_checkpoint_every",
                    "kill_steps", "kill_step", "kill_checkpoint_every", "grow_steps", "input_steps",
                    "input_steps_no_loaders", "input_workers", "faults_count", "faults_steps", "node_steps",
                    "node_window_steps", "parallel", "window_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"bench --{key.replace('_', '-')}={getattr(self, key)} must be >= 1")
        if self.cpu_sample_s < 0:
            raise ConfigError("bench --cpu-sample-s must be >= 0 (0: no CPU figures)")
        if self.kill_pace_s < 0:
            raise ConfigError("bench --kill-pace-s must be >= 0")
        if self.input_io_ms < 0 or self.input_decode_rounds < 0:
            raise ConfigError("bench --input-io-ms and --input-decode-rounds must be >= 0")
        for key in ("steps", "ray_train_steps", "input_steps", "input_steps_no_loaders"):
            if getattr(self, key) < 2:
                raise ConfigError(f"bench --{key.replace('_', '-')} must be >= 2 to measure a rate")
        if self.global_batch_size % self.workers:
            raise ConfigError(
                f"bench --global-batch-size={self.global_batch_size} must be a multiple of "
                f"--workers={self.workers}"
            )
        if self.samples < self.global_batch_size:
            raise ConfigError(f"bench --samples={self.samples} must be >= --global-batch-size")
        if not 0 <= self.warmup_fraction < 1 or not 0 <= self.steady_from < 1:
            raise ConfigError("bench warmup_fraction and --steady-from must be in [0, 1)")
        if self.stall_checkpoint_every >= self.stall_steps:
            raise ConfigError(f"bench --stall-checkpoint-every={self.stall_checkpoint_every} must be below "
                              f"--stall-steps={self.stall_steps}: a save needs steps after it")
        if self.ray_train_poll_s <= 0:
            raise ConfigError("bench --ray-train-poll-s must be > 0")
        if self.timeout_s <= 0:
            raise ConfigError("bench --timeout-s must be > 0")
        if self.faults_workers < 3:
            raise ConfigError(f"bench --faults-workers={self.faults_workers} must be >= 3: a double kill "
                              "must leave a survivor")
        if self.faults_step_timeout_s <= 0:
            raise ConfigError("bench --faults-step-timeout-s must be > 0")
        if self.node_steps < 3 * self.node_window_steps:
            raise ConfigError(f"bench --node-steps={self.node_steps} must be at least three times "
                              f"--node-window-steps={self.node_window_steps}: two windows and the steps between")
        unknown = set(self.scenario_list) - set(SCENARIOS)
        if unknown or not self.scenario_list:
            raise ConfigError(f"bench --scenarios={self.scenarios!r}: choose from {', '.join(SCENARIOS)}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"bench --strategy={self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        if self.strategy != "ddp" and not set(self.scenario_list) <= set(FSDP_SCENARIOS):
            raise ConfigError(f"bench --strategy {self.strategy} measures the {' and '.join(FSDP_SCENARIOS)} "
                              f"scenarios only: pass --scenarios {','.join(FSDP_SCENARIOS)} or a part of it")
        if self.strategy == "ddp" and "peers" in self.scenario_list:
            raise ConfigError("bench --scenarios peers measures peer snapshots of sharded state: pass "
                              "--strategy fsdp")
        if "kill" in self.scenario_list or "peers" in self.scenario_list:
            if self.workers < 2:
                raise ConfigError("bench --scenarios kill needs --workers >= 2: a worker must survive")
            if not 1 < self.kill_step < self.kill_steps:
                raise ConfigError(f"bench --kill-step={self.kill_step} must be in (1, --kill-steps="
                                  f"{self.kill_steps})")

    @property
    def scenario_list(self) -> list[str]:
        return [s for s in self.scenarios.split(",") if s]

    @property
    def labels(self) -> dict[str, str]:
        """The contenders this strategy has, by name, with their labels."""
        if self.strategy == "fsdp":  # Ray Train has no FSDP2 of its own to set against
            return {"raw": "raw FSDP2", "raytrainer": LABELS["raytrainer"]}
        return LABELS

    def steps_for(self, contender: str) -> int:
        return self.ray_train_steps if contender == "ray_train" else self.steps


SMOKE = dict(steps=6, ray_train_steps=3, repetitions=1, samples=256, hidden=32, timeout_s=600.0,
             checkpoint_mb=4, kill_steps=60, kill_step=15, kill_checkpoint_every=10, input_steps=8,
             input_steps_no_loaders=3, input_workers=2, faults_count=5, faults_steps=3000, node_steps=1500,
             node_window_steps=100, parallel=2)
"""--smoke: checks that every contender and figure works, two runs at a time (the kill and
faults runs one at a time)."""


def rate(times: list[float], warmup_fraction: float) -> float:
    """Steps/s over the step times, less the leading warm-up share."""
    skip = min(int(len(times) * warmup_fraction), len(times) - 2)
    window = times[skip:]
    return (len(window) - 1) / max(window[-1] - window[0], 1e-9)
