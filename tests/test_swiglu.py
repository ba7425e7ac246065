"""memtrain.model.swiglu: ``w3(silu(g) * u)`` keeping only ``g`` and ``u`` for backward, its gradients equal to
autograd's bit for bit, what it keeps, where it applies, and the FFNs that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memtrain.model import swiglu
from memtrain.model.anchor import SwiGLU
from memtrain.model.crossattn.layer import _SwiGLU
from memtrain.model.swiglu import RECOMPUTE_ENV, recompute_applies, silu_mul_linear

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _plain(g, u, w):
    return F.linear(F.silu(g) * u, w)


def _inputs(shape, f, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
    w1, w2 = (torch.randn(f, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    w3 = (torch.randn(d, f, generator=gen, dtype=dtype) / f**0.5).requires_grad_()
    return x, w1, w2, w3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 37, 24), (50, 24), (2, 5, 7, 24)])
def test_gradients_equal_autograds_bit_for_bit(dtype, shape):
    """The output and the gradients of x, w1, w2 and w3 through the recomputing function equal autograd's through
    the plain ops exactly (the same ATen ops in the same order), for 2-, 3- and 4-D inputs, an odd inner width and a
    non-contiguous incoming gradient."""
    x, w1, w2, w3 = _inputs(shape, 41, dtype, seed=len(shape))
    grad = torch.randn(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))  # non-contiguous
    assert not grad.is_contiguous()
    results = []
    for fn in (_plain, swiglu._SiluMulLinear.apply):
        out = fn(F.linear(x, w1), F.linear(x, w2), w3)
        results.append((out, *torch.autograd.grad(out, (x, w1, w2, w3), grad)))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_gradients_against_float64_and_partial_backwards():
    """Against autograd in float64 (the reference), and a backward that asks for some inputs only: the others'
    gradients are not computed (None), the asked ones unchanged."""
    x, w1, w2, w3 = _inputs((4, 9, 16), 23, torch.float64, seed=1)
    g, u = F.linear(x, w1), F.linear(x, w2)
    want = torch.autograd.grad(_plain(g, u, w3).square().sum(), (g, u, w3))
    got = torch.autograd.grad(silu_mul_linear(g, u, w3).square().sum(), (g, u, w3))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    g0, u0 = g.detach(), u.detach().requires_grad_()
    (gu,) = torch.autograd.grad(silu_mul_linear(g0, u0, w3).square().sum(), (u0,))
    torch.testing.assert_close(gu, want[1], rtol=1e-12, atol=1e-12)
    seen = []
    orig = torch.Tensor.mm

    def spy(a, b):
        seen.append(tuple(a.shape))
        return orig(a, b)

    w = w3.detach()  # the weight's gradient not wanted: one GEMM (the input's) instead of two
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "mm", spy)
        silu_mul_linear(g, u, w).sum().backward()
    assert seen == [(36, 16)], seen


def _kept(module, x) -> list[tuple]:
    """Shapes of the tensors autograd keeps for ``module(x)``'s backward (its parameters and ``x`` excluded)."""
    leaves = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in leaves:
            kept[ptr] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sorted(kept.values())


@pytest.mark.parametrize("module", [SwiGLU, _SwiGLU])
def test_the_ffns_keep_their_gate_and_up_projections_alone(module, monkeypatch):
    """The anchor's (and so the Titans blocks') SwiGLU and the cross-attention memory's variant-B MLP keep the two
    projections ``w1 x`` and ``w2 x`` ([tokens, f]) besides their input; autograd's ops kept the activation and the
    product too. Outputs and gradients are the same either way."""
    torch.manual_seed(0)
    ffn = module(16, 40)
    for p in ffn.parameters():  # _SwiGLU zero-initialises w3: any gradient through it would vanish
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 16, requires_grad=True)
    assert _kept(ffn, x) == [(2, 7, 40), (2, 7, 40)]
    out = ffn(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *ffn.parameters()))
    monkeypatch.setenv(RECOMPUTE_ENV, "0")
    assert _kept(ffn, x) == [(2, 7, 40), (2, 7, 40), (2, 7, 40), (14, 40)]
    out0 = ffn(x)
    grads0 = torch.autograd.grad(out0.square().sum(), (x, *ffn.parameters()))
    assert torch.equal(out, out0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_where_it_applies(monkeypatch):
    """Recomputes eagerly with gradients on; plain ops without gradients, under autocast, while a graph is compiled,
    for a ZeRO-3 partitioned weight (``ds_id``) and with ``MEMTRAIN_SWIGLU_RECOMPUTE=0``, each with the same
    output."""
    x, w1, w2, w3 = _inputs((3, 5, 8), 12, torch.float32, seed=2)
    g, u = F.linear(x, w1), F.linear(x, w2)
    assert recompute_applies(g, u, w3)
    calls = []
    orig = swiglu._SiluMulLinear.apply
    monkeypatch.setattr(swiglu._SiluMulLinear, "apply", lambda *a: calls.append(1) or orig(*a))
    want = _plain(g, u, w3)
    assert torch.equal(silu_mul_linear(g, u, w3), want) and calls == [1]
    with torch.no_grad():
        assert not recompute_applies(g, u, w3) and torch.equal(silu_mul_linear(g, u, w3), want)
    assert not recompute_applies(g.detach(), u.detach(), w3.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not recompute_applies(g, u, w3)
        assert silu_mul_linear(g, u, w3).dtype == torch.bfloat16
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not recompute_applies(g, u, w3)
    partitioned = torch.nn.Parameter(w3.detach().clone())
    partitioned.ds_id = 0  # what DeepSpeed's ZeRO-3 sets on the parameters it partitions
    assert not recompute_applies(g, u, partitioned)
    monkeypatch.setenv(RECOMPUTE_ENV, "0")
    assert not recompute_applies(g, u, w3) and torch.equal(silu_mul_linear(g, u, w3), want)
    assert calls == [1]


def test_under_activation_checkpointing():
    """Inside a checkpointed region (the blocks' ``parallel.activation_checkpointing``) the forward reruns the
    function in backward and the gradients equal the plain ops' exactly."""
    torch.manual_seed(3)
    ffn = SwiGLU(16, 24)
    x = torch.randn(2, 6, 16, requires_grad=True)
    want = torch.autograd.grad(ffn(x).sum(), (x, *ffn.parameters()))
    got = torch.autograd.grad(checkpoint(ffn, x, use_reentrant=False).sum(), (x, *ffn.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
