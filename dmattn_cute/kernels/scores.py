"""The bias as scores: float32 values that stay finite when the bias is finite.

The score accumulator of the bias-first kernels holds S / softmax_scale, so a bias enters as
bias * (1 / scale). A finite bias near the float32 range (e.g. torch.finfo(dtype).min, the
usual padding value) would overflow to -inf there and turn a padded row into a fully masked
one. Finite values are clamped to +-FLT_MAX instead; true infinities pass unchanged (a -inf
bias masks its position, SPEC.md). Adding Q K^T to a clamped value leaves it unchanged, as
the float32 reference absorbs Q K^T into a bias of that size: the keys of a row that carry
only such biases compare equal and share the row's weight uniformly.
"""

from __future__ import annotations

import cutlass
from cutlass import cute

FLT_MAX = 3.4028234663852886e38


@cute.jit
def bias_scores(bias: cute.TensorSSA, scale: cutlass.Float32) -> cute.TensorSSA:
    """bias (any float dtype) * scale in float32, finite wherever the bias is finite."""
    x = bias.to(cutlass.Float32)
    y = x * scale
    clamped = cute.where(y > FLT_MAX, FLT_MAX, cute.where(y < -FLT_MAX, -FLT_MAX, y))
    return cute.where(abs(x) == cutlass.Float32.inf, y, clamped)
