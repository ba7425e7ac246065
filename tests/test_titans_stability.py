"""Titans inner-loop stability (issue 11, item 3): titans-400m-mag gave loss nan / grad inf from outer step 4
(lr 4e-4, warmup 2 steps, bf16 and fp32 alike).

Cause (memtrain/model/titans/memory.py, "Stability"): the depth-2 memory's inner loop ran away -- one head
of block 13 went from weights ~8 to 1e9 in 22 chunks and to inf, float64 included -- because nothing bounded
its effective step ``theta * chunk / (1 - eta)`` nor the value norm ``|v|`` its curvature grows with. Four
AdamW steps had moved the block's largest head-mean eta from 0.91 to 0.975 and |v| from 3.2 to 4.7; the MAG memory writes the
unit-RMS ``norm1(x)`` stream (tokens with pairwise cosine ~0.9), so its per-chunk gradients add up.

These tests run the memory of each shipped paper-scale recipe (its own ``model.titans`` settings) on such a
stream, 4096 tokens (the recipes' length), at gates the outer loop can reach: they failed (NaN) before the
fix (values unnormalised, eta unbounded) and pass after it.
"""

from __future__ import annotations

import math

import pytest
import torch

from memtrain.config import load_recipe
from memtrain.model.titans.arch import make_memory

RECIPES = ["titans-170m-mac", "titans-340m-mac", "titans-400m-mag", "titans-760m-mal"]
T = 4096


def _memory(name: str):
    r = load_recipe(f"recipes/{name}.yaml")
    torch.manual_seed(0)
    return make_memory(r.model, r.model.titans), r.model.d_model


def _stream(d: int, common: float = 3.0, seed: int = 0) -> torch.Tensor:
    """``[1, T, d]`` unit-RMS rows sharing one direction (pairwise cosine ~0.9), like ``norm1(x)`` in a
    trained-for-a-few-steps MAG block (0.88 measured at block 13 of the failing run)."""
    g = torch.Generator().manual_seed(seed)
    x = common * torch.randn(d, generator=g) + torch.randn(T, d, generator=g)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).unsqueeze(0)


def _set_gates(mem, lr: float, eta: float, forget: float) -> None:
    """Constant gates: ``to_gates`` weight 0 and biases giving pre-activations ``lr, eta, forget``."""
    with torch.no_grad():
        mem.to_gates.weight.zero_()
        b = mem.to_gates.bias.view(3, mem.heads)
        b[0].fill_(lr)
        b[1].fill_(eta)
        b[2].fill_(forget)


def _run(mem, x):
    with torch.no_grad():
        y, state = mem(x)
    return y, max(w.norm(dim=(-2, -1)).max().item() for w in state.weights)


@pytest.mark.parametrize("name", RECIPES)
def test_inner_loop_stable_with_saturated_gates(name):
    """theta -> max_lr, eta -> its upper bound, alpha = sigmoid(-6) = 0.25%: the worst gates the outer loop can
    learn. Before the fix eta -> 0.9975 and the weights ran to NaN within ~16 chunks; with eta <= 0.95 and
    unit values they settle (Frobenius norm < 10 per head matrix)."""
    mem, d = _memory(name)
    _set_gates(mem, lr=6.0, eta=6.0, forget=-6.0)
    y, weight_norm = _run(mem, _stream(d))
    assert torch.isfinite(y).all(), f"{name}: memory output not finite (inner loop diverged)"
    assert weight_norm < 10, f"{name}: memory weights grew to Frobenius norm {weight_norm:.3g}"


@pytest.mark.parametrize("name", ["titans-400m-mag"])
def test_inner_loop_stability_does_not_depend_on_value_scale(name):
    """The outer loop can scale W_V freely (the per-head output RMSNorm hides the retrieval's scale): at the
    gates the failing run had reached (theta 0.002, eta 0.95, alpha 0.25%), value projections 4x larger made the
    unnormalised memory diverge; normalised values make the value scale irrelevant."""
    mem, d = _memory(name)
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    _set_gates(mem, lr=logit(0.002 / mem.max_lr), eta=logit(0.95 / mem.max_momentum * 0.9999), forget=logit(0.0025))
    with torch.no_grad():
        mem.to_qkv.weight[2 * mem.inner:] *= 4.0
    y, weight_norm = _run(mem, _stream(d))
    assert torch.isfinite(y).all(), "memory output not finite with 4x value projections (inner loop diverged)"
    assert weight_norm < 10, f"memory weights grew to Frobenius norm {weight_norm:.3g}"


def test_recipes_turn_the_stability_settings_on():
    """The shipped Titans recipes run with normalised values and bounded momentum (the defaults), and the
    bound keeps the effective inner step max_lr * chunk / (1 - max_momentum) at or below 1."""
    for name in RECIPES + ["titans-cpu-lmm", "titans-cpu-mac", "titans-cpu-mag", "titans-cpu-mal"]:
        t = load_recipe(f"recipes/{name}.yaml").model.titans
        assert t.memory_value_norm and t.memory_max_momentum < 1, name
        assert t.memory_max_lr * t.memory_chunk_size / (1 - t.memory_max_momentum) <= 1.0, name
