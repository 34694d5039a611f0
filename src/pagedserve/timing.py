"""Clocks for timing model work: the device finishes its queued work before the clock is read.

CUDA kernels run asynchronously, so a clock read right after a call would time the launch, not the
work. Every benchmark timing of model work goes through `device_clock` or `Stopwatch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    """Waits for all work queued on device. CPU work runs synchronously: nothing to wait for."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def device_clock(device: torch.device | str) -> float:
    """time.perf_counter() (monotonic) once device has finished everything queued so far."""
    synchronize(device)
    return time.perf_counter()


@dataclass
class Stopwatch:
    """`with Stopwatch(device) as watch: ...` then watch.seconds, both ends synchronized."""

    device: torch.device | str
    started: float = 0.0
    seconds: float = 0.0

    def __enter__(self) -> Stopwatch:
        # Work queued before the block must not be billed to it.
        self.started = device_clock(self.device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = device_clock(self.device) - self.started
