"""Frameworks inside your own loop (raytrainer.train_loop): one import each.

- `raytrainer.integrations.hf`: a Hugging Face `Trainer` (extra `[hf]`);
- `raytrainer.integrations.lightning`: a PyTorch Lightning `Trainer` (extra `[lightning]`).

accelerate needs nothing of its own: an `Accelerator()` made inside the loop function takes
the process group raytrainer formed (README, "Your own loop").

Each module imports its framework when it is imported, never from `raytrainer` itself, so a
run that does not use a framework does not load it.
"""
