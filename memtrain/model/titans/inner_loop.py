"""The Titans inner loop: test-time training of the memory MLP (Titans Sections 3.1-3.2).

Per batch element and head, the memory M is an MLP of depth L >= 1 without biases,
``M(x) = W_L silu(... silu(W_1 x))`` (L = 1: ``M(x) = W_1 x``), trained online on the associative
loss ``l(M; x_t) = ||M(k_t) - v_t||^2`` (a sum, so the gradient carries the factor 2) with
data-dependent learning rate theta_t, momentum decay eta_t and forgetting alpha_t:

    u_t = grad_M l(M_{t'}; x_t)          t' = start of t's chunk (chunk size 1: fully online)
    S_t = eta_t S_{t-1} - theta_t u_t    (surprise with momentum, eq. 14 / 18)
    M_t = (1 - alpha_t) M_{t-1} + S_t    (forgetting, eq. 13)
    y_t = M_t(q_t)                       (retrieval, eq. 15)

Retrieval timing: ``y_t`` reads the weights *after* token t's update (M_t, not M_{t-1}), as in the
paper's eq. 15 / Figure 1 and the linear-attention view ``y_t = Q_t M_t`` (Section 2). So the token's
own key/value pair is already (partly) stored when it is read; reading the memory "as it was before"
is :func:`mlp_forward` on the state's weights (``NeuralMemory.retrieve``).

Chunk boundaries are aligned to absolute positions (multiples of ``chunk_size`` counted from the
state's ``pos``), so splitting a sequence at any point and carrying the state gives the same result
as one pass. Gates arrive in log space (``log_eta = log eta``, ``log_keep = log(1 - alpha)``) so that
decays very close to 0 never need a division.

:func:`memory_scan` runs one of two algorithms with the same signature and the same result:

- ``"sequential"``: the reference, a Python loop over tokens applying the recurrences literally
  (per-token gradients at the chunk-start weights, per-token weight matrices).
- ``"chunked"``: Section 3.2's mini-batch form. Per chunk, all u_i come from one batched forward and
  a hand-written backward at M_{t'} (activations a_i^(l-1), deltas d_i^(l), u_i^(l) = d_i^(l) a_i^(l-1)^T
  never materialised). With B_t the running product of (1 - alpha) and E_t that of eta inside the
  chunk (from its start), and (M0, S0) the state entering the chunk,

      S_t = E_t S0 - sum_{i<=t} theta_i (E_t / E_i) u_i
      M_t = B_t M0 + f_t S0 - sum_{i<=t} c_{t,i} u_i
      f_t = sum_{s<=t} (B_t / B_s) E_s,   c_{t,i} = theta_i sum_{i<=s<=t} (B_t / B_s)(E_s / E_i)

  All ratios are ``exp`` of segment sums of log gates (masked, lower-triangular, computed by a
  cumulative sum over a masked matrix so no large cumulative logs are subtracted), never a division
  by a product that can underflow. Outputs are computed layer by layer as masked matrix products:
  ``z_t = B_t W0 h_t + f_t S0 h_t - sum_{i<=t} c_{t,i} d_i (a_i . h_t)``, i.e.
  ``Z = B*(H W0^T) + f*(H S0^T) - (C o (H A^T)) D`` -- no per-token weights. Only the chunk-end
  weights and momentum are materialised and carried to the next chunk.

The whole loop is differentiable by autograd (outer-loop training of the projections, gates and
initial weights).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from memtrain.model.titans.state import MemoryState

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
    keep_below = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    xs = x.unsqueeze(-1).expand(*x.shape, n).masked_fill(~keep_below, 0.0)  # [.., j, s] = x_j if j > s
    out = xs.cumsum(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    return out.masked_fill(~causal, float("-inf"))


class _Coefficients(NamedTuple):
    decay: torch.Tensor  # [..., n]     B_t: weight of M0 in M_t
    carry: torch.Tensor  # [..., n]     f_t: weight of S0 in M_t
    mix: torch.Tensor  # [..., n, n]    c_{t,i}: weight of -u_i in M_t (lower triangular)
    momentum_decay_end: torch.Tensor  # [...]   E_n: weight of S0 in S_n
    momentum_mix_end: torch.Tensor  # [..., n]  theta_i E_n / E_i: weight of -u_i in S_n


def _coefficients(lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor) -> _Coefficients:
    """Recurrence coefficients of one chunk segment (gates ``[..., n]``, n tokens from its start)."""
    keep_ratio = torch.exp(_segsum(log_keep))  # B_t / B_s, s <= t
    eta_ratio = torch.exp(_segsum(log_eta))  # E_s / E_i, i <= s
    cum_eta = log_eta.cumsum(-1)
    decay = log_keep.cumsum(-1).exp()
    carry = (keep_ratio @ cum_eta.exp().unsqueeze(-1)).squeeze(-1)
    mix = (keep_ratio @ eta_ratio) * lr.unsqueeze(-2)
    return _Coefficients(decay, carry, mix, cum_eta[..., -1].exp(), eta_ratio[..., -1, :] * lr)


def _index(c: _Coefficients, j: int) -> _Coefficients:
    return _Coefficients(*(t[:, j] for t in c))


# --------------------------------------------------------------------------------------------------
# The two algorithms (flattened batch*heads leading dimension)


def _chunk_step(q, k, v, w0, s0, wg, c: _Coefficients):
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
        batched = _coefficients(lr[:, a:b].reshape(shape), log_eta[:, a:b].reshape(shape),
                                log_keep[:, a:b].reshape(shape))
    ys = []
    for i, (t, n) in enumerate(segments):
        if (pos + t) % chunk_size == 0:
            wg = w
        sl = slice(t, t + n)
        coef = (_index(batched, i - full[0]) if n == chunk_size
                else _coefficients(lr[:, sl], log_eta[:, sl], log_keep[:, sl]))
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


# --------------------------------------------------------------------------------------------------
# Public entry point


def memory_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor,
    state: MemoryState, chunk_size: int, algorithm: str = "chunked",
) -> tuple[torch.Tensor, MemoryState]:
    """Run the inner loop over a sequence; return ``(y, new_state)``.

    ``q``, ``k``, ``v``: ``[B, H, T, head_dim]``; ``lr`` (theta > 0), ``log_eta`` (log of the momentum
    decay eta), ``log_keep`` (log of 1 - alpha): ``[B, H, T]``. ``state`` supplies ``weights``,
    ``momentum``, ``chunk_weights`` and ``pos``; other fields are passed through unchanged.
    ``y`` is ``[B, H, T, head_dim]`` with ``y_t = M_t(q_t)``. ``algorithm`` picks ``"chunked"``
    (fast) or ``"sequential"`` (reference); both give the same result.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, H, T, _ = q.shape
    if T == 0:
        return q.new_zeros(B, H, 0, state.weights[-1].shape[-2]), state

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B * H, *x.shape[2:])

    def unflat(ws) -> tuple[torch.Tensor, ...]:
        return tuple(x.reshape(B, H, *x.shape[1:]) for x in ws)

    w = [flat(x) for x in state.weights]
    s = [flat(x) for x in state.momentum]
    aligned = all(c is x for c, x in zip(state.chunk_weights, state.weights))
    wg = w if aligned else [flat(x) for x in state.chunk_weights]
    run = _chunked if algorithm == "chunked" else _sequential
    y, w, s, wg = run(flat(q), flat(k), flat(v), flat(lr), flat(log_eta), flat(log_keep), w, s, wg,
                      state.pos, chunk_size)
    weights = unflat(w)
    end = state.pos + T
    chunk_weights = weights if end % chunk_size == 0 else unflat(wg)
    new_state = replace(state, weights=weights, momentum=unflat(s), chunk_weights=chunk_weights, pos=end)
    return y.reshape(B, H, T, -1), new_state


__all__ = ["ALGORITHMS", "memory_scan", "mlp_forward", "mlp_grads"]
