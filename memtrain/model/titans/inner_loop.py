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

Where it runs: the algorithms live in :mod:`memtrain.kernels.titans` -- the PyTorch forms above in
``reference`` and the fused Triton kernels (forward and backward, the loop over chunks inside the
kernel) in ``triton_kernels`` (depth 1-2) and ``triton_deep`` (depth 3+). ``kernel`` picks: ``"auto"`` runs
the Triton kernels for ``"chunked"`` on bf16 / fp16 CUDA tensors and the PyTorch chunked form elsewhere;
``"triton"`` forces the kernels (on CPU only under ``TRITON_INTERPRET=1``); ``"torch"`` the PyTorch form.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from memtrain.kernels import titans as titans_kernels
from memtrain.kernels.titans.reference import ALGORITHMS, mlp_forward, mlp_grads
from memtrain.model.titans.state import MemoryState


def memory_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lr: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor,
    state: MemoryState, chunk_size: int, algorithm: str = "chunked", kernel: str = "torch",
) -> tuple[torch.Tensor, MemoryState]:
    """Run the inner loop over a sequence; return ``(y, new_state)``.

    ``q``, ``k``, ``v``: ``[B, H, T, head_dim]``; ``lr`` (theta > 0), ``log_eta`` (log of the momentum
    decay eta), ``log_keep`` (log of 1 - alpha): ``[B, H, T]``. ``state`` supplies ``weights``,
    ``momentum``, ``chunk_weights`` and ``pos``; other fields are passed through unchanged.
    ``y`` is ``[B, H, T, head_dim]`` with ``y_t = M_t(q_t)``. ``algorithm`` picks ``"chunked"``
    (fast) or ``"sequential"`` (reference); both give the same result. ``kernel`` (``auto``, ``triton``,
    ``torch``) picks where ``"chunked"`` runs (see the module docstring).
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
    y, w, s, wg = titans_kernels.scan(flat(q), flat(k), flat(v), flat(lr), flat(log_eta), flat(log_keep),
                                      w, s, wg, state.pos, chunk_size, algorithm=algorithm, kernel=kernel)
    weights = unflat(w)
    end = state.pos + T
    chunk_weights = weights if end % chunk_size == 0 else unflat(wg)
    new_state = replace(state, weights=weights, momentum=unflat(s), chunk_weights=chunk_weights, pos=end)
    return y.reshape(B, H, T, -1), new_state


__all__ = ["ALGORITHMS", "memory_scan", "mlp_forward", "mlp_grads"]
