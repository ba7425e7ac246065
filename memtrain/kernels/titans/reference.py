"""The Titans inner loop in PyTorch: the reference (and the fallback) of the Triton kernels in
:mod:`.triton_kernels`. The math (Titans, Sections 3.1-3.2; eqs. 13-16) is documented in
:mod:`memtrain.model.titans.inner_loop`, which wraps these functions with the carried ``MemoryState``.

Tensors here are flattened over batch and heads: ``q``, ``k``, ``v`` ``[N, T, head_dim]``; gates
``lr`` (theta), ``log_eta`` and ``log_keep`` (log(1 - alpha)) ``[N, T]``; per memory layer l the weights
``w[l]``, momentum ``s[l]`` and chunk-start weights ``wg[l]`` ``[N, d_out, d_in]``.

- :func:`scan` runs ``"sequential"`` (a per-token loop applying the recurrences literally) or
  ``"chunked"`` (Section 3.2's mini-batch form as masked matrix products per chunk); same result.
- :func:`chunk_coefficients` gives the per-chunk recurrence coefficients the kernels take as inputs
  (so their gradients reach the gates through autograd).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

ALGORITHMS = ("chunked", "sequential")

Weights = Sequence[torch.Tensor]


# --------------------------------------------------------------------------------------------------
# The memory MLP: forward, and per-token gradients by hand


def mlp_forward(weights: Weights, x: torch.Tensor) -> torch.Tensor:
    """``M(x)`` for weights ``[..., d_out, d_in]`` per layer and inputs ``[..., n, d_in]``."""
    h = x
    for i, w in enumerate(weights):
        h = h @ w.transpose(-1, -2)
        if i < len(weights) - 1:
            h = F.silu(h)
    return h


def mlp_grads(weights: Weights, k: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token gradients of ``||M(k_i) - v_i||^2`` in factored form.

    Returns ``(acts, deltas)``: for layer l, ``acts[l]`` ``[..., n, d_in_l]`` is the layer's input
    for each key and ``deltas[l]`` ``[..., n, d_out_l]`` the loss gradient w.r.t. its pre-activation;
    the gradient of token i w.r.t. ``weights[l]`` is the outer product ``deltas[l][i] acts[l][i]^T``.
    """
    acts, sigmoids = [k], []
    h = k
    for i, w in enumerate(weights):
        z = h @ w.transpose(-1, -2)
        if i < len(weights) - 1:
            s = torch.sigmoid(z)
            h = z * s  # silu(z)
            sigmoids.append(s)
            acts.append(h)
        else:
            h = z
    delta = 2 * (h - v)
    deltas = [delta]
    for i in range(len(weights) - 2, -1, -1):
        s, a = sigmoids[i], acts[i + 1]
        delta = (delta @ weights[i + 1]) * (s + a * (1 - s))  # silu'(z) = s + z s (1 - s)
        deltas.append(delta)
    deltas.reverse()
    return acts, deltas


# --------------------------------------------------------------------------------------------------
# Chunk coefficients in log space


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = sum_{s < j <= t} x[..., j]`` for ``s <= t``, ``-inf`` above the diagonal."""
    n = x.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
    xs = x.unsqueeze(-1).expand(*x.shape, n).masked_fill(ones.triu(), 0.0)  # [.., j, s] = x_j if j > s
    out = xs.cumsum(-2)
    return out.masked_fill(ones.triu(1), float("-inf"))


class Coefficients(NamedTuple):
    decay: torch.Tensor  # [..., n]     B_t: weight of M0 in M_t
    carry: torch.Tensor  # [..., n]     f_t: weight of S0 in M_t
    mix: torch.Tensor  # [..., n, n]    c_{t,i}: weight of -u_i in M_t (lower triangular)
    momentum_decay_end: torch.Tensor  # [...]   E_n: weight of S0 in S_n
    momentum_mix_end: torch.Tensor  # [..., n]  theta_i E_n / E_i: weight of -u_i in S_n


def chunk_coefficients(lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor) -> Coefficients:
    """Recurrence coefficients of one chunk segment (gates ``[..., n]``, n tokens from its start)."""
    keep_ratio = torch.exp(_segsum(log_keep))  # B_t / B_s, s <= t
    eta_ratio = torch.exp(_segsum(log_eta))  # E_s / E_i, i <= s
    cum_eta = log_eta.cumsum(-1)
    decay = log_keep.cumsum(-1).exp()
    carry = (keep_ratio @ cum_eta.exp().unsqueeze(-1)).squeeze(-1)
    mix = (keep_ratio @ eta_ratio) * lr.unsqueeze(-2)
    return Coefficients(decay, carry, mix, cum_eta[..., -1].exp(), eta_ratio[..., -1, :] * lr)


def _index(c: Coefficients, j: int) -> Coefficients:
    return Coefficients(*(t[:, j] for t in c))


# --------------------------------------------------------------------------------------------------
# The two algorithms (flattened batch*heads leading dimension)


def _chunk_step(q, k, v, w0, s0, wg, c: Coefficients):
    """One chunk segment: outputs at every position, and weights/momentum at its end."""
    acts, deltas = mlp_grads(wg, k, v)
    decay, carry = c.decay.unsqueeze(-1), c.carry.unsqueeze(-1)
    h = q
    depth = len(w0)
    for l in range(depth):
        # z_t = B_t W0 h_t + f_t S0 h_t - sum_{i<=t} c_{t,i} d_i (a_i . h_t)
        z = torch.bmm(h * decay, w0[l].transpose(-1, -2))
        z = torch.baddbmm(z, h * carry, s0[l].transpose(-1, -2))
        z = torch.baddbmm(z, c.mix * torch.bmm(h, acts[l].transpose(-1, -2)), deltas[l], alpha=-1)
        h = F.silu(z) if l < depth - 1 else z
    decay_end, carry_end = c.decay[:, -1, None, None], c.carry[:, -1, None, None]
    mix_end, eta_end = c.mix[:, -1, :, None], c.momentum_decay_end[:, None, None]
    mom_mix_end = c.momentum_mix_end.unsqueeze(-1)
    w_new, s_new = [], []
    for l in range(depth):
        d_t = deltas[l].transpose(-1, -2)
        w_new.append(torch.baddbmm(decay_end * w0[l] + carry_end * s0[l], d_t, mix_end * acts[l], alpha=-1))
        s_new.append(torch.baddbmm(eta_end * s0[l], d_t, mom_mix_end * acts[l], alpha=-1))
    return h, w_new, s_new


def _segments(pos: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(start, size)`` pieces of ``[0, length)`` cut at absolute multiples of ``chunk_size``."""
    out, t = [], 0
    while t < length:
        n = min(chunk_size - (pos + t) % chunk_size, length - t)
        out.append((t, n))
        t += n
    return out


def _chunked(q, k, v, lr, log_eta, log_keep, w, s, wg, pos: int, chunk_size: int):
    segments = _segments(pos, q.shape[1], chunk_size)
    # Coefficients of all full chunks at once (they are contiguous); partial ones on their own.
    full = [i for i, (_, n) in enumerate(segments) if n == chunk_size]
    batched = None
    if full:
        a, b = segments[full[0]][0], segments[full[-1]][0] + chunk_size
        shape = (lr.shape[0], len(full), chunk_size)
        batched = chunk_coefficients(lr[:, a:b].reshape(shape), log_eta[:, a:b].reshape(shape),
                                log_keep[:, a:b].reshape(shape))
    ys = []
    for i, (t, n) in enumerate(segments):
        if (pos + t) % chunk_size == 0:
            wg = w
        sl = slice(t, t + n)
        coef = (_index(batched, i - full[0]) if n == chunk_size
                else chunk_coefficients(lr[:, sl], log_eta[:, sl], log_keep[:, sl]))
        y, w, s = _chunk_step(q[:, sl], k[:, sl], v[:, sl], w, s, wg, coef)
        ys.append(y)
    return torch.cat(ys, dim=1), w, s, wg


def _sequential(q, k, v, lr, log_eta, log_keep, w, s, wg, pos: int, chunk_size: int):
    eta, keep = log_eta.exp(), log_keep.exp()
    w, s = list(w), list(s)
    ys = []
    for t in range(q.shape[1]):
        if (pos + t) % chunk_size == 0:
            wg = list(w)  # M_{t'}: gradients of this chunk's tokens are taken here
        acts, deltas = mlp_grads(wg, k[:, t:t + 1], v[:, t:t + 1])
        for l in range(len(w)):
            u = deltas[l].transpose(-1, -2) @ acts[l]  # [N, d_out, d_in]
            s[l] = eta[:, t, None, None] * s[l] - lr[:, t, None, None] * u
            w[l] = keep[:, t, None, None] * w[l] + s[l]
        ys.append(mlp_forward(w, q[:, t:t + 1]))  # y_t = M_t(q_t): after token t's update
    return torch.cat(ys, dim=1), w, s, wg


def scan(q, k, v, lr, log_eta, log_keep, w, s, wg, pos: int, chunk_size: int, algorithm: str = "chunked"):
    """``(y, w, s, wg)`` after running the inner loop over ``T`` tokens starting at absolute position
    ``pos`` (chunks aligned to multiples of ``chunk_size``); see the module docstring for shapes."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    run = _chunked if algorithm == "chunked" else _sequential
    return run(q, k, v, lr, log_eta, log_keep, w, s, wg, pos, chunk_size)


__all__ = ["ALGORITHMS", "Coefficients", "chunk_coefficients", "mlp_forward", "mlp_grads", "scan"]
