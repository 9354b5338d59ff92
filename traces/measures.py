"""Pure routing measures, shared by the generator (``traces.synth`` solves its parameters against them)
and the statistics (``traces.stats`` reports them), so both mean the same thing by skew, CV and overlap.
"""
from __future__ import annotations

import numpy as np


def max_over_mean(x: np.ndarray) -> np.ndarray:
    """max/mean along the last axis (0 where the mean is 0), in ``x``'s dtype: ``[...]``."""
    return x.max(axis=-1) / np.maximum(x.mean(axis=-1), 1e-30)


def coef_of_variation(x: np.ndarray) -> np.ndarray:
    """std/mean along the last axis (0 where the mean is 0), in ``x``'s dtype: ``[...]``."""
    return x.std(axis=-1) / np.maximum(x.mean(axis=-1), 1e-30)


def topk_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of shared ids between rows of ``a`` and ``b`` (int ``[..., k]``, ids distinct per row):
    float ``[...]``. By sorting each row pair's ``2k`` ids and counting equal neighbours (O(k log k) per
    row, not the ``k x k`` comparison)."""
    k = a.shape[-1]
    both = np.concatenate(np.broadcast_arrays(a, b), axis=-1)
    both.sort(axis=-1)
    return (both[..., 1:] == both[..., :-1]).sum(axis=-1) / k
