"""scikit-learn's bundled 8x8 digits (1797 images, offline), the data of every digits example.

Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the
label per row, exactly what ``sklearn.datasets.load_digits()`` returns) without importing
scikit-learn itself, which takes a second of every launch's start here (0.1 s this way).
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import torch

__all__ = ["digits"]

_MISSING = ("the digits examples load scikit-learn's bundled digits: "
            "pip install -e '.[examples]' (or pip install scikit-learn)")


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(images ``[1797, 64]`` float32, pixel values 0-16; labels ``[1797]`` int64), in the file's order."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:  # an optional dependency: pipeq itself does not need it
        raise ModuleNotFoundError(_MISSING)
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):  # a scikit-learn that keeps them elsewhere: its own loader
        from sklearn.datasets import load_digits

        data = load_digits()
        return torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.long)
    with gzip.open(path, "rt") as f:
        rows = torch.tensor([[float(v) for v in line.split(",")] for line in f if line.strip()])
    return rows[:, :-1].contiguous(), rows[:, -1].long()
