"""Host-side launch arithmetic of the kernels: grid sizes and power-of-two block widths, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``@triton.jit`` functions: called from Python each goes through
Triton's JIT wrapper, 2-3 µs a call on the 2-core CPU used for development, and eager ``titans-170m-mac`` made about
3,000 such calls per micro-batch (every launch's grid and block width) -- about 2% of its host time per micro-batch
(``benchmarks/op_count.py --time``). These give the same integers for the positive sizes the kernels take.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``a >= 0``, ``b > 0`` (``triton.cdiv``)."""
    return -(-a // b)


def block(x: int, least: int = 16) -> int:
    """The smallest power of two ``>= x``, at least ``least`` (``max(least, triton.next_power_of_2(x))``): a tile
    width (``tl.arange`` takes powers of two; tensor-core products take 16 and more)."""
    return max(least, 1 << max(0, int(x) - 1).bit_length())


__all__ = ["block", "cdiv"]
