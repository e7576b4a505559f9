"""Training features on one rank, in-process (no Ray): checked by behaviour."""

import math

import pytest
import torch

from raytrainer.config import EarlyStoppingConfig, LRScheduleConfig, TrainerConfig
from raytrainer.data import BatchPlan
from raytrainer.errors import ConfigError, NonFiniteLoss
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets
from raytrainer.worker.loop.schedule import lr_multiplier

from .tasks import FeatureTask, RegressionTask


def make_loop(task=None, rows=None, **trainer):
    trainer.setdefault("max_steps", 4)
    trainer.setdefault("global_batch_size", 32)
    sink = rows if rows is not None else []
    return Loop(task or FeatureTask(), LoopSettings(trainer=TrainerConfig(**trainer)), Outlets(report=sink.extend),
                rank=0, world_size=1, device=torch.device("cpu"))


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def train_rows(rows):
    return [r for r in rows if "loss" in r and "val_loss" not in r]


@pytest.mark.parametrize("precision, flag", [("bf16", "bf16"), ("fp16", "fp16")])
def test_autocast_really_runs_in_low_precision(precision, flag):
    rows = []
    make_loop(rows=rows, precision=precision, max_steps=2).fit()
    assert all(r[flag] == 1.0 for r in train_rows(rows))
    rows = []
    make_loop(rows=rows, max_steps=2).fit()
    assert all(r["bf16"] == 0.0 and r["fp16"] == 0.0 for r in train_rows(rows))


def test_fp16_skips_and_counts_an_overflow_step():
    rows = []
    # The scaler alone: by default an inf loss would stop the run (trainer.nonfinite).
    loop = make_loop(FeatureTask(inf_at_step=5), rows, precision="fp16", max_steps=5, nonfinite="off")
    initial = params(loop.module)
    for step in range(4):  # the scaler may skip a first step or two while it calibrates
        loop.train_step()
    assert any(not torch.equal(a, b) for a, b in zip(initial, params(loop.module)))
    before, scale, skipped = params(loop.module), loop.scaler.get_scale(), loop.skipped_steps
    loop.train_step()  # inf loss -> inf gradients
    for a, b in zip(before, params(loop.module)):
        assert torch.equal(a, b)
    assert loop.skipped_steps == skipped + 1 and loop.scaler.get_scale() < scale
    loop.flush(wait=True)
    assert [r["skipped_steps"] for r in rows][-2:] == [skipped, skipped + 1]


@pytest.mark.parametrize("micro", [None, 4])
def test_clipping_caps_the_update_and_logs_the_pre_clip_norm(micro):
    def first_update(clip):
        rows = []
        loop = make_loop(FeatureTask(lr=1.0), rows, max_steps=1, grad_clip_norm=clip, micro_batch_size=micro)
        before = params(loop.module)
        loop.train_step()
        loop.flush(wait=True)
        delta = torch.cat([(a - b).flatten() for a, b in zip(before, params(loop.module))])
        return delta.norm().item(), rows

    raw, _ = first_update(None)  # lr 1, plain SGD: the update is the gradient
    clipped, rows = first_update(0.01)
    assert raw > 0.05
    assert clipped == pytest.approx(0.01, rel=1e-4)
    assert rows[0]["grad_norm"] == pytest.approx(raw, rel=1e-4)


def test_ema_equals_a_reference_computed_by_hand():
    loop = make_loop(ema_decay=0.9, max_steps=5)
    reference = None
    for step in range(5):
        loop.train_step()
        current = params(loop.module)
        reference = current if reference is None else [0.9 * e + 0.1 * p for e, p in zip(reference, current)]
    for e, r in zip(params(loop.ema.module), reference):
        torch.testing.assert_close(e, r)
    final = loop.fit()  # the run is at max_steps: fit returns the EMA weights
    ema_state = loop.ema.module.state_dict()
    assert all(torch.equal(final[k], ema_state[k]) for k in final)
    assert not torch.equal(final["0.weight"], loop.module.state_dict()["0.weight"])


def test_validation_uses_the_ema_weights():
    rows = []
    loop = make_loop(rows=rows, ema_decay=0.5, max_steps=3)
    loop.fit()
    with torch.no_grad():
        x, y, _ = loop.val_data.tensors
        expected = torch.nn.functional.mse_loss(loop.ema.module(x), y).item()
    assert rows[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_warmup_cosine_matches_the_closed_form():
    cfg = LRScheduleConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    total = 20
    assert [lr_multiplier(s, total, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    for s in (4, 9, 14, 19):
        progress = (s - 4) / (total - 1 - 4)
        assert lr_multiplier(s, total, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert lr_multiplier(19, total, cfg) == pytest.approx(0.1)
    linear = LRScheduleConfig(warmup_steps=0, decay="linear")
    assert lr_multiplier(5, 11, linear) == pytest.approx(0.5)

    rows = []
    make_loop(rows=rows, max_steps=total, lr_schedule=cfg).fit()
    logged = [r["lr"] for r in train_rows(rows)]
    assert logged == pytest.approx([0.05 * lr_multiplier(s, total, cfg) for s in range(total)])


def test_lr_schedule_and_a_task_scheduler_conflict():
    class WithScheduler(FeatureTask):
        def build_scheduler(self, optimizer, total_steps):
            return torch.optim.lr_scheduler.StepLR(optimizer, 1)

    with pytest.raises(ConfigError, match="keep one of them"):
        make_loop(WithScheduler(), lr_schedule=LRScheduleConfig())


def test_early_stopping_stops_after_patience_validations():
    rows = []
    loop = make_loop(FeatureTask(frozen=True), rows, max_steps=20, val_every_n_steps=2,
                     early_stopping=EarlyStoppingConfig(metric="val_loss", patience=2))
    loop.fit()
    assert loop.step == 6  # best at 2, no better at 4 and 6
    assert loop.stop_reason.startswith("early_stopping: val_loss did not improve")
    with pytest.raises(ConfigError, match="not a validation metric"):
        make_loop(rows=[], early_stopping=EarlyStoppingConfig(metric="val_nope"), max_steps=1).fit()


def test_throughput_metrics():
    rows = []
    make_loop(rows=rows, max_steps=3, peak_flops_per_worker=1e9).fit()
    for r in train_rows(rows):
        assert r["tokens_per_s"] == pytest.approx(16 * r["samples_per_s"])
        assert r["model_flops_per_s"] == pytest.approx(1000 * r["samples_per_s"])
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / 1e9)


def test_fast_dev_run_takes_n_steps_and_n_validation_batches():
    class Counting(FeatureTask):
        val_batches = 0

        def val_step(self, model, batch):
            Counting.val_batches += 1
            return super().val_step(model, batch)

    rows = []
    loop = make_loop(Counting(val_samples=64), rows, max_steps=None, max_epochs=5, fast_dev_run=2,
                     micro_batch_size=8)
    loop.fit()
    assert [r["step"] for r in train_rows(rows)] == [1, 2]
    assert "val_loss" in rows[-1] and Counting.val_batches == 2
    assert loop.stop_reason == "fast_dev_run"


def test_overfit_batches_repeats_the_same_batches_every_epoch():
    plan = BatchPlan(256, 32, 32, 1, seed=0, overfit_batches=2)
    assert plan.steps_per_epoch == 2
    for step in range(2):
        assert torch.equal(plan.micro_batches(0, step * 32, 0)[0], plan.micro_batches(3, step * 32, 0)[0])
    loop = make_loop(max_steps=None, max_epochs=3, overfit_batches=2)
    assert loop.total_steps == 6
    rows = []
    make_loop(RegressionTask(), rows, max_steps=None, max_epochs=30, overfit_batches=1).fit()
    assert train_rows(rows)[-1]["loss"] < 0.2 * train_rows(rows)[0]["loss"]


def test_a_nonfinite_loss_stops_the_run_at_its_step_before_the_update():
    loop = make_loop(FeatureTask(inf_at_step=3), max_steps=5)
    with pytest.raises(NonFiniteLoss, match=r"step 3: the loss is inf on rank 0.*trainer.nonfinite: skip"):
        loop.fit()
    assert loop.step == 2 and all(torch.isfinite(p).all() for p in loop.module.parameters())


def test_skip_drops_a_nonfinite_step_counts_it_and_stops_after_too_many_in_a_row():
    rows, events = [], []
    loop = Loop(FeatureTask(inf_at_step=3, batchnorm=True),
                LoopSettings(trainer=TrainerConfig(max_steps=5, global_batch_size=32, nonfinite="skip",
                                                   grad_clip_norm=1.0)),
                Outlets(report=rows.extend, notify=events.append), rank=0, world_size=1, device=torch.device("cpu"))
    for _ in range(2):
        loop.train_step()
    before = params(loop.module) + [b.clone() for b in loop.module.buffers()]
    loop.train_step()  # inf: no update, and the BatchNorm statistics of its forward undone
    after = params(loop.module) + [b.clone() for b in loop.module.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    loop.fit()
    assert loop.step == 5 and all(torch.isfinite(p).all() for p in loop.module.parameters())
    assert [r["nonfinite_skips"] for r in train_rows(rows)] == [0, 0, 1, 1, 1]
    assert [(e["event"], e["step"]) for e in events if e["event"] == "nonfinite_skipped"] == \
        [("nonfinite_skipped", 3)]

    class AlwaysInf(FeatureTask):
        def train_step(self, model, batch):
            out = super().train_step(model, batch)
            return {**out, "loss": out["loss"] * float("inf") if self.steps > 1 else out["loss"]}

    loop = make_loop(AlwaysInf(), max_steps=9, nonfinite="skip", nonfinite_max_skips=2)
    with pytest.raises(NonFiniteLoss, match=r"step 4: .* more than trainer.nonfinite_max_skips=2 in a row"):
        loop.fit()
    assert loop.nonfinite_skips == 2


class InfOnRankOne(FeatureTask):
    """The loss is inf at step 3 on rank 1 only."""

    def train_step(self, model, batch):
        import torch.distributed as dist

        out = super().train_step(model, batch)
        if self.steps == 3 and dist.get_rank() == 1:
            out["loss"] = out["loss"] * float("inf")
        return out


def _nonfinite_on_rank_one(rank, world_size, strategy, mode):
    loop = Loop(InfOnRankOne(), LoopSettings(trainer=TrainerConfig(max_steps=5, global_batch_size=32, strategy=strategy,
                                                                   nonfinite=mode)),
                Outlets(), rank=rank, world_size=world_size, device=torch.device("cpu"))
    try:
        loop.fit()
    except NonFiniteLoss as exc:
        return loop.step, str(exc)
    return loop.step, loop.nonfinite_skips


class HugeLossEverywhere(FeatureTask):
    """At step 3 every rank's loss is finite, 3e38, and their float32 sum is not."""

    def train_step(self, model, batch):
        out = super().train_step(model, batch)
        if self.steps == 3:
            out["loss"] = out["loss"] * 0 + 3e38
        return out


def _huge_sum(rank, world_size):
    loop = Loop(HugeLossEverywhere(), LoopSettings(trainer=TrainerConfig(max_steps=5, global_batch_size=32)),
                Outlets(), rank=rank, world_size=world_size, device=torch.device("cpu"))
    with pytest.raises(NonFiniteLoss) as info:
        loop.fit()
    return loop.step, str(info.value)


def test_a_sum_over_ranks_that_overflows_stops_the_run_and_names_no_rank():
    from .dist_procs import run_ranks

    for step, why in run_ranks(_huge_sum, 2):
        assert step == 2 and why.startswith("step 3: the loss is inf (the sum over ranks overflows).")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_stops_or_skips_the_same_step_when_one_ranks_loss_is_not_finite(strategy):
    from .dist_procs import run_ranks

    stopped = run_ranks(_nonfinite_on_rank_one, 2, strategy, "stop")
    assert [step for step, _ in stopped] == [2, 2]
    if strategy == "ddp":  # the ranks ride beside the loss in the gradient all-reduce
        assert all(why.startswith("step 3: the loss is inf on rank(s) 1.") for _, why in stopped)
    else:  # no carried metrics: the reduce-scattered gradient shards are NaN on every rank
        assert all(why.startswith("step 3: the gradients are not finite") for _, why in stopped)
    assert run_ranks(_nonfinite_on_rank_one, 2, strategy, "skip") == [(5, 1), (5, 1)]
