"""Cross-attention memory banks (memtrain.model.crossattn; crossattn-memory-banks paper Sections 3-5):
routed attention against its definition, the router's gradients and balancing loss, compressed banks'
sizes, placement, no effect at initialisation, causality of the two routing modes, recipe errors,
model.init_from of a memory-less anchor, and evaluation batches of sequence-routed models. CPU, float64
references, a few seconds."""

from __future__ import annotations

import math
import re

import pytest
import torch

from memtrain.config import CrossAttnConfig, RecipeError, recipe_from_dict
from memtrain.model import build
from memtrain.model.crossattn import (ChapterRouter, CrossAttnMemory, DocumentSegments, LatentBank,
                                      MemoryCrossAttention, dense_routed_attention, full_bank_attention,
                                      memory_layer_indices, routed_attention, sequence_routed_attention)
from memtrain.parallel.engine import bank_frozen_from, lr_at, param_groups, peak_lr

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BASE = {"model": {"vocab_size": 97, "d_model": 32, "n_layers": 3, "n_heads": 4, "ffn_dim": 64, "max_seq_len": 32,
                  "attention": "sdpa", "tie_embeddings": False},
        "data": {"seq_len": 32, "tokenizer": {"vocab_size": 97}}}


def recipe(**crossattn):
    return recipe_from_dict({**BASE, "memory": {"type": "crossattn", "crossattn": crossattn}})


def model_of(seed: int = 0, **crossattn):
    r = recipe(**crossattn)
    torch.manual_seed(seed)
    return build(r.model, r.memory)


def anchor(seed: int = 0):
    r = recipe_from_dict(BASE)
    torch.manual_seed(seed)
    return build(r.model)


def open_outputs(model, seed: int = 5) -> None:
    """Give every memory layer a non-zero W_O (zero at initialisation) so the memory reads matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for part in model.crossattn.parts.values():
            part.attn.wo.weight.copy_(0.2 * torch.randn(part.attn.wo.weight.shape, generator=g))
            if hasattr(part, "ffn"):
                part.ffn.w3.weight.copy_(0.2 * torch.randn(part.ffn.w3.weight.shape, generator=g))


def tokens(B=2, T=23, seed=1):
    return torch.randint(1, 97, (B, T), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# Routed attention against its definition


def _kv_fn(keys, values, chapter_tokens):
    def kv(ids):
        idx = ids[:, None] * chapter_tokens + torch.arange(chapter_tokens)
        return keys[idx], values[idx]
    return kv


@pytest.mark.parametrize("B,T,H,D,C,Nc,k", [(2, 7, 3, 5, 6, 4, 2), (1, 13, 2, 8, 9, 3, 4), (3, 5, 1, 4, 4, 5, 1)])
def test_crossattn_token_routed_attention_equals_masked_full_bank_attention(B, T, H, D, C, Nc, k):
    """The grouped computation (unique chapters projected once, pairs grouped by chapter, per-chapter
    log-sum-exps merged with the log weights) equals the definition: attention over the whole bank with
    every non-routed chapter masked out and each routed logit biased by its chapter's log score."""
    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    keys = torch.randn(C * Nc, H, D, generator=g, dtype=torch.float64)
    values = torch.randn(C * Nc, H, D, generator=g, dtype=torch.float64)
    scores = torch.rand(B, T, C, generator=g, dtype=torch.float64).softmax(-1)
    top, chapters = scores.topk(k, dim=-1)
    got = routed_attention(q, _kv_fn(keys, values, Nc), chapters, top.log())
    want = dense_routed_attention(q, keys, values, Nc, chapters, top.log())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # Sequence routing (every token of a sequence reads the same chapters): the fused path, the grouped
    # path and the definition agree.
    seq_ch, seq_lw = chapters[:, 0], top[:, 0].log()
    fused = sequence_routed_attention(q, _kv_fn(keys, values, Nc), seq_ch, seq_lw)
    grouped = routed_attention(q, _kv_fn(keys, values, Nc), seq_ch[:, None].expand(B, T, k),
                               seq_lw[:, None].expand(B, T, k))
    dense = dense_routed_attention(q, keys, values, Nc, seq_ch[:, None].expand(B, T, k), seq_lw[:, None].expand(B, T, k))
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(grouped, dense, rtol=0, atol=1e-12)


def test_crossattn_all_chapters_with_equal_weights_is_full_bank_attention():
    """Routing to every chapter with equal scores is plain memory attention over the whole bank (eq. 4)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D, C, Nc = 2, 6, 2, 4, 5, 3
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(C * Nc, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    chapters = torch.arange(C).expand(B, T, C)
    log_w = torch.full((B, T, C), math.log(1 / C), dtype=torch.float64)
    torch.testing.assert_close(routed_attention(q, _kv_fn(keys, values, Nc), chapters, log_w),
                               full_bank_attention(q, keys, values), rtol=0, atol=1e-12)


def test_crossattn_routed_attention_gradients_match_the_definition():
    """Gradients with respect to queries, keys, values and the routing weights (float64)."""
    g = torch.Generator().manual_seed(4)
    B, T, H, D, C, Nc, k = 2, 5, 2, 3, 4, 3, 2
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
              for s in ((B, T, H, D), (C * Nc, H, D), (C * Nc, H, D))]
    logits = torch.randn(B, T, C, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    grads = []
    for fn in ("grouped", "dense"):
        top, chapters = logits.softmax(-1).topk(k, dim=-1)
        q, keys, values = leaves
        out = (routed_attention(q, _kv_fn(keys, values, Nc), chapters, top.log()) if fn == "grouped"
               else dense_routed_attention(q, keys, values, Nc, chapters, top.log()))
        grads.append(torch.autograd.grad((out * w).sum(), [*leaves, logits]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert grads[0][-1].abs().sum() > 0  # the router's logits get a gradient through the attention


# --------------------------------------------------------------------------------------------------
# The router


def test_crossattn_router_picks_top_k_and_its_balance_loss_is_switch_style():
    torch.manual_seed(0)
    router = ChapterRouter(8, chapters=5, top_k=2, mode="token").double()
    h = torch.randn(3, 4, 8, dtype=torch.float64)
    r = router(h)
    probs = torch.softmax(h.reshape(12, 8) @ router.proj.weight.T + router.proj.bias, dim=-1)
    top, ids = probs.topk(2, dim=-1)
    assert torch.equal(r.chapters.reshape(12, 2), ids)
    torch.testing.assert_close(r.log_weights.reshape(12, 2), top.log())
    share = torch.bincount(ids.reshape(-1), minlength=5).double() / ids.numel()
    torch.testing.assert_close(r.loss, 5 * (share * probs.mean(0)).sum())
    seq = ChapterRouter(8, chapters=5, top_k=2, mode="sequence").double()
    seq.load_state_dict(router.state_dict())
    rs = seq(h)  # one decision per sequence, from the mean-pooled states (eq. 8)
    sp = torch.softmax(h.mean(1) @ seq.proj.weight.T + seq.proj.bias, dim=-1)
    assert torch.equal(rs.chapters, sp.topk(2, dim=-1)[1][:, None].expand(3, 4, 2))
    assert rs.per_row and torch.equal(rs.decisions, sp.topk(2, dim=-1)[1])
    # Packed rows: one decision per document, from each document's mean, read by its positions.
    doc_ids = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 2, 2]])
    rd = seq(h, DocumentSegments.of(doc_ids))
    docs = [h[0, :2], h[0, 2:], h[1], h[2, :1], h[2, 1:2], h[2, 2:]]
    dp = torch.softmax(torch.stack([d.mean(0) for d in docs]) @ seq.proj.weight.T + seq.proj.bias, dim=-1)
    assert not rd.per_row and rd.probs.shape == (6, 5)
    torch.testing.assert_close(rd.probs, dp)
    assert torch.equal(rd.decisions, dp.topk(2, dim=-1)[1])
    of_position = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2], [3, 4, 5, 5]])
    assert torch.equal(rd.chapters, rd.decisions[of_position])
    torch.testing.assert_close(rd.log_weights, dp.topk(2, dim=-1)[0].log()[of_position])
    share = torch.bincount(rd.decisions.reshape(-1), minlength=5).double() / rd.decisions.numel()
    torch.testing.assert_close(rd.loss, 5 * (share * dp.mean(0)).sum())  # balancing over documents


@pytest.mark.parametrize("routing", ["sequence", "token"])
def test_crossattn_router_receives_gradients_from_the_loss(routing):
    """Routing weights enter the attention, so the language-model loss reaches the router (once the
    memory's W_O is non-zero); the balancing loss reaches it too."""
    model = model_of(tokens=24, chapters=6, top_k=2, routing=routing)
    open_outputs(model)
    out = model(tokens())
    out.logits.float().square().mean().backward()
    for part in model.crossattn.parts.values():
        assert float(part.attn.router.proj.weight.grad.abs().sum()) > 0
    model.zero_grad()
    model(tokens()).aux_loss.backward()
    assert all(float(p.attn.router.proj.weight.grad.abs().sum()) > 0 for p in model.crossattn.parts.values())


# --------------------------------------------------------------------------------------------------
# The model


@pytest.mark.parametrize("crossattn", [
    {"tokens": 16},
    {"tokens": 24, "chapters": 6, "top_k": 2},
    {"tokens": 24, "chapters": 6, "top_k": 3, "routing": "token", "variant": "B", "shared": True},
    {"tokens": 16, "dim": 8, "heads": 2, "bank_rank": 4, "proj_rank": 4, "placement": "last", "placement_k": 2},
])
def test_crossattn_memory_has_no_effect_at_initialisation(crossattn):
    """W_O (and variant B's MLP output) start at zero: the model computes exactly the anchor's logits."""
    x = tokens()
    torch.testing.assert_close(model_of(**crossattn)(x).logits, anchor()(x).logits, rtol=0, atol=0)
    m = model_of(**crossattn)
    open_outputs(m)
    assert (m(x).logits - anchor()(x).logits).abs().max() > 1e-3  # the reads do something once opened


def test_the_trainer_notes_sequence_routing_and_a_single_chapter():
    """Sequence routing is the default once routing is on (top_k), and not causal: the trainer says so at the start
    (the adapter recipes' headers once suggested turning routing on without choosing token routing). With top_k 1
    the language-model loss does not train the router, and the trainer says that too."""
    from memtrain.launcher.train import routing_notes

    def notes(**crossattn):
        return routing_notes(recipe_from_dict({**BASE, "memory": {"type": "crossattn", "crossattn": crossattn}}))

    base = {"tokens": 12, "chapters": 4, "top_k": 2}
    sequence, = notes(**base)
    assert "pools each document of a training sequence" in sequence and "the router sees the future" in sequence
    assert notes(**base, routing="token") == [] and notes(**{**base, "top_k": 0}) == []
    single, = notes(**{**base, "top_k": 1}, routing="token")
    assert "top_k 1" in single and "no gradient" in single and "top_k 2 or more" in single
    assert len(notes(**{**base, "top_k": 1})) == 2
    assert routing_notes(recipe_from_dict(BASE)) == []


@pytest.mark.parametrize("routing", ["sequence", "token"])
def test_crossattn_router_with_one_chapter_per_read_gets_no_gradient_from_the_loss(routing):
    """What the top_k 1 note says: one chapter's log weight shifts every logit of its read and cancels in the
    softmax, so the language-model loss leaves the router's weights without gradient (top_k 2 gives one,
    test_crossattn_router_receives_gradients_from_the_loss); the balancing loss still reaches it."""
    model = model_of(tokens=24, chapters=6, top_k=1, routing=routing).double()
    open_outputs(model)
    out = model(tokens())
    routers = [part.attn.router.proj.weight for part in model.crossattn.parts.values()]
    grads = torch.autograd.grad(out.logits.square().mean(), routers)
    assert max(float(g.abs().max()) for g in grads) < 1e-12
    grads = torch.autograd.grad(model(tokens()).aux_loss, routers)
    assert min(float(g.abs().max()) for g in grads) > 0


def test_crossattn_token_routing_is_causal_and_sequence_routing_is_not():
    """Token routing (Section 4.4) decides per token from that token's state: changing a later token
    leaves every earlier logit unchanged. Sequence routing (eq. 8) pools the whole sequence, so a later
    token moves the earlier logits: not a causal language model (documented)."""
    x = tokens(B=1, T=20)
    y = x.clone()
    y[0, 15] = (x[0, 15] % 96) + 1
    for routing, causal in (("token", True), ("sequence", False)):
        m = model_of(tokens=24, chapters=6, top_k=2, routing=routing).double()
        open_outputs(m)
        with torch.no_grad():
            diff = (m(x).logits[0, :15] - m(y).logits[0, :15]).abs().max()
        assert (diff < 1e-12) == causal, (routing, float(diff))


def test_crossattn_sequence_routing_routes_each_packed_document_on_its_own():
    """In a packed row sequence routing (eq. 8) pools and routes each document alone: a document's
    logits, and the router's gradients from them, are those of the document as a row of its own (RoPE
    positions restart per document), whatever is packed beside it. Rows of one document each keep the
    per-row path. Before 2026-11-30 the router pooled the whole row, so doc A's logits moved by about 5
    when only doc B changed."""
    from memtrain.data.loader import document_ids
    from memtrain.model.crossattn import DocumentSegments

    eot, g = 96, torch.Generator().manual_seed(1)
    a, b, b2, c = (torch.randint(1, 90, (n,), generator=g) for n in (11, 9, 9, 20))
    a[-1] = eot  # an end-of-text token belongs to the document it ends
    x, y = torch.stack([torch.cat([a, b]), c]), torch.stack([torch.cat([a, b2]), c])
    assert DocumentSegments.of(document_ids(c[None], eot)) is None and DocumentSegments.of(None) is None
    m = model_of(tokens=24, chapters=6, top_k=2, routing="sequence").double()
    open_outputs(m)
    router = m.crossattn.parts["0"].attn.router.proj.weight
    packed = m(x, doc_ids=document_ids(x, eot)).logits
    with torch.no_grad():
        other = m(y, doc_ids=document_ids(y, eot)).logits
        alone_b, alone_c = m(b[None]).logits[0], m(c[None]).logits[0]
    assert float((packed[0, :11].detach() - other[0, :11]).abs().max()) < 1e-12  # doc B does not reach doc A
    alone_a = m(a[None]).logits[0]
    torch.testing.assert_close(packed[0, :11], alone_a, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed[0, 11:], alone_b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed[1], alone_c, rtol=1e-10, atol=1e-10)
    grad_packed, = torch.autograd.grad(packed[0, :11].square().sum(), router)
    grad_alone, = torch.autograd.grad(alone_a.square().sum(), router)
    assert float(grad_alone.abs().max()) > 0
    torch.testing.assert_close(grad_packed, grad_alone, rtol=1e-10, atol=1e-12)


def test_crossattn_routing_statistics_are_per_bank_and_count_each_forward_once():
    """Per-layer banks (``shared: false``) are counted apart: three layers each always picking two of their
    own bank's six chapters leave 12 of 18 chapters dead at entropy ln 2, where one count over "chapter c of
    any bank" read every chapter as used (0 dead, ln 6). A shared bank read by the same routers uses all six.
    A checkpointed block's recomputation in backward does not count again (it doubled the counts)."""
    for shared, dead, entropy in ((False, 12, math.log(2)), (True, 0, math.log(6))):
        m = model_of(tokens=24, chapters=6, top_k=2, routing="token", shared=shared)
        with torch.no_grad():
            for i, part in enumerate(m.crossattn.parts.values()):
                part.attn.router.proj.weight.zero_()
                part.attn.router.proj.bias.copy_(torch.tensor([5.0 if c == 2 * i else 4.0 if c == 2 * i + 1
                                                               else 0.0 for c in range(6)]))
        m.train()
        m(tokens())
        stats = m.crossattn.pop_stats()
        assert stats["memory_module/dead_chapters"] == dead, shared
        assert stats["memory_module/chapter_entropy"] == pytest.approx(entropy), shared
    for every in (0, 1, 2):
        m = model_of(tokens=24, chapters=6, top_k=2, routing="token")
        open_outputs(m)
        m.train()
        m.activation_checkpointing = every
        out = m(tokens())
        counted = (m.crossattn.stats.calls, float(m.crossattn.stats.counts.sum()))
        assert counted == (3, 3 * 2 * 23 * 2), every  # 3 layers x 46 tokens x top-2
        (out.logits.square().mean() + out.aux_loss).backward()
        assert (m.crossattn.stats.calls, float(m.crossattn.stats.counts.sum())) == counted, every


@pytest.mark.parametrize("placement,k,want", [("all", 1, [0, 1, 2, 3, 4]), ("first", 2, [0, 1]),
                                              ("last", 2, [3, 4]), ("every", 2, [0, 2, 4])])
def test_crossattn_placement(placement, k, want):
    assert memory_layer_indices(CrossAttnConfig(placement=placement, placement_k=k), 5) == want
    assert memory_layer_indices(CrossAttnConfig(layers=[4, 1]), 5) == [1, 4]


def test_crossattn_variant_b_adds_an_mlp_after_the_memory_read():
    a, b = model_of(tokens=8, variant="A"), model_of(tokens=8, variant="B")
    part_a, part_b = a.crossattn.parts["0"], b.crossattn.parts["0"]
    assert not hasattr(part_a, "ffn") and part_b.ffn.w1.weight.shape == (64, 32)
    assert float(part_b.ffn.w3.weight.detach().abs().sum()) == 0


def test_crossattn_compressed_banks_have_the_expected_parameter_counts():
    """Dense N_m x d; low-rank (N_m + d) r (eq. 13); reduced dimension: N_m x r tokens, W_Q d x r,
    W_K/W_V r x r, W_O r x d (eq. 15-17); low-rank projections d r + r d_k (eq. 14); int8: N_m x d values
    plus N_m scales."""
    assert LatentBank(100, 32).parameter_count == 3200
    lowrank = LatentBank(100, 32, rank=4)
    assert lowrank.parameter_count == (100 + 32) * 4 == sum(p.numel() for p in lowrank.parameters())
    assert LatentBank(100, 32, dtype="int8", chapters=4).parameter_count == 3200 + 100
    m = model_of(tokens=40, dim=8, heads=2)
    attn = m.crossattn.parts["0"].attn
    assert m.crossattn.banks[0].weight.shape == (40, 8)
    assert (attn.wq.weight.shape, attn.wk.weight.shape, attn.wv.weight.shape, attn.wo.weight.shape) == (
        (8, 32), (8, 8), (8, 8), (32, 8))
    low = model_of(tokens=40, proj_rank=3).crossattn.parts["0"].attn.wq
    assert [tuple(l.weight.shape) for l in low] == [(3, 32), (32, 3)]  # d -> r -> d_k (width 32)
    counts = model_of(tokens=40, dim=8, heads=2, shared=True).crossattn.parameter_counts()
    assert counts["bank"] == 40 * 8 and counts["banks"] == 1 and counts["layers"] == 3
    assert counts["per_layer"] == 32 * 8 + 8 * 8 * 2 + 8 * 32 + 32  # W_Q, W_K, W_V, W_O and the norm gain


def test_crossattn_int8_bank_quantises_a_trained_fp32_bank_on_load():
    torch.manual_seed(0)
    dense = LatentBank(12, 16, chapters=3)
    q8 = LatentBank(12, 16, chapters=3, dtype="int8")
    q8.load_state_dict(dense.state_dict())
    err = (q8.all() - dense.all().detach()).abs()
    assert float((err / dense.all().detach().abs().amax(-1, keepdim=True)).max()) <= 0.5 / 127 + 1e-6
    torch.testing.assert_close(q8.chapters(torch.tensor([2])), q8.all()[8:12][None])
    assert not list(q8.parameters())  # stored as buffers: nothing to train


def test_crossattn_int8_bank_starts_from_the_dense_draw_quantised():
    """A fresh int8 bank (memory.crossattn.bank_dtype int8 with no checkpoint to load) holds the dense bank's
    random draw quantised, not zeros: its reads are the draw to int8 precision."""
    torch.manual_seed(0)
    dense = LatentBank(12, 16, chapters=3, init_std=0.5)
    torch.manual_seed(0)
    q8 = LatentBank(12, 16, chapters=3, dtype="int8", init_std=0.5)
    assert int((q8.q != 0).sum()) > 0.9 * q8.q.numel()
    err = (q8.all() - dense.all().detach()).abs()
    assert float((err / dense.all().detach().abs().amax(-1, keepdim=True)).max()) <= 0.5 / 127 + 1e-6


def test_crossattn_parameter_groups_and_staged_freezing():
    """Projections/router/MLPs at memory.optimizer.lr (role memory), the bank with its W_K, W_V at
    memory.crossattn.bank_lr (role bank; differential learning rates), frozen from freeze_bank_at on
    (Section 5.5): the bank's learning rate is 0 from that step."""
    r = recipe_from_dict({**BASE, "train": {"max_steps": 20, "schedule": {"warmup": 2}},
                          "memory": {"type": "crossattn", "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
                                     "crossattn": {"tokens": 8, "bank_lr": 2e-4, "freeze_bank_at": 10}}})
    torch.manual_seed(0)
    m = build(r.model, r.memory)
    groups = param_groups(m, 0.1, m.memory_parameters(), 0.0, m.bank_parameters())
    roles: dict[str, int] = {}
    for g in groups:
        roles[g["role"]] = roles.get(g["role"], 0) + sum(p.numel() for p in g["params"])
    assert all(g["weight_decay"] == 0 for g in groups if g["role"] != "anchor" and g["params"][0].ndim < 2)
    bank = sum(b.parameter_count for b in m.crossattn.banks) + sum(
        p.attn.wk.weight.numel() + p.attn.wv.weight.numel() for p in m.crossattn.parts.values())
    assert roles["bank"] == bank and roles["memory"] == sum(p.numel() for p in m.crossattn.parameters()) - bank
    assert peak_lr(r, "bank") == (2e-4, pytest.approx(2e-5)) and peak_lr(r, "memory") == (1e-3, 1e-4)
    bank_lr, mem_lr = lr_at(r, "bank"), lr_at(r, "memory")
    assert bank_lr(9) > 0 and bank_lr(10) == 0 and bank_lr(19) == 0 and mem_lr(15) > 0
    # freeze_bank: 0 throughout, as the bank does not move (before, the logged optim/bank_lr followed the schedule)
    frozen = recipe_from_dict(r.to_dict(), ["memory.crossattn.freeze_bank=true", "memory.crossattn.freeze_bank_at=0"])
    assert [lr_at(frozen, "bank")(s) for s in (0, 1, 9, 19)] == [0.0] * 4 and lr_at(frozen, "memory")(1) > 0
    assert bank_frozen_from(r) == 10 and bank_frozen_from(frozen) is None
    assert bank_frozen_from(recipe_from_dict(r.to_dict(), ["memory.crossattn.freeze_bank_at=0"])) is None


def test_crossattn_a_bank_frozen_partway_leaves_the_gradient_norm():
    """From freeze_bank_at on (the trainer calls freeze_bank_gradients at that step) the bank and its W_K, W_V
    get zero gradients, so the global norm that clipping and optim/grad_norm use counts only what still trains,
    as with the bank frozen from the start; the other gradients are unchanged. Before 2026-11-30 the bank only
    got a learning rate of 0, and its gradients still entered the norm (clipping the rest harder)."""
    m = model_of(tokens=24, chapters=6, top_k=2, routing="token").double()
    open_outputs(m)
    bank = {id(p) for p in m.bank_parameters()}

    def grads():
        m.zero_grad()
        out = m(tokens())
        (out.logits.square().mean() + out.aux_loss).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    before = grads()
    m.crossattn.freeze_bank_gradients()
    m.crossattn.freeze_bank_gradients()  # idempotent
    assert len(m.crossattn._bank_grad_hooks) == len(bank)
    after = grads()
    trains = [n for n, p in m.named_parameters() if id(p) not in bank]
    for n, p in m.named_parameters():
        if id(p) in bank:
            assert float(before[n].abs().max()) > 0 and float(after[n].abs().max()) == 0, n
        else:
            torch.testing.assert_close(after[n], before[n], rtol=0, atol=0)
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
    torch.testing.assert_close(norm, torch.stack([before[n].norm() for n in trains]).norm())


@pytest.mark.parametrize("crossattn,key,message", [
    ({"tokens": 10, "chapters": 3}, "memory.crossattn.chapters", "do not split into 3 chapters"),
    ({"tokens": 12, "chapters": 4, "top_k": 5}, "memory.crossattn.top_k", r"must lie in \[0, memory.crossattn"),
    ({"tokens": 12, "top_k": 1}, "memory.crossattn.top_k", "routing needs memory.crossattn.chapters > 1"),
    ({"placement": "first", "placement_k": 7}, "memory.crossattn.placement_k", "more than the model's 3 layers"),
    ({"layers": [0, 3]}, "memory.crossattn.layers", r"distinct layer indices in \[0, 3\)"),
    ({"placement": "middle"}, "memory.crossattn.placement", "must be one of"),
    ({"dim": 10, "heads": 4}, "memory.crossattn.heads", "does not split into 4 heads"),
    ({"heads": 0}, "memory.crossattn.heads", "must be >= 1, got 0"),  # before: read as unset, model.n_heads
    ({"bank_dtype": "int8"}, "memory.crossattn.bank_dtype", "cannot be trained"),
    ({"bank": "sharded", "bank_rank": 4}, "memory.crossattn.bank", "not the factors of memory.crossattn.bank_rank"),
    ({"bank": "sharded", "bank_dtype": "int8", "freeze_bank": True}, "memory.crossattn.bank", "int8 bank is frozen"),
])
def test_crossattn_bad_settings_are_one_recipe_error(crossattn, key, message):
    with pytest.raises(RecipeError, match=rf"^recipe error: {key}: .*{message}"):
        recipe(**crossattn)


def test_crossattn_keys_belong_to_their_memory_type():
    with pytest.raises(RecipeError, match="memory.crossattn: is only used with memory.type 'crossattn'"):
        recipe_from_dict({**BASE, "memory": {"type": "none", "crossattn": {"tokens": 8}}})
    with pytest.raises(RecipeError, match="memory.levels: is a hierarchical-memory setting"):
        recipe_from_dict({**BASE, "memory": {"type": "crossattn", "levels": [1]}})
    with pytest.raises(RecipeError, match="memory.type: cross-attention memories attach to model.type 'decoder'"):
        recipe_from_dict({"model": {"type": "titans"}, "memory": {"type": "crossattn"}})


def test_crossattn_routing_statistics_count_training_forwards():
    m = model_of(tokens=24, chapters=6, top_k=2, routing="token")
    m.train()
    m(tokens())
    stats = m.crossattn.pop_stats()
    assert stats["memory_module/chapter_entropy_max"] == pytest.approx(math.log(6))
    assert 0 < stats["memory_module/chapter_entropy"] <= math.log(6) + 1e-9
    assert 0 <= stats["memory_module/dead_chapters"] <= 4 and stats["memory_module/router_loss"] > 0
    assert m.crossattn.pop_stats() == {}  # reset
    m.eval()
    with torch.no_grad():
        m(tokens())
    assert m.crossattn.pop_stats() == {}  # validation forwards are not counted


def test_crossattn_layer_key_values_cover_only_the_requested_chapters():
    torch.manual_seed(0)
    bank = LatentBank(12, 16, chapters=4)
    layer = MemoryCrossAttention(16, 16, 16, 2, chapters=4, top_k=2)
    k_some, v_some = layer.key_values(bank, torch.tensor([3, 1]), torch.float32)
    k_all, v_all = layer.key_values(bank, None, torch.float32)
    assert k_some.shape == (2, 3, 2, 8) and k_all.shape == (12, 2, 8)
    torch.testing.assert_close(k_some[0], k_all[9:12])
    torch.testing.assert_close(v_some[1], v_all[3:6])
    assert isinstance(CrossAttnMemory(CrossAttnConfig(tokens=8), 16, 2, 8, 2, 32, lambda: torch.nn.Identity()),
                      torch.nn.Module)


@pytest.mark.parametrize("name,bank,layers,per_layer", [
    ("crossattn-100m-shared-10k", 10_000 * 768, [0, 3, 6, 9], 4 * 768 * 768 + 768),
    ("crossattn-100m-perlayer-10k", 4 * 10_000 * 768, [0, 3, 6, 9], 4 * 768 * 768 + 768),
    ("crossattn-100m-shared-1m-routed", 1_048_576 * 256, [0, 3, 6, 9],
     768 * 256 + 2 * 256 * 256 + 256 * 768 + 768 + 768 * 1024 + 1024),
    ("quickstart-crossattn", 4096 * 128, [0, 1, 2, 3], 4 * 128 * 128 + 128 + 128 * 32 + 32),
])
def test_crossattn_shipped_recipes_resolve_to_their_sizes(name, bank, layers, per_layer):
    """The recipes' banks and memory layers (W_Q, W_K, W_V, W_O, the pre-norm gain, and the router's
    W_r, b_r where routed), built on the meta device; the baseline is the same model without them."""
    from pathlib import Path

    from memtrain.config import load_recipe
    from memtrain.model import count_parameters

    path = Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml"
    r = load_recipe(path)
    with torch.device("meta"):
        m = build(r.model, r.memory)
    counts = m.crossattn.parameter_counts()
    assert (counts["bank"], m.crossattn.layer_indices, counts["per_layer"]) == (bank, layers, per_layer)
    if name.startswith("crossattn-100m"):
        assert count_parameters(m) - counts["total"] == 123_704_064  # the anchor
        # the baseline matches the memory models' size without the bank (Section 6.2): within 3%, 0.5% of the 10k
        base = load_recipe(path.with_name("crossattn-100m-baseline.yaml"))
        with torch.device("meta"):
            baseline = count_parameters(build(base.model))
        assert baseline == 132_551_424
        assert abs(baseline / (count_parameters(m) - counts["bank"]) - 1) < (0.03 if "routed" in name else 0.005)


# --------------------------------------------------------------------------------------------------
# model.init_from: a cross-attention model started from a memory-less anchor checkpoint


def _checkpoint(run_dir, state: dict, step: int = 2):
    """A complete checkpoint of module state ``state`` as the trainer writes it under ZeRO 0-2 (the model
    states file and the marker with its checksum), in run directory ``run_dir``."""
    from memtrain.parallel import checkpoint as ckpt
    from memtrain.parallel.checkpoint_folder import hash_files, mark_complete

    folder = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    torch.save({"module": state}, folder / "mp_rank_00_model_states.pt")
    mark_complete(folder, step, False, 1, hash_files(folder, ["mp_rank_00_model_states.pt"]))
    return folder


@pytest.mark.parametrize("crossattn", [
    {"tokens": 24, "chapters": 6, "top_k": 2, "routing": "token"},
    {"tokens": 24, "chapters": 6, "top_k": 2, "routing": "sequence", "bank_rank": 4},
    {"tokens": 16, "variant": "B", "shared": False, "dim": 8, "heads": 2, "placement": "last", "placement_k": 2},
])
def test_crossattn_init_from_a_memoryless_anchor_starts_as_the_anchor(tmp_path, crossattn):
    """model.init_from of an anchor-only checkpoint (memory.type none): every anchor weight is loaded and
    the whole cross-attention memory keeps its fresh initialisation, W_O (and variant B's MLP output) at
    zero (eq. 21), so the model's logits and loss at step 0 are exactly the anchor checkpoint's on the same
    batch; the log says so in one line. Until 2026-11-29 the missing memory keys were refused ("the
    anchor settings differ")."""
    from memtrain.parallel import checkpoint as ckpt

    trained = anchor(seed=7)  # weights other than the memory model's own anchor draw
    run = tmp_path / "anchor"
    _checkpoint(run, trained.state_dict())
    m = model_of(seed=0, **crossattn)
    fresh = {k: v.clone() for k, v in m.crossattn.state_dict().items()}
    lines: list[str] = []
    assert ckpt.load_anchor(m, run, log=lines.append).step == 2
    assert len(lines) == 1 and "holds no cross-attention memory" in lines[0], lines
    assert f"{len(fresh)} tensors" in lines[0] and "keep their fresh initialisation" in lines[0]
    assert all(torch.equal(v, m.crossattn.state_dict()[k]) for k, v in fresh.items())
    assert not any(part.attn.wo.weight.any() for part in m.crossattn.parts.values())
    assert all(torch.equal(p, trained.state_dict()[k]) for k, p in m.state_dict().items() if k in trained.state_dict())
    x, y = tokens(seed=3), tokens(seed=4)
    with torch.no_grad():
        assert torch.equal(m(x).logits, trained(x).logits)
        assert torch.equal(m(x, labels=y).loss_sum, trained(x, labels=y).loss_sum)


def test_crossattn_init_from_refuses_what_does_not_fit(tmp_path):
    """Only a cross-attention memory wholly absent from the checkpoint starts fresh: a missing anchor key,
    a shape that differs (anchor or memory) and a checkpoint holding part of the memory stay refused; a
    checkpoint holding the whole memory loads it (no line)."""
    from memtrain.errors import CheckpointError
    from memtrain.parallel import checkpoint as ckpt

    base = anchor(seed=7).state_dict()
    memory = model_of(seed=3, tokens=16).state_dict()
    cases = [
        ({k: v for k, v in base.items() if k != "blocks.1.ffn.w1.weight"}, "missing ['blocks.1.ffn.w1.weight']"),
        ({**base, "blocks.0.ffn.w1.weight": torch.zeros(65, 32)},
         "blocks.0.ffn.w1.weight has shape (65, 32) there but (64, 32) in this recipe's model"),
        ({k: v for k, v in memory.items() if not k.startswith("crossattn.parts.2.")}, "missing ['crossattn.parts.2."),
        (model_of(seed=3, tokens=24).state_dict(), "crossattn.banks.0.weight has shape (24, 32) there but (16, 32)"),
    ]
    for i, (state, message) in enumerate(cases):
        _checkpoint(tmp_path / str(i), state)
        lines: list[str] = []
        with pytest.raises(CheckpointError, match=re.escape(message)):
            ckpt.load_anchor(model_of(seed=0, tokens=16), tmp_path / str(i), log=lines.append)
        assert lines == []
    _checkpoint(tmp_path / "whole", memory)
    m, lines = model_of(seed=0, tokens=16), []
    ckpt.load_anchor(m, tmp_path / "whole", log=lines.append)
    assert lines == [] and all(torch.equal(v, memory[k]) for k, v in m.state_dict().items())


# --------------------------------------------------------------------------------------------------
# Evaluation of sequence-routed models: a sequence's result does not depend on its batch


def _sequence_routed(seed: int = 0):
    m = model_of(seed, tokens=24, chapters=6, top_k=2, routing="sequence").double().eval()
    open_outputs(m)
    return m


def _distinct(lengths, seed: int = 1) -> list[list[int]]:
    """Random sequences of ``lengths``; sequence i starts with token i + 1, so a batch row names its sequence."""
    g = torch.Generator().manual_seed(seed)
    return [[i + 1] + torch.randint(1, 97, (n - 1,), generator=g).tolist() for i, n in enumerate(lengths)]


def test_crossattn_sequence_routed_probe_scores_do_not_depend_on_the_batch():
    """Sequence routing (eq. 8) mean-pools the whole row, right padding included, so a padded batch moved a
    sequence's logits by what shared its batch (reported: 0.24-0.37 on 20 real tokens with 5-100 pad tokens).
    score_sequences (memtrain eval's fact probes) batches such a model by equal length: every row's logits
    equal its sequence's logits alone, and the results equal scoring each probe alone."""
    from memtrain.eval.common import padding_changes_logits
    from memtrain.eval.hierarchical import score_sequences

    m = _sequence_routed()
    assert padding_changes_logits(m)
    assert not padding_changes_logits(model_of(tokens=24, chapters=6, top_k=2, routing="token"))
    assert not padding_changes_logits(model_of(tokens=16)) and not padding_changes_logits(anchor())
    seqs = _distinct([20, 5, 31, 20, 9, 31, 12, 20])
    starts = [len(s) - 3 for s in seqs]
    seen = []
    hook = m.register_forward_hook(lambda module, args, out: seen.append((args[0].clone(), out.logits.clone())))
    batched = score_sequences(m, seqs, starts, batch_size=3, pad_id=0)
    hook.remove()
    with torch.no_grad():
        alone = [m(torch.tensor([s])).logits[0] for s in seqs]
    rows = 0
    for batch, logits in seen:
        for row, out in zip(batch, logits):
            s = seqs[int(row[0]) - 1]
            torch.testing.assert_close(out[:len(s)], alone[int(row[0]) - 1], rtol=0, atol=1e-12)
            rows += 1
    assert rows == len(seqs) and len(seen) == 5  # lengths 5, 9, 12, 20 (3 + 1 rows), 31
    assert batched.tolist() == [bool(score_sequences(m, [s], [c])[0]) for s, c in zip(seqs, starts)]


def test_crossattn_sequence_routed_generation_does_not_depend_on_the_batch():
    """greedy_generate (memtrain eval's long-context tasks) batches a sequence-routed model's prompts by
    equal length, so no row is padded and each prompt generates what it generates alone."""
    from memtrain.eval.longctx import greedy_generate

    m = _sequence_routed()
    prompts = _distinct([3, 9, 14, 9, 20, 3])
    seen = []
    hook = m.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    out, cut = greedy_generate(m, prompts, 6, eot_id=0, max_context=32, batch_size=8, pad_id=0)
    hook.remove()
    assert not any(cut)
    for batch in seen:
        assert len({len(prompts[int(row[0]) - 1]) for row in batch}) == 1  # one prompt length per forward
    assert out == [greedy_generate(m, [p], 6, eot_id=0, max_context=32)[0][0] for p in prompts]
