"""tests/triton_interpreter.py: the suite's interpreter skips Triton's redundant re-patching of ``triton.language``
on nested device-function calls, and the kernels compute the same, bit for bit."""

from __future__ import annotations

import os

import torch

import triton_interpreter  # tests/triton_interpreter.py
from memtrain.kernels import titans as titans_kernels


def _scan(seed: int):
    """The depth-2 scan kernels (forward, then backward with the coefficients' kernels) at a small odd shape: every
    output and input gradient."""
    gen = torch.Generator().manual_seed(seed)
    N, T, D, H, C = 2, 11, 5, 7, 4
    q, k = (torch.nn.functional.normalize(torch.randn(N, T, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(N, T, D, generator=gen)
    lr = 0.1 * torch.rand(N, T, generator=gen)
    log_eta = torch.nn.functional.logsigmoid(torch.randn(N, T, generator=gen))
    log_keep = torch.nn.functional.logsigmoid(torch.randn(N, T, generator=gen) + 3.0)
    w = [torch.randn(N, H, D, generator=gen) / D ** 0.5, torch.randn(N, D, H, generator=gen) / H ** 0.5]
    s = [0.1 * torch.randn(x.shape, generator=gen) for x in w]
    ins = [q, k, v, lr, log_eta, log_keep, *w, *s]
    for x in ins:
        x.requires_grad_(True)
    y, w_end, s_end, _ = titans_kernels.scan(q, k, v, lr, log_eta, log_keep, w, s, w, 0, C, kernel="triton")
    outs = [y, *w_end, *s_end]
    cots = [torch.randn(o.shape, generator=gen) for o in outs]
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cots)), ins)
    return [o.detach() for o in outs] + list(grads)


def test_kernel_interpreter_patches_the_language_once_per_launch_and_computes_the_same():
    if os.environ.get("TRITON_INTERPRET") != "1":  # compiled kernels (a GPU): conftest leaves Triton alone
        assert torch.cuda.is_available() and triton_interpreter._installed is None
        return
    uninstall = triton_interpreter.install()  # conftest installed it: the same function back
    assert uninstall is not None and triton_interpreter.install() is uninstall
    stats = uninstall.stats
    before = dict(stats)
    fast = _scan(7)
    patched, skipped = stats["patched"] - before["patched"], stats["skipped"] - before["skipped"]
    # every launch patches once for its kernel (and once more for tl.core, which Triton's own tl.sum etc. see);
    # the nested device-function calls (thousands here) skip
    assert 0 < patched < 40 and skipped > 50 * patched, (patched, skipped)
    uninstall()
    try:
        assert triton_interpreter._installed is None
        plain = _scan(7)
        assert stats["patched"] - before["patched"] == patched  # Triton's own _patch_lang ran, not the wrapper
    finally:
        assert triton_interpreter.install() is not None  # as conftest left it, for the rest of the worker's tests
    assert len(fast) == len(plain)
    for a, b in zip(fast, plain):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
