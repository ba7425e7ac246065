"""The routed-attention Triton kernels (memtrain.kernels.routed_attention) against their float64 PyTorch
reference: sequence-level and token-level chapter routing, outputs and every input gradient (queries, the
chapters' keys and values, the routing log weights), at small odd shapes that cross the kernels' block
boundaries; chapters chosen by no one (exactly zero gradient), by everyone, and picked twice; output
buffers poisoned with NaN before the call; deterministic backward; the dispatch and the recipe key.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton); on a GPU the same tests run compiled, and a bf16 test runs
too (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from memtrain.config import recipe_from_dict
from memtrain.errors import MemtrainError
from memtrain.kernels import routed_attention as ra
from memtrain.kernels.routed_attention import reference as ref
from memtrain.kernels.routed_attention import triton_kernels as tk

CUDA = torch.cuda.is_available()

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = 1e-4  # fp32 kernel vs float64 reference: max abs error / max abs value


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300))


def leaves(shapes, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_() for s in shapes]


def log_weights(n: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).log_softmax(-1).to(DEVICE, dtype).requires_grad_()


def run(fn, inputs, slots, grad_seed: int = 9):
    """Output and the gradients of every input for a fixed random output gradient."""
    *xs, lw = inputs
    out = fn(*xs, slots, lw)
    g = torch.Generator().manual_seed(grad_seed)
    go = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return out.detach(), torch.autograd.grad(out, inputs, go)


def against_float64(kernel, reference, inputs, slots):
    out, grads = run(kernel, inputs, slots)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    want, want_grads = run(reference, ref_inputs, slots)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < TOL
    for name, got_g, want_g in zip(("q", "keys", "values", "log_w"), grads, want_grads):
        assert torch.isfinite(got_g).all(), name
        assert rel_err(got_g, want_g) < TOL, (name, rel_err(got_g, want_g))
    return grads


# (B, T, H, D, U, Nc, slots): T and N_c cross the 64-row / 64-key blocks; D is not a power of two.
SEQUENCE_CASES = {
    "odd": (2, 19, 2, 12, 5, 21, [[0, 3, 4], [3, 1, 0]]),  # chapter 2 chosen by no one, 0 and 3 by both
    "blocks": (1, 70, 1, 16, 3, 65, [[2, 0]]),  # two query blocks, two key tiles; chapter 1 unused
    "duplicates": (3, 5, 3, 7, 4, 9, [[1, 1, 2, 0], [1, 3, 3, 3], [0, 1, 2, 3]]),  # picks repeated in a sequence
}


@pytest.mark.parametrize("case", list(SEQUENCE_CASES))
def test_kernel_sequence_routed_attention_matches_float64_reference(case):
    B, T, H, D, U, Nc, picks = SEQUENCE_CASES[case]
    slots = torch.tensor(picks, device=DEVICE)
    k = slots.shape[1]
    inputs = [*leaves([(B, T, H, D), (U, Nc, H, D), (U, Nc, H, D)], seed=len(case)), log_weights(B, k, seed=2)]
    _, d_keys, d_values, _ = against_float64(tk.sequence_routed_attention, ref.sequence_routed_attention,
                                             inputs, slots)
    unused = sorted(set(range(U)) - set(slots.flatten().tolist()))
    for c in range(U):  # the bank gradient: exactly zero for chapters no one chose, non-zero otherwise
        assert bool((d_keys[c] == 0).all()) == (c in unused)
        assert bool((d_values[c] == 0).all()) == (c in unused)


# (N, H, D, U, Nc, slots per token): one chapter read by every token, one by none, duplicate picks.
def token_slots(N: int, k: int, U: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rest = torch.stack([torch.randperm(U - 2, generator=g)[:k - 1] + 1 for _ in range(N)])  # chapters 1..U-2
    slots = torch.cat([torch.zeros(N, 1, dtype=torch.long), rest], dim=1)  # chapter 0: every token; U-1: none
    slots[0, 1] = 0  # token 0 picks chapter 0 twice
    return slots.to(DEVICE)


@pytest.mark.parametrize("N,H,D,U,Nc,k", [(23, 2, 12, 6, 21, 3), (70, 1, 16, 4, 65, 2), (9, 3, 5, 5, 7, 4)])
def test_kernel_token_routed_attention_matches_float64_reference(N, H, D, U, Nc, k):
    slots = token_slots(N, k, U, seed=N)
    inputs = [*leaves([(N, H, D), (U, Nc, H, D), (U, Nc, H, D)], seed=N + 1), log_weights(N, k, seed=3)]
    _, d_keys, d_values, _ = against_float64(tk.token_routed_attention, ref.token_routed_attention, inputs, slots)
    assert bool((d_keys[U - 1] == 0).all()) and bool((d_values[U - 1] == 0).all())  # chosen by no one
    assert bool((d_keys[0] != 0).any()) and bool((d_values[0] != 0).any())


def test_kernel_outputs_poisoned_before_the_call_are_fully_written(monkeypatch):
    """Every buffer the kernels fill (outputs, log-sum-exps, dQ) starts as NaN: the results are unchanged."""
    B, T, H, D, U, Nc, picks = SEQUENCE_CASES["odd"]
    slots = torch.tensor(picks, device=DEVICE)
    inputs = [*leaves([(B, T, H, D), (U, Nc, H, D), (U, Nc, H, D)], seed=5), log_weights(B, 3, seed=6)]
    clean = run(tk.sequence_routed_attention, inputs, slots)
    tslots = token_slots(17, 2, U, seed=1)
    t_inputs = [*leaves([(17, H, D), (U, Nc, H, D), (U, Nc, H, D)], seed=7), log_weights(17, 2, seed=8)]
    t_clean = run(tk.token_routed_attention, t_inputs, tslots)
    monkeypatch.setattr(tk, "_empty", lambda *shape, **kw: torch.full(shape, float("nan"), **kw))
    for fn, ins, sl, (out, grads) in ((tk.sequence_routed_attention, inputs, slots, clean),
                                      (tk.token_routed_attention, t_inputs, tslots, t_clean)):
        p_out, p_grads = run(fn, ins, sl)
        assert torch.equal(p_out, out)
        assert all(torch.equal(a, b) for a, b in zip(p_grads, grads))


def test_kernel_backward_is_deterministic():
    """Two backward passes give bit-identical gradients (no atomics: one program per gradient element)."""
    N, H, D, U, Nc, k = 40, 2, 8, 3, 11, 2
    slots = token_slots(N, k, U, seed=4)
    inputs = [*leaves([(N, H, D), (U, Nc, H, D), (U, Nc, H, D)], seed=10), log_weights(N, k, seed=11)]
    first, second = run(tk.token_routed_attention, inputs, slots)[1], run(tk.token_routed_attention, inputs, slots)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_kernel_dispatch_picks_the_reference_off_cuda_unless_asked(monkeypatch):
    cpu = torch.zeros(1)
    assert ra.use_triton("torch", cpu) is False
    assert ra.use_triton("auto", cpu) is False  # CPU tensors: the reference
    with pytest.raises(ValueError, match="must be one of"):
        ra.use_triton("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        ra.use_triton("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ra.use_triton("triton", cpu) is True


@pytest.mark.parametrize("routing", ["sequence", "token"])
def test_kernel_in_the_crossattn_model_equals_the_reference_path(routing):
    """memory.crossattn.kernel triton vs torch in a model with routed memory layers: the same loss and the
    same gradient for every parameter (the bank, W_K, W_V, W_Q, W_O and the router included)."""
    from memtrain.model import build

    def model(kernel: str):
        r = recipe_from_dict({
            "model": {"vocab_size": 50, "d_model": 24, "n_layers": 2, "n_heads": 2, "ffn_dim": 48,
                      "max_seq_len": 32, "attention": "sdpa"},
            "data": {"seq_len": 32, "tokenizer": {"vocab_size": 50}},
            "memory": {"type": "crossattn", "crossattn": {"tokens": 60, "chapters": 6, "top_k": 2,
                                                          "routing": routing, "kernel": kernel}}})
        torch.manual_seed(0)
        m = build(r.model, r.memory).to(DEVICE)
        with torch.no_grad():
            for part in m.crossattn.parts.values():
                part.attn.wo.weight.normal_(std=0.2, generator=torch.Generator(DEVICE).manual_seed(1))
        return m

    x = torch.randint(0, 50, (3, 21), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for kernel in ("triton", "torch"):
        m = model(kernel)
        out = m(x)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
        loss = loss + out.aux_loss
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss_k, grads_k), (loss_t, grads_t) = results
    assert loss_k == pytest.approx(loss_t, rel=1e-6)
    assert grads_k.keys() == grads_t.keys() and any("router" in n for n in grads_k)
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kernel_recipe_key_forcing_triton_where_it_cannot_run_is_one_recipe_error(monkeypatch):
    from memtrain.launcher.train import check_kernels

    r = recipe_from_dict({"memory": {"type": "crossattn", "crossattn": {"tokens": 8, "chapters": 2, "top_k": 1,
                                                                         "kernel": "triton"}}})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(MemtrainError, match="memory.crossattn.kernel: .*TRITON_INTERPRET=1.*kernel: auto"):
        check_kernels(r, torch.device("cpu"))
    with pytest.raises(MemtrainError, match="memory.crossattn.kernel: must be one of"):
        recipe_from_dict({"memory": {"type": "crossattn", "crossattn": {"kernel": "cuda"}}})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sequence", "token"])
def test_kernel_bf16_on_gpu_is_within_bf16_rounding_of_float64(mode):
    """bf16 inputs, fp32 accumulation: outputs and gradients within bf16 tolerance of the float64 reference.
    With ``MEMTRAIN_GPU_TIER_ON_CPU=1`` the inputs are float16: the interpreter's bf16 dot products are wrong
    (outputs ~1e9 in Triton 3.8; 3.6 fails the same way), and float16 takes the same low-precision path."""
    half = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    if mode == "sequence":
        B, T, H, D, U, Nc = 2, 200, 4, 64, 8, 300
        slots = torch.tensor([[0, 3, 5, 7], [3, 1, 2, 6]], device=DEVICE)
        shapes, n = [(B, T, H, D), (U, Nc, H, D), (U, Nc, H, D)], B
        kernel, reference = tk.sequence_routed_attention, ref.sequence_routed_attention
    else:
        N, H, D, U, Nc = 300, 4, 64, 8, 300
        slots, shapes, n = token_slots(N, 4, U, seed=3), [(N, H, D), (U, Nc, H, D), (U, Nc, H, D)], N
        kernel, reference = tk.token_routed_attention, ref.token_routed_attention
    inputs = [*leaves(shapes, seed=1, dtype=half), log_weights(n, 4, seed=2)]
    out, grads = run(kernel, inputs, slots)
    want, want_grads = run(reference, [x.detach().double().requires_grad_() for x in inputs], slots)
    assert rel_err(out, want) < 2e-2
    for got_g, want_g in zip(grads, want_grads):
        assert rel_err(got_g, want_g) < 3e-2
