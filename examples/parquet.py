"""Ray Data input: Parquet files, preprocessed by Ray's CPU workers, streamed to each rank.

`train_dataset` returns a `ray.data.Dataset`: read the Parquet files, then a
`map_batches` preprocessing step (scale the pixels, add noise for augmentation, cast)
that runs as Ray tasks on any node's CPUs, not in the training processes. Each rank
streams its split (see raytrainer/worker/input/raydata.py for the position and what a resume or a
resize keeps). Validation stays a plain in-memory dataset.

The Parquet files are written at the first run from scikit-learn's bundled 8x8 digits
(no download), under `path`; on a multi-node cluster give a path every node sees (a
shared filesystem, or s3://... written once beforehand).

Needs scikit-learn and pyarrow: pip install 'raytrainer[examples]'.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from raytrainer.task import Task


def write_parquet(path: str, files: int = 4, val_fraction: float = 0.2, seed: int = 0) -> None:
    """The digits' training share as `files` Parquet files in `path` (once; atomic, so
    several workers may race to write it) and the validation share beside them."""
    if os.path.exists(os.path.join(path, "_COMPLETE")):
        return
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    n_val = int(len(order) * val_fraction)
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.join(tmp, "train"))
    for name, index in (("val", order[:n_val]), ("train", order[n_val:])):
        for i, part in enumerate(np.array_split(index, files if name == "train" else 1)):
            table = pa.table({"pixels": list(data.images[part].reshape(len(part), 64).astype(np.uint8)),
                              "label": data.target[part].astype(np.int64)})
            pq.write_table(table, os.path.join(tmp, "train", f"part-{i}.parquet") if name == "train"
                           else os.path.join(tmp, "val.parquet"))
    open(os.path.join(tmp, "_COMPLETE"), "w").close()
    try:
        os.rename(tmp, path)  # another worker may have won the race: then keep its copy
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def preprocess(batch: dict[str, np.ndarray], noise: float = 0.05) -> dict[str, np.ndarray]:
    """Runs in Ray Data's tasks: pixels 0..16 -> [0, 1] images [N, 1, 8, 8], plus noise."""
    pixels = np.stack(batch["pixels"]).astype(np.float32) / 16.0
    rng = np.random.default_rng()
    images = pixels + noise * rng.standard_normal(pixels.shape, dtype=np.float32)
    return {"image": images.reshape(-1, 1, 8, 8), "label": batch["label"]}


class ParquetDigitsTask(Task):
    def __init__(self, path: str = "data/digits-parquet", channels: int = 32, lr: float = 3e-3,
                 noise: float = 0.05):
        self.path = os.path.abspath(path)
        self.channels, self.lr, self.noise = channels, lr, noise

    def build_model(self) -> torch.nn.Module:
        c = self.channels
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(c * 4 * 4, 10),
        )

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.lr)

    def train_dataset(self):
        import ray.data

        write_parquet(self.path)
        return (ray.data.read_parquet(os.path.join(self.path, "train"))
                .map_batches(preprocess, fn_kwargs={"noise": self.noise}, batch_format="numpy"))

    def val_dataset(self):
        import pyarrow.parquet as pq

        write_parquet(self.path)
        table = pq.read_table(os.path.join(self.path, "val.parquet"))
        pixels = torch.tensor(np.stack(table["pixels"].to_numpy(zero_copy_only=False)), dtype=torch.float32)
        images = (pixels / 16.0).reshape(-1, 1, 8, 8)
        labels = torch.tensor(table["label"].to_numpy(), dtype=torch.int64)
        return [{"image": x, "label": y} for x, y in zip(images, labels)]

    def train_step(self, model, batch):
        logits = model(batch["image"])
        loss = F.cross_entropy(logits, batch["label"])
        return {"loss": loss, "accuracy": (logits.argmax(dim=1) == batch["label"]).float().mean()}
