"""The precision of the norms and clipped sums.

They are formed in float32 at least, whatever the parameters' dtype (bf16 activations and output
gradients are upcast; the clip factors stay float32), and with float32 matmuls at full precision
(``float32_matmuls_at_full_precision``: no TF32 or bf16 passes, whatever the user's global
setting), so that a sample's clipped contribution is ``c_i g_i`` to float32 rounding, which the clip
factor's margin covers (``dptorch.clipping.factors``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def float32_matmuls_at_full_precision() -> Iterator[None]:
    """Float32 matmuls in full float32 inside the block, whatever the user's TF32/bf16 setting.

    ``torch.backends.cuda.matmul.allow_tf32`` (the HF Trainer's ``tf32=True``) or
    ``torch.set_float32_matmul_precision("high"/"medium")`` let float32 matmuls round their inputs
    to 10 or 7 mantissa bits: a clipped contribution could then exceed ``C`` by up to about 0.4 %.
    Nothing is touched when the setting already is full precision; otherwise it is restored on
    exit (on torch >= 2.9 through the per-backend flags, which then read back as before through
    the legacy API too: torch refuses reads after a mix of the two APIs).
    """
    matmul_backends = [getattr(getattr(torch.backends, name, None), "matmul", None) for name in ("cuda", "mkldnn")]
    if all(hasattr(b, "fp32_precision") for b in matmul_backends):  # torch >= 2.9
        generic = torch.backends.fp32_precision
        before = [b.fp32_precision for b in matmul_backends]
        effective = [generic if value == "none" else value for value in before]
        if all(value in ("ieee", "none") for value in effective):
            yield
            return
        try:
            for backend in matmul_backends:
                backend.fp32_precision = "ieee"
            yield
        finally:
            for backend, value in zip(matmul_backends, before):
                backend.fp32_precision = value
        return
    before_precision = torch.get_float32_matmul_precision()
    if before_precision == "highest":
        yield
        return
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(before_precision)
