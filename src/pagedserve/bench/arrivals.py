"""When each request is sent: all at once, Poisson, or gamma-distributed bursts."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds after the start at which each of num requests is sent.

    rate is requests per second (inf: all at once). Gaps are gamma distributed with shape
    burstiness and mean 1/rate: burstiness 1 is a Poisson process, below 1 burstier, above 1
    more even.
    """
    if math.isinf(rate):
        return np.zeros(num)
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate}, {burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num)
    # The first request goes at once, so that the run does not start with an idle wait.
    gaps[0] = 0.0
    return np.cumsum(gaps)
