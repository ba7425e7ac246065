"""One weight applied to many inputs in a forward, its gradient computed once in backward: :class:`GroupedLinear`;
and one tensor used many times, its gradients summed in one op: :func:`fan_out`.

Why. Eager MAC (:meth:`memtrain.model.titans.arch.TitansBlock._mac`) runs the same projections once per segment:
the memory's ``to_qkv``, ``to_gates`` and ``to_out``, the attention's stacked key/value weight and ``wo`` (8
segments per block in the paper recipes). Autograd then computes each use's weight gradient with its own GEMM
(and the bias's with its own sum) and adds them up as they arrive: ``2k - 1`` device ops per weight for ``k``
uses, where ``dW = sum_i dY_i^T X_i = cat(dY)^T cat(X)`` is one GEMM over all rows (Megatron-LM defers and fuses
its weight gradients for the same reason). For ``titans-170m-mac`` grouping removes 960 of the 7,857 device ops of
one sequence's forward and backward (``benchmarks/op_count.py``), and the one GEMM has all the rows of the
block's segments instead of one segment's.

How. ``GroupedLinear(weight, bias)`` is made once per forward (per block); each call ``group(x)`` is ``F.linear(x,
weight, bias)``. In backward each call computes only its input's gradient and hands ``(x, dY)`` to the group; the
weight's (and bias's) gradient is computed by the group's root node, which autograd runs only after every use of
the weight that the backward reaches (they all consume its output), with one concatenation of the inputs, one of
the output gradients, one GEMM and one sum. Uses the current backward does not reach hand nothing over (their
contribution is zero), and a backward that does not ask for the weight's gradient (``torch.autograd.grad`` with
respect to some inputs) hands over nothing either (``torch._C._will_engine_execute_node``), so a later backward
through a retained graph sees only its own uses.

Where it is used. :func:`grouped_linear` returns a group only where it applies: eager (not while a graph is traced:
a compiled graph fuses the sums itself), with gradients enabled, autocast off (the use's backward multiplies in the
weight's dtype), a weight that needs a gradient and ``MEMTRAIN_GROUPED_WGRAD`` not ``0``; otherwise plain
``F.linear`` with the same arguments. The
result equals autograd's sum of per-use gradients up to the order of additions (tests/test_grouped_linear.py:
float64 to 1e-12, with a bias, uses the loss does not reach, partial backwards and activation checkpointing).
Not twice differentiable (``once_differentiable``).

:func:`fan_out` is the same idea where a tensor itself, not a projection, is used many times (MAC's persistent
tokens' keys and values, one concatenation per segment; the memory's convolution weight and bias, one convolution
per segment): autograd adds the ``k`` uses' gradients one by one (``k - 1`` adds); ``fan_out(x, k)`` gives each
use its own alias of ``x`` and sums their gradients with one stack and one sum (accumulated in float32 for bf16,
rounded once).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memtrain.model import switches


class _Root(torch.autograd.Function):
    """The weight (and bias) as the group's uses see them; its backward delivers their gradients, once."""

    @staticmethod
    def forward(ctx, group: "GroupedLinear", weight: torch.Tensor, bias: Optional[torch.Tensor]):
        ctx.group = group
        ctx.set_materialize_grads(False)  # its incoming gradients are None: the uses hand theirs to the group
        return weight.view_as(weight), (None if bias is None else bias.view_as(bias))

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_weight, _grad_bias):
        return (None, *ctx.group._reduce())


class _Use(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward returns ``x``'s gradient and hands ``(x, dY)`` to the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: "GroupedLinear"):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        group = ctx.group
        if torch._C._will_engine_execute_node(group.node):  # this backward computes the weight's gradient
            group.xs.append(x)
            group.grads.append(grad)
        return (grad @ weight if ctx.needs_input_grad[0] else None), None, None, None


class GroupedLinear:
    """``F.linear(x, weight, bias)`` for every ``x`` it is called with, the weight's and bias's gradients each
    computed by one GEMM / sum over all calls' rows in backward (module docstring). Make one per forward."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        self.xs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.has_bias = bias is not None
        self.weight, self.bias = _Root.apply(self, weight, bias)
        self.node = self.weight.grad_fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Use.apply(x, self.weight, self.bias, self)

    def _reduce(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The weight's and bias's gradients from the uses handed over, which are then dropped."""
        xs, grads = self.xs, self.grads
        self.xs, self.grads = [], []
        if not xs:
            return None, None
        rows = [g.reshape(-1, g.shape[-1]) for g in grads]
        dy = rows[0] if len(rows) == 1 else torch.cat(rows)
        inputs = [x.reshape(-1, x.shape[-1]) for x in xs]
        x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        return dy.t() @ x, (dy.sum(0) if self.has_bias else None)


# MEMTRAIN_GROUPED_WGRAD=0 leaves every gradient to autograd's per-use sums (grouped_linear and fan_out are then
# plain): a switch for comparing the two on a GPU (tools/gpu_check.py, recipe_170m_mac_ungrouped), and a way back
# should grouping misbehave there.
GROUPED_ENV = switches.GROUPED_WGRAD


class _FanOut(torch.autograd.Function):
    """``n`` aliases of ``x``; backward: the sum of their gradients (those autograd delivers) in one op."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        ctx.set_materialize_grads(False)  # an alias the loss does not reach adds nothing (no zeros made for it)
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        grads = [g for g in grads if g is not None]
        if not grads:
            return None, None
        return (grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)), None


def _applies(x: torch.Tensor, enabled: bool) -> bool:
    return (enabled and torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled(x.device.type) and switches.flag(GROUPED_ENV))


def fan_out(x: torch.Tensor, n: int, enabled: bool = True) -> tuple[torch.Tensor, ...]:
    """``n`` tensors equal to ``x`` for ``n`` uses, whose gradients reach ``x`` as one sum (module docstring) where
    it applies (as :func:`grouped_linear`: ``enabled``, eager, gradients on, autocast off, ``x`` needs its gradient,
    ``MEMTRAIN_GROUPED_WGRAD`` not ``0``), else ``x`` itself ``n`` times."""
    if n > 1 and _applies(x, enabled):
        return _FanOut.apply(x, n)
    return (x,) * n


def grouped_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   enabled: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A :class:`GroupedLinear` where it applies (``enabled``, eager, gradients on, autocast off, a weight that
    needs its gradient, ``MEMTRAIN_GROUPED_WGRAD`` not ``0``), else ``F.linear`` with these arguments: the same
    function either way."""
    if _applies(weight, enabled):
        return GroupedLinear(weight, bias)
    return lambda x: F.linear(x, weight, bias)


__all__ = ["GROUPED_ENV", "GroupedLinear", "fan_out", "grouped_linear"]
