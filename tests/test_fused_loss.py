"""The chunked linear + cross-entropy (memtrain.model.loss) against F.cross_entropy of the full logits:
values and gradients of the hidden states, of a separate head and of a tied embedding, in float64 and
float32, with ignored tokens and a token count that is not a multiple of the chunk; and the models'
``labels=`` path (what the trainer calls) against the logits path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import ModelConfig, TitansConfig
from memtrain.model import build
from memtrain.model.loss import IGNORE_INDEX, linear_cross_entropy

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _inputs(dtype, n=37, d=12, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = IGNORE_INDEX
    y[-1] = IGNORE_INDEX
    return h, w, y


def _reference(h, w, y, reduction="sum"):
    logits = h @ w.t()
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y,
                           ignore_index=IGNORE_INDEX, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 8, 37, 4096])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_values_and_gradients_match_cross_entropy_of_the_full_logits(dtype, chunk, reduction):
    h, w, y = _inputs(dtype)  # 37 tokens: not a multiple of 8
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = linear_cross_entropy(h, w, y, chunk_tokens=chunk, reduction=reduction)
    ref = _reference(h2, w2, y, reduction)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])
    g = torch.linspace(0.5, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)  # per-token weights for "none"
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, **TOL[dtype])
    torch.testing.assert_close(w.grad, w2.grad, **TOL[dtype])
    assert h.grad[y == IGNORE_INDEX].abs().max() == 0  # ignored tokens get no gradient


def test_tied_embedding_gets_both_gradients_exactly():
    """A tied head: the same matrix embeds the tokens and scores them; its gradient sums both uses."""
    torch.manual_seed(1)
    V, d = 23, 10
    emb = torch.randn(V, d, dtype=torch.float64)
    x = torch.randint(0, V, (3, 7))
    y = torch.randint(0, V, (3, 7))
    y[0, :3] = IGNORE_INDEX
    grads = []
    for fused in (True, False):
        w = emb.clone().requires_grad_()
        h = torch.tanh(F.embedding(x, w) * 1.3)
        loss = (linear_cross_entropy(h, w, y, chunk_tokens=4) if fused
                else F.cross_entropy((h @ w.t()).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE_INDEX,
                                     reduction="sum"))
        loss.backward()
        grads.append((loss.detach(), w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-12, atol=1e-12)


def test_no_gradient_work_without_grad_and_all_ignored_is_zero():
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        out = linear_cross_entropy(h, w, y, chunk_tokens=5)
    assert out.grad_fn is None
    torch.testing.assert_close(out, _reference(h, w, y).detach(), **TOL[torch.float32])
    none = torch.full_like(y, IGNORE_INDEX)
    assert float(linear_cross_entropy(h.detach(), w.detach(), none)) == 0.0
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, y, chunk_tokens=0)


def test_bf16_activations_keep_the_unfused_semantics():
    """bf16 hidden states and head: per-chunk logits in bf16, log-sum-exp in fp32, as
    ``F.cross_entropy(lm_head(h).float())`` computes them."""
    h, w, y = _inputs(torch.float32, n=50, d=16, v=40)
    hb, wb = h.detach().bfloat16(), w.detach().bfloat16()
    out = linear_cross_entropy(hb, wb, y, chunk_tokens=16)
    ref = F.cross_entropy((hb @ wb.t()).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


TINY = dict(vocab_size=61, d_model=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16, attention="sdpa")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["decoder", "titans"])
def test_models_labels_path_matches_the_logits_path(kind, tied):
    """``model(..., labels=...)`` returns the summed token loss (``loss_sum``) of the fused loss; the
    gradients of every parameter (the tied embedding included) equal those of the logits path."""
    extra = {"type": "titans", "titans": TitansConfig(variant="mag", window=8, memory_chunk_size=4)} if kind == "titans" else {}
    cfg = ModelConfig(tie_embeddings=tied, **TINY, **extra)
    torch.manual_seed(0)
    model = build(cfg).double()
    x = torch.randint(0, 61, (3, 13))
    labels = torch.randint(0, 61, (3, 13))
    labels[1, 4:] = IGNORE_INDEX
    doc = torch.tensor([[0] * 6 + [1] * 7] * 3)

    model.loss_chunk_tokens = 0
    out = model(x, doc_ids=doc)
    assert out.loss_sum is None
    ref = F.cross_entropy(out.logits.reshape(-1, 61), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.set_fused_loss(5)  # 39 tokens: chunks of 5
    out = model(x, doc_ids=doc, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss_sum, ref.detach(), rtol=1e-10, atol=1e-10)
    out.loss_sum.backward()
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-11, msg=name)

    model.set_fused_loss(0)  # labels without the fused loss: the logits and their summed loss
    out = model(x, doc_ids=doc, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss_sum, ref.detach(), rtol=1e-12, atol=1e-12)
