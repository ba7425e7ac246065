"""memtrain's custom operators: one opaque node where a graph is traced, one ``torch.autograd.Function`` eagerly.

Why. Every Triton kernel pair of :mod:`memtrain.kernels` is a ``torch.library.custom_op`` with a registered
backward, so that Dynamo and AOTAutograd take it as one node of a compiled graph (compiled Titans blocks keep the
scan, the prologue, the read and the output stage inside their graph). Eagerly that costs the host time of the
dispatcher's round trip through Python: the op's autograd wrapper, filling its defaults, the redispatch below
autograd and the alias checks, and again for the backward operator. Measured on the 2-core CPU used for
development: 90 µs per forward and backward of a trivial custom operator against 41 µs for the same
``torch.autograd.Function`` (the difference, about 49 µs, is the dispatcher's). Eager ``titans-170m-mac`` calls
720 operator pairs per micro-batch (12 blocks x 8 segments: the q/k/v and gates prologue, the coefficients, the
scan, the read and its output stage, RoPE), 35 ms of host time per micro-batch there, and MAC's GPU idles where
the host falls behind (the README's Titans kernels section).

How. :func:`kernel_op` defines the operator exactly as ``torch.library.custom_op`` does and returns a
:class:`KernelOp`: ``register_fake`` and ``register_autograd`` register on the operator, and the autograd set-up
and backward are also the methods of an ``autograd.Function`` whose forward calls the operator's own Python
implementation. A call takes that Function (or, for an operator without autograd, the implementation itself)
where nothing traces: not while Dynamo compiles, no ``TorchDispatchMode`` active (fake tensors, AOTAutograd,
``benchmarks/op_count.py``'s counter), no functorch transform, and every tensor argument a plain tensor or
parameter. Anywhere else it calls the operator. Both paths run the same implementation, set-up and backward, so
they compute the same, bit for bit (tests/test_kernel_op.py checks every operator). ``.op`` is the operator
itself (``torch.library.opcheck`` takes it). ``MEMTRAIN_KERNEL_OPS=dispatch`` sends every call through the
dispatcher (read when the call is made; for comparing the two; another value than ``eager`` is refused before a run
starts, :func:`requested_mode`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

# MEMTRAIN_KERNEL_OPS=dispatch: every call of a KernelOp goes through torch's dispatcher, as a plain custom operator
# (a switch for measuring the eager path's saving, and a way back should it misbehave); eager (or unset): the eager
# path where it applies.
DISPATCH_ENV = "MEMTRAIN_KERNEL_OPS"
DISPATCH_MODES = ("eager", "dispatch")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
OPS: dict[str, "KernelOp"] = {}  # every KernelOp by its operator's name (tests/test_kernel_op.py covers each)


def requested_mode() -> str:
    """The path :data:`DISPATCH_ENV` asks for (``eager`` where it is unset); ValueError (one line) for another value.
    The trainer checks it before a run starts (``memtrain.launcher.train.check_kernels``) and a Titans memory when
    it is built, so a mistyped value stops a run rather than being read as ``eager``."""
    mode = os.environ.get(DISPATCH_ENV, "") or "eager"
    if mode not in DISPATCH_MODES:
        raise ValueError(f"{DISPATCH_ENV}={mode!r}: expected one of {', '.join(DISPATCH_MODES)} (or unset it)")
    return mode


def eager(args: tuple) -> bool:
    """Whether a call with ``args`` may skip the dispatcher: nothing is tracing it (Dynamo, a dispatch mode such as
    fake tensors or AOTAutograd's, a functorch transform) and every tensor argument is a plain tensor."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    return os.environ.get(DISPATCH_ENV) != "dispatch"


class KernelOp:
    """A custom operator (``.op``) whose eager calls take an ``autograd.Function`` instead of the dispatcher
    (module docstring). Call it with positional arguments, as the operator."""

    def __init__(self, name: str, fn: Callable[..., Any]):
        self.name, self.fn = name, fn
        self.op = torch.library.custom_op(name, fn, mutates_args=())
        params = list(inspect.signature(fn).parameters.values())
        self._arity = len(params)
        self._defaults = tuple(p.default for p in params if p.default is not inspect.Parameter.empty)
        self._function: type[torch.autograd.Function] | None = None
        OPS[name] = self

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fake)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """``torch.library.register_autograd``'s contract: ``setup_context(ctx, inputs, output)`` after the forward,
        ``backward(ctx, *grads)`` returns one gradient (or None) per input."""
        self.op.register_autograd(backward, setup_context=setup_context)
        fn = self.fn

        def forward(ctx, *args):
            out = fn(*args)
            setup_context(ctx, args, out)
            return out

        name = self.name.split("::")[-1]
        self._function = type(f"{name}_eager", (torch.autograd.Function,),
                              {"forward": staticmethod(forward), "backward": staticmethod(backward),
                               "__module__": fn.__module__})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not eager(args):
            return self.op(*args, **kwargs)
        if len(args) < self._arity:  # the operator fills trailing defaults before its autograd set-up sees them
            args = args + self._defaults[len(args) - self._arity:]
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if self._function is None:  # no autograd: the operator says so when its output is differentiated
                return self.op(*args)
            return self._function.apply(*args)
        return self.fn(*args)


def kernel_op(name: str) -> Callable[[Callable[..., Any]], KernelOp]:
    """``@torch.library.custom_op(name, mutates_args=())`` with the eager path of :class:`KernelOp`."""
    return lambda fn: KernelOp(name, fn)


__all__ = ["DISPATCH_ENV", "DISPATCH_MODES", "KernelOp", "OPS", "eager", "kernel_op", "requested_mode"]
