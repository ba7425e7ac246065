"""memtrain.model.grouped_linear: one weight over many inputs, its gradient computed once in backward.

Every gradient is checked against autograd's per-use sum (plain ``F.linear``) in float64, and the backward's
GEMMs are counted: one weight-gradient GEMM for all uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memtrain.model.grouped_linear import GroupedLinear, fan_out, grouped_linear


def _params(bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    xs = [torch.randn(*shape, 5, generator=gen, dtype=torch.float64, requires_grad=True)
          for shape in ((2, 3), (11,), (2, 1), (1, 4, 2))]
    return w, b, xs


def _loss(project, xs):
    """Uses of different shapes; the third's output reaches the loss twice, the last not at all; a chain
    (the second use's output feeds the projection again), as MAC's segments feed each other."""
    ys = [project(x) for x in xs]
    chained = project(ys[1][..., :5].tanh())
    return (ys[0] ** 2).sum() + ys[1].sin().sum() + 3 * ys[2].sum() + ys[2].pow(3).sum() + chained.exp().sum()


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_gradients_equal_autograd_per_use_sum(bias, op_names):
    w, b, xs = _params(bias)
    ref = torch.autograd.grad(_loss(lambda x: F.linear(x, w, b), xs), [w, *xs] + ([b] if bias else []),
                              allow_unused=True)
    group = grouped_linear(w, b)
    assert isinstance(group, GroupedLinear)
    loss = _loss(group, xs)
    with op_names() as ops:
        got = torch.autograd.grad(loss, [w, *xs] + ([b] if bias else []), allow_unused=True)
    for a, r in zip(got, ref):
        if r is None:
            assert a is None
        else:
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    # 4 of the 5 uses reach the loss: 4 input-gradient GEMMs (the unused one's input gets none) and one for the
    # weight, where autograd runs one per use and adds them up
    assert ops.names.count("mm") == 4 + 1 and ops.names.count("sum") == (1 if bias else 0), ops.names
    assert group.xs == [] and group.grads == []  # handed-over rows are dropped once reduced


def test_grouped_linear_backward_into_leaf_grads_twice_and_after_partial_backward():
    """``.backward()`` accumulates into ``.grad`` as autograd would (twice through a retained graph: twice the
    gradient); a backward that asks only for an input's gradient hands nothing over, so the next full backward
    sees only its own uses."""
    w, b, xs = _params(True)
    _loss(lambda x: F.linear(x, w, b), xs).backward()
    ref_w, ref_b = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None
    loss = _loss(grouped_linear(w, b), xs)
    (dx,) = torch.autograd.grad(loss, xs[0], retain_graph=True)
    assert w.grad is None
    loss.backward(retain_graph=True)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, ref_b, rtol=1e-12, atol=1e-12)
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * ref_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, 2 * ref_b, rtol=1e-12, atol=1e-12)


def test_grouped_linear_under_activation_checkpointing():
    """Inside a non-reentrant checkpoint (as ``train.recompute`` wraps blocks) the recomputed forward's saved
    tensors reach the original uses: the same gradients."""
    w, b, xs = _params(True, seed=1)
    ref = torch.autograd.grad(_loss(lambda x: F.linear(x, w, b), xs), [w, b, *xs[:4]], allow_unused=True)
    got = torch.autograd.grad(checkpoint(lambda *a: _loss(grouped_linear(w, b), list(a)), *xs, use_reentrant=False),
                              [w, b, *xs[:4]], allow_unused=True)
    assert got[-1] is None and ref[-1] is None  # the last use reaches no loss
    for a, r in zip(got[:-1], ref[:-1]):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_grouped_linear_is_plain_linear_where_it_does_not_apply(monkeypatch):
    """No gradients, a frozen weight, autocast, ``enabled=False`` or ``MEMTRAIN_GROUPED_WGRAD=0``: ``F.linear``
    itself (no group, no custom node)."""
    w, b, xs = _params(True)
    assert not isinstance(grouped_linear(w, b, enabled=False), GroupedLinear)
    monkeypatch.setenv("MEMTRAIN_GROUPED_WGRAD", "0")
    assert not isinstance(grouped_linear(w, b), GroupedLinear)
    monkeypatch.setenv("MEMTRAIN_GROUPED_WGRAD", "1")
    x = xs[0]
    with torch.no_grad():
        assert not isinstance(grouped_linear(w, b), GroupedLinear)
    frozen = w.detach()
    project = grouped_linear(frozen, None)
    assert not isinstance(project, GroupedLinear)
    torch.testing.assert_close(project(x), F.linear(x, frozen), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not isinstance(grouped_linear(w.float(), b.float()), GroupedLinear)
    assert torch.equal(grouped_linear(w, b)(x), F.linear(x, w, b))


def test_grouped_linear_refuses_double_backward():
    w, b, xs = _params(False)
    y = grouped_linear(w, b)(xs[0])
    (g,) = torch.autograd.grad(y.pow(2).sum(), xs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|twice"):
        g.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fan_out_sums_the_uses_gradients_in_one_op(dtype, op_names):
    """``fan_out(x, k)``: k aliases of ``x`` whose gradients reach ``x`` as one stack and one sum instead of
    ``k - 1`` adds; an alias the loss does not reach adds nothing. float64: equal to autograd's sum to 1e-12;
    bf16: as close to the float64 gradient as autograd's chain of bf16 adds (the sum accumulates in float32 and
    rounds once), or within 2^-7 of its largest element."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    others = [torch.randn(2, 6, generator=gen, dtype=torch.float64).to(dtype) for _ in range(5)]

    def loss(aliases):
        return sum((torch.cat([a, o]) * (i + 1.5)).sin().sum() for i, (a, o) in enumerate(zip(aliases, others))
                   if i != 3)  # the fourth alias reaches no loss

    total = loss(fan_out(x, 5))
    with op_names() as ops:
        got = torch.autograd.grad(total, x)[0]
    assert ops.names.count("add") == 0 and ops.names.count("stack") == 1 and ops.names.count("sum") == 1, ops.names
    if dtype == torch.float64:
        want = torch.autograd.grad(loss([x] * 5), x)[0]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    else:
        x64 = x.detach().double().requires_grad_(True)
        others[:] = [o.double() for o in others]
        exact = torch.autograd.grad(loss([x64] * 5), x64)[0]
        others[:] = [o.to(dtype) for o in others]
        plain = torch.autograd.grad(loss([x] * 5), x)[0]
        assert got.dtype == dtype
        err, plain_err = ((g.double() - exact).abs().max().item() for g in (got, plain))
        assert err <= max(plain_err, 2 ** -7 * exact.abs().max().item()), (err, plain_err)


def test_fan_out_is_x_itself_where_it_does_not_apply(monkeypatch):
    x = torch.randn(3, requires_grad=True)
    assert fan_out(x, 4, enabled=False) == (x,) * 4 and fan_out(x, 1) == (x,)
    with torch.no_grad():
        assert fan_out(x, 4) == (x,) * 4
    monkeypatch.setenv("MEMTRAIN_GROUPED_WGRAD", "0")
    assert fan_out(x, 4) == (x,) * 4
    monkeypatch.delenv("MEMTRAIN_GROUPED_WGRAD")
    aliases = fan_out(x, 4)
    assert len(aliases) == 4 and all(a is not x and torch.equal(a, x) for a in aliases)
