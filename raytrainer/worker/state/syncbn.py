"""SyncBatchNorm that also works on CPU with Gloo.

torch.nn.SyncBatchNorm only runs on GPUs (DDP refuses it on CPU). On CPU we use
GlooSyncBatchNorm: per-channel sum, sum of squares and count are all-reduced
with the autograd-aware all_reduce, so the forward normalises with the
statistics of the global micro-batch and the backward is exact (the gradient of
a SUM all-reduce is a SUM all-reduce of the gradients, the same maths as
torch's CUDA kernels). With gradient accumulation the statistics cover one
micro-batch of every worker, not the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _internals


class _AllReduceSum(torch.autograd.Function):
    """SUM all-reduce whose gradient is the SUM all-reduce of the incoming gradients.
    (torch.distributed.nn.functional.all_reduce does this but is deprecated.)"""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class GlooSyncBatchNorm(_internals.BatchNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()  # statistics in fp32, also under autocast
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), xf.new_tensor([x.numel() // channels])])
        stats = _AllReduceSum.apply(local)
        n = stats[-1]
        mean = stats[:channels] / n
        var = (stats[channels:-1] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                unbiased = var * n / (n - 1).clamp_min(1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Every BatchNorm layer synchronised across ranks: torch's on GPUs, ours elsewhere."""
    if device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if _internals.is_batchnorm(module) and not isinstance(module, GlooSyncBatchNorm):
        out = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        if module.track_running_stats:
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, device))
    return out
