"""Layers with two implementations of one computation, the dispatch between them chosen once.

forward_native is the torch reference, which runs on any device and dtype; forward_cpu calls a
C++ CPU kernel (csrc/ops.cpp lists them all). A layer runs forward_native until use_cpu_kernel
switches it, once, at load time (DecoderModel.use_cpu_kernels): no layer tests a flag per call.
"""

from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._forward = self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

    def supports_cpu_kernel(self) -> bool:
        """Whether forward_cpu can compute what forward_native does for this layer."""
        return True

    def use_cpu_kernel(self) -> None:
        if self.supports_cpu_kernel():
            self._forward = self.forward_cpu

    @property
    def uses_cpu_kernel(self) -> bool:
        return self._forward == self.forward_cpu
