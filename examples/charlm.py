"""Language modelling: a small character-level transformer on Python's own source.

The corpus is the Python standard library's top-level modules (sorted file names
under os.path.dirname(os.__file__), never site-packages), concatenated and cut
at `max_bytes`: every worker, and every machine with the same Python version,
builds the same text without a download. Characters are bytes (a fixed
256-symbol vocabulary). The last `val_fraction` of the text is validation.

Shows a sequence model (causal self-attention through
F.scaled_dot_product_attention), datasets of precomputed (input, target) windows,
a baseline metric beside the loss (val_unigram_loss: the cross-entropy of the
same targets under the training text's byte frequencies), and the
tokens_per_sample / flops_per_sample attributes that add tokens_per_s and
model_flops_per_s to every training row.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.nn.functional as F

from raytrainer.task import Task

VOCAB = 256  # bytes


def stdlib_text(max_bytes: int) -> bytes:
    """The first `max_bytes` of the sorted top-level stdlib modules, joined by newlines."""
    root = os.path.dirname(os.__file__)
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read() + b"\n"
        parts.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def windows(data: torch.Tensor, block: int, stride: int) -> torch.utils.data.TensorDataset:
    """Item i: input data[i*stride : i*stride+block], target the same shifted by one."""
    w = data.unfold(0, block + 1, stride).long()  # [N, block + 1]
    return torch.utils.data.TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, d/heads]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(torch.nn.Module):
    def __init__(self, block_size: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, d_model)
        self.pos = torch.nn.Parameter(torch.randn(block_size, d_model) * 0.02)
        self.blocks = torch.nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, VOCAB)

    def forward(self, x):  # [b, t] byte ids -> [b, t, VOCAB] logits
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.ln(self.blocks(h)))


def num_params(block_size: int, d: int, layers: int) -> int:
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return VOCAB * d + block_size * d + layers * per_block + 2 * d + d * VOCAB + VOCAB


class CharLMTask(Task):
    def __init__(self, block_size: int = 128, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 max_bytes: int = 1_000_000, val_fraction: float = 0.05, stride: int | None = None,
                 lr: float = 1e-2, weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.99)):
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.block_size, self.d_model, self.n_layers, self.n_heads = block_size, d_model, n_layers, n_heads
        self.max_bytes, self.val_fraction = max_bytes, val_fraction
        self.stride = stride or block_size  # default: non-overlapping windows
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        # Read by the loop: tokens_per_s and model_flops_per_s (6 FLOPs per parameter per token).
        self.tokens_per_sample = block_size
        self.flops_per_sample = 6 * num_params(block_size, d_model, n_layers) * block_size
        self._split = None

    def _datasets(self):
        if self._split is None:
            data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
            n_val = int(len(data) * self.val_fraction)
            train, val = data[:-n_val], data[-n_val:]  # split by position: val is the tail
            # Baseline: byte frequencies of the training text (add-one smoothed).
            counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1
            self.unigram_logp = (counts / counts.sum()).log().float()
            self._split = (windows(train, self.block_size, self.stride),
                           windows(val, self.block_size, self.block_size))
        return self._split

    def build_model(self) -> torch.nn.Module:
        return CharTransformer(self.block_size, self.d_model, self.n_layers, self.n_heads)

    def build_optimizer(self, model):
        # Weight decay on the matrices of the linear layers only.
        params = list(model.named_parameters())
        decay = [p for n, p in params if p.dim() == 2 and n not in ("tok.weight", "pos")]
        other = [p for n, p in params if not (p.dim() == 2 and n not in ("tok.weight", "pos"))]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": other, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)

    def train_dataset(self):
        return self._datasets()[0]

    def val_dataset(self):
        return self._datasets()[1]

    def train_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))}

    def val_step(self, model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        unigram = -self.unigram_logp.to(y.device)[y].mean()
        return {"loss": loss, "unigram_loss": unigram}
