"""Titans architectures (LMM, MAC, MAG, MAL): config and build, the paper-scale recipes' parameter
counts (meta device), shapes, causality (MAC inside a segment and across segments), MAC's
pre-segment retrieval, carried memory, attention masks (window, segment, documents), activation
checkpointing, a few training steps per variant, and one end-to-end CLI run. CPU, tiny sizes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import ModelConfig, RecipeError, TitansConfig, load_recipe, recipe_from_dict
from memtrain.data.loader import document_ids
from memtrain.model import DecoderLM, ModelOutput, TitansLM, build, count_parameters
from memtrain.model.titans.arch import segment_bounds
from memtrain.model.titans.attention import segment_mask, sliding_window_mask, window_allowed

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("lmm", "mac", "mag", "mal")
EOT = 0
VOCAB = 61
SEG, WINDOW, NP = 8, 6, 3  # tiny MAC segment, MAG/MAL window, persistent tokens
TIGHT = dict(rtol=0, atol=1e-10)


def tiny(variant: str, titans: dict | None = None, **model) -> ModelConfig:
    t = dict(variant=variant, memory_heads=2, memory_chunk_size=4, segment_len=SEG, window=WINDOW,
             persistent_tokens=NP, memory_max_lr=0.1, memory_init_lr=0.02)
    t.update(titans or {})
    base = dict(type="titans", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64,
                attention="sdpa", tie_embeddings=False, titans=TitansConfig(**t))
    base.update(model)
    return ModelConfig(**base)


def exact(variant: str, seed: int = 0, **kw) -> TitansLM:
    """A float64 model in eval mode: equalities then hold to ~1e-12."""
    torch.manual_seed(seed)
    return build(tiny(variant, **kw)).double().eval()


def tokens(B: int = 2, T: int = 40, seed: int = 1, eots: tuple[int, ...] = ()) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    for p in eots:
        ids[:, p] = EOT
    return ids


def logits(model, ids, docs: bool = False, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, document_ids(ids, EOT) if docs else None, **kw).logits


def changed(ids: torch.Tensor, p: int) -> torch.Tensor:
    out = ids.clone()
    out[:, p] = ids[:, p] % (VOCAB - 1) + 1  # another non-EOT token
    return out


# --------------------------------------------------------------------------------------------------
# Config and build


def test_build_dispatch_and_block_structure():
    assert isinstance(build(ModelConfig(d_model=32, n_layers=1, n_heads=4, ffn_dim=64, vocab_size=50)), DecoderLM)
    for v in VARIANTS:
        m = build(tiny(v))
        assert isinstance(m, TitansLM) and len(m.blocks) == 2
        b = m.blocks[0]
        assert (b.attn is None) == (v == "lmm")
        assert (b.gate is not None) == (v in ("mac", "mag"))
        assert (b.norm3 is not None) == (v == "mal")
        assert b.persistent.shape == (NP, 32)
        assert b.memory.depth == 2 and b.memory.chunk_size == 4 and b.memory.heads == 2
    assert build(tiny("mag", {"persistent_tokens": 0})).blocks[0].persistent is None


def test_recipe_titans_section_defaults_and_validation():
    r = recipe_from_dict({"model": {"type": "titans"}})
    assert r.model.titans == TitansConfig()  # defaults filled in
    r = recipe_from_dict({}, ["model.type=titans", "model.titans.variant=mal", "model.titans.window=64"])
    assert r.model.titans.variant == "mal" and r.model.titans.window == 64
    # A decoder recipe keeps titans None, so checkpoints written before the field existed still match.
    assert recipe_from_dict({}).model.titans is None
    assert "titans" in recipe_from_dict({}).to_dict()["model"]


@pytest.mark.parametrize("overrides, key", [
    (["model.type=titans", "model.titans.variant=mag2"], "model.titans.variant"),
    (["model.type=titans", "model.titans.gate_mode=segment"], "model.titans.gate_mode"),
    (["model.type=titans", "model.titans.memory_heads=3"], "model.titans.memory_heads"),  # 512 % 3
    (["model.type=titans", "model.titans.memory_depth=0"], "model.titans.memory_depth"),
    (["model.type=titans", "model.titans.memory_chunk_size=0"], "model.titans.memory_chunk_size"),
    (["model.type=titans", "model.titans.segment_len=0"], "model.titans.segment_len"),
    (["model.type=titans", "model.titans.window=0"], "model.titans.window"),
    (["model.type=titans", "model.titans.persistent_tokens=-1"], "model.titans.persistent_tokens"),
    (["model.type=titans", "model.titans.memory_init_lr=0.5"], "model.titans.memory_init_lr"),  # >= max_lr
    (["model.type=titans", "model.titans.windw=4"], "model.titans.windw"),  # unknown key
    (["model.titans.variant=mac"], "model.titans"),  # titans settings on a decoder
    (["model.type=mamba"], "model.type"),
])
def test_bad_titans_values_name_the_key(overrides, key):
    with pytest.raises(RecipeError, match=rf"^recipe error: {re.escape(key)}") as err:
        recipe_from_dict({}, overrides)
    assert err.value.key == key


# Paper sizes (Section 5.1) and the accepted band around each (the paper gives no shapes).
BIG = {
    "titans-170m-mac.yaml": ("mac", 170e6, 160e6, 190e6),
    "titans-340m-mac.yaml": ("mac", 340e6, 320e6, 360e6),
    "titans-400m-mag.yaml": ("mag", 400e6, 380e6, 420e6),
    "titans-760m-mal.yaml": ("mal", 760e6, 720e6, 800e6),
}


@pytest.mark.parametrize("name", sorted(BIG))
def test_paper_scale_recipes(name):
    variant, target, lo, hi = BIG[name]
    r = load_recipe(ROOT / "recipes" / name)
    with torch.device("meta"):
        model = build(r.model, r.memory)
    n = count_parameters(model)
    print(f"{name}: {n:,} parameters (paper: {target / 1e6:.0f}M)")
    assert isinstance(model, TitansLM) and r.model.titans.variant == variant
    assert lo <= n <= hi
    assert all(p.is_meta for p in model.parameters())
    # Section 5.1: 32K vocabulary, 4K training length, AdamW 4e-4 cosine, 0.5M-token batches, wd 0.1.
    assert r.model.vocab_size == 32000 and r.data.seq_len == 4096 and r.tokens_per_step == 2**19
    assert r.train.optimizer.name == "adamw" and r.train.optimizer.lr == 4e-4
    assert r.train.schedule.kind == "cosine" and r.train.optimizer.weight_decay == 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_recipes_reuse_quickstart_data(variant):
    r = load_recipe(ROOT / "recipes" / f"titans-cpu-{variant}.yaml")
    q = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert r.model.type == "titans" and r.model.titans.variant == variant
    assert r.to_dict()["data"] == q.to_dict()["data"] and r.run.seed == q.run.seed
    assert r.data.seq_len == 128 and r.model.vocab_size == 2048
    model = build(r.model)
    print(f"titans-cpu-{variant}: {count_parameters(model):,} parameters")


# --------------------------------------------------------------------------------------------------
# Forward contract


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("docs", [False, True])
def test_forward_shapes_and_memory_states(variant, docs):
    m = exact(variant)
    ids = tokens(B=3, T=37, eots=(5, 20))  # not a multiple of the segment length
    out = m(ids, document_ids(ids, EOT) if docs else None)
    assert isinstance(out, ModelOutput) and out.aux_loss is None
    assert out.logits.shape == (3, 37, VOCAB) and out.logits.dtype == torch.float64
    assert torch.isfinite(out.logits).all()
    assert len(out.memory) == 2
    # MAC writes the attention outputs (37 tokens); the others write P || x (3 + 37).
    assert all(s.pos == (37 if variant == "mac" else 37 + NP) for s in out.memory)


def test_bad_inputs_are_rejected():
    m = exact("mac")
    with pytest.raises(ValueError, match="max_seq_len"):
        m(tokens(T=65))
    with pytest.raises(ValueError, match="doc_ids shape"):
        m(tokens(), torch.zeros(2, 39, dtype=torch.long))
    with pytest.raises(ValueError, match="memory must be"):
        m(tokens(), memory=[None])
    # No tokens, and a carried memory of another batch size: one clear ValueError each (for MAC an IndexError
    # from its segment loop and a shape mismatch deep inside the memory until 2026-11-30).
    for variant in VARIANTS:
        m = exact(variant)
        with pytest.raises(ValueError, match=r"input_ids has no tokens \(shape \[batch, 0\]\)"):
            m(tokens(T=0))
        with torch.no_grad():
            state = m(tokens(B=2, T=5)).memory
        with pytest.raises(ValueError, match="memory holds the state of 2 sequence.s., input_ids has 1"):
            m(tokens(B=1, T=5), memory=state)


# --------------------------------------------------------------------------------------------------
# Causality


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("docs", [False, True])
def test_causal(variant, docs):
    """A changed token leaves every earlier logit unchanged and changes its own. For MAC, 13 lies
    inside segment [8, 16) (a leak through the segment's retrieved tokens h_t or attention would show
    at 8..12), 16 starts a segment and 29 lies in a later segment."""
    m = exact(variant)
    ids = tokens(eots=(5, 18) if docs else ())
    base = logits(m, ids, docs)
    for p in (1, 13, 16, 29):
        new = logits(m, changed(ids, p), docs)
        torch.testing.assert_close(new[:, :p], base[:, :p], **TIGHT)
        assert not torch.allclose(new[:, p], base[:, p], rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["mac", "mag", "mal"])
def test_attention_is_segment_local_or_windowed_and_memory_reaches_beyond(variant):
    """Token 2 reaches position 39 (past every segment / window, two layers) only through the
    neural memory: with the memories' outputs zeroed, it no longer does."""
    m = exact(variant)
    ids = tokens()
    far = lambda model: (logits(model, changed(ids, 2))[:, 39] - logits(model, ids)[:, 39]).abs().max()  # noqa: E731
    assert far(m) > 1e-6
    with torch.no_grad():
        for b in m.blocks:
            b.memory.to_out.weight.zero_()
    assert far(m) < 1e-12
    near = (logits(m, changed(ids, 36))[:, 39] - logits(m, ids)[:, 39]).abs().max()
    assert near > 1e-6  # attention still works within the segment / window


@pytest.mark.parametrize("variant", ["mac", "mag", "mal"])
def test_attention_never_crosses_documents(variant):
    """With the memories silenced (they are not reset at document boundaries), a change in document 0
    leaves documents 1 and 2 untouched; without documents it would reach them."""
    m = exact(variant)
    with torch.no_grad():
        for b in m.blocks:
            b.memory.to_out.weight.zero_()
    ids = tokens(eots=(9, 12))
    new, base = logits(m, changed(ids, 8), docs=True), logits(m, ids, docs=True)
    torch.testing.assert_close(new[:, 10:], base[:, 10:], **TIGHT)
    assert not torch.allclose(logits(m, changed(ids, 8))[:, 10:13], logits(m, ids)[:, 10:13], rtol=0, atol=1e-6)


def test_memory_is_not_reset_at_document_boundaries():
    """Documented behaviour: the neural memory carries information from one document into the next."""
    m = exact("lmm")
    ids = tokens(eots=(9,))
    new, base = logits(m, changed(ids, 3), docs=True), logits(m, ids, docs=True)
    assert not torch.allclose(new[:, 20:], base[:, 20:], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# MAC: retrieval before the segment, update with the attention output, carried state


def test_mac_retrieves_with_the_memory_before_each_segment():
    m = exact("mac")
    mem = m.blocks[0].memory
    read, write = mem.read, mem.write
    reads, writes = [], []

    def spy_read(q, state=None, dtype=None):
        out = read(q, state, dtype)
        reads.append((q, state, out))
        return out

    def spy_write(x, state=None, algorithm="chunked", proj=None):
        out, new = write(x, state, algorithm, proj)
        writes.append((x, state, new))
        return out, new

    mem.read, mem.write = spy_read, spy_write
    ids = tokens(T=37)
    with torch.no_grad():
        m(ids)
        n = len(segment_bounds(37, SEG))
        assert len(reads) == len(writes) == n == 5
        # Segment 0 reads the initial memory (the learned initial weights).
        q0, s0, h0 = reads[0]
        assert s0 is None
        torch.testing.assert_close(h0, read(q0, mem.init_state(2)), **TIGHT)
        for t in range(1, n):
            q, state, h = reads[t]
            # ...segment t reads the memory after segment t-1's write, i.e. before its own write.
            assert state is writes[t - 1][2] and writes[t][1] is state
            assert state.pos == sum(b - a for a, b in segment_bounds(37, SEG)[:t])
            assert not torch.allclose(h, read(q, None), rtol=0, atol=1e-6)  # the memory did learn
        # Segment t's queries are its own tokens' (the convolution restarts at the segment start).
        u = m.blocks[0].norm1(m.embed(ids))
        for (a, b), (q, _, _) in zip(segment_bounds(37, SEG), reads):
            torch.testing.assert_close(q, mem.segment_queries(u[:, a:b], b - a), **TIGHT)
        # The memory is written with the attention outputs (d_model rows, one per segment token).
        assert [w[0].shape[1] for w in writes] == [b - a for a, b in segment_bounds(37, SEG)]
        assert writes[0][1] is None


def _mac_per_segment(block, x, ctx, state):
    """MAC as the module docstring writes it, one segment at a time through the public calls
    (``retrieve``, the memory's forward, ``PrefixAttention.forward``): the reference for the block's
    hoisted form."""
    p = block._prefix(x)
    u = block.norm1(x)
    pn = None if p is None else block.norm1(p)
    ys, ms = [], []
    for (a, b), mask in zip(ctx.segments, ctx.segment_masks):
        s = u[:, a:b]
        h = block.memory.retrieve(s, state)
        kv = torch.cat([h, s], dim=1) if pn is None else torch.cat([pn, h, s], dim=1)
        cos, sin = ctx.cos[:, a:b], ctx.sin[:, a:b]
        y = block.attn(s, kv, cos, sin, torch.cat([cos, cos], 1), torch.cat([sin, sin], 1), block.n_persistent, mask)
        m, state = block.memory(y, state)
        ys.append(y)
        ms.append(m)
    return x + block.gate(torch.cat(ys, dim=1), torch.cat(ms, dim=1)), state


@pytest.mark.parametrize("T, np_, docs, carried, compiled", [(37, NP, False, False, False), (40, 0, True, False, False),
                                                          (21, NP, True, True, False), (37, NP, True, True, True)])
def test_mac_block_is_the_per_segment_computation(T, np_, docs, carried, compiled):
    """The MAC block computes the memory's queries and output gate, the attention's queries and the segments'
    own keys and values once for all segments, and (unless its blocks are compiled: ``compiled``, run eagerly
    here) the write's output stage once after them: outputs, the carried state and every gradient equal the
    per-segment reference in float64 (full segments and a short last one, with and without persistent tokens
    and documents, from a fresh and from a carried state)."""
    m = exact("mac", titans={"persistent_tokens": np_})
    for b in m.blocks:
        b.compiled = compiled
    ids = tokens(T=T, eots=(5, 17) if docs else ())
    doc_ids = document_ids(ids, EOT) if docs else None
    block, ctx = m.blocks[0], m._context(ids, doc_ids)
    state = None
    if carried:
        with torch.no_grad():
            _, state = block(m.embed(tokens(T=16, seed=5)), m._context(tokens(T=16, seed=5), None), None)
    x = m.embed(ids).detach().requires_grad_(True)
    params = [p for p in block.parameters()]
    results = []
    for run in (lambda: block._mac(x, ctx, state), lambda: _mac_per_segment(block, x, ctx, state)):
        out, new = run()
        loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).square().sum() + \
            sum(w.square().sum() for w in new.weights) + sum(s.sum() for s in new.momentum)
        grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
        results.append((out, new, grads))
    (out, new, grads), (ref, ref_new, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert new.pos == ref_new.pos
    for a, b in zip([*new.weights, *new.momentum, new.conv_cache], [*ref_new.weights, *ref_new.momentum,
                                                                    ref_new.conv_cache]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    names = ["x", *(n for n, _ in block.named_parameters())]
    for name, g, r in zip(names, grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("recompute, norm", [(False, "layernorm"), (True, "layernorm"), (False, "rmsnorm"),
                                             (True, "rmsnorm")])
def test_mac_computes_each_per_segment_weight_gradient_once(monkeypatch, recompute, norm, op_names):
    """Eagerly, MAC's per-segment projections (the memory's ``to_qkv`` and ``to_gates`` stacked, with the gates'
    bias, and ``to_out``; the attention's stacked ``wk``/``wv`` and ``wo``) get their weight gradients from one GEMM
    each over all segments' rows (:mod:`memtrain.model.grouped_linear`): every gradient of a two-block model
    equals autograd's per-use sums in float64, with the blocks recomputed in backward or not, and the backward runs
    one weight-gradient GEMM per projection and block instead of one per use: ``uses - 1`` fewer, ``segments - 1``
    for each of the four, one more for ``to_out`` (the final output stage) and two more for ``wkv`` (the segments'
    own and the persistent tokens' keys and values). What each segment uses whole (the persistent tokens' keys and
    values, the memory's convolution and ``out_norm``, and with ``rmsnorm`` the key norm's gain) reaches it through
    :func:`~memtrain.model.grouped_linear.fan_out`, also undone in the reference run."""
    from memtrain.model.titans import arch, memory

    ids = tokens(T=37)
    n_seg = len(segment_bounds(37, SEG))
    runs = []
    for grouped in (True, False):
        if not grouped:  # the plain projection wherever a group would be made
            plain = lambda w, b=None, enabled=True: (lambda x: F.linear(x, w, b))  # noqa: E731
            monkeypatch.setattr(arch, "grouped_linear", plain)
            monkeypatch.setattr(memory, "grouped_linear", plain)
            same = lambda x, n, enabled=True: (x,) * n  # noqa: E731
            monkeypatch.setattr(arch, "fan_out", same)
            monkeypatch.setattr(memory, "fan_out", same)
        m = exact("mac", n_layers=2, norm=norm)
        m.set_activation_checkpointing(recompute)
        m.train()
        loss = m(ids, labels=ids.roll(-1, 1)).loss_sum
        with op_names() as ops:
            grads = torch.autograd.grad(loss, list(m.parameters()))
        runs.append((grads, sum(name in ("mm", "addmm") for name in ops.names)))
    (grads, mms), (ref, ref_mms) = runs
    for (name, _), g, r in zip(m.named_parameters(), grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)
    assert ref_mms - mms == 2 * (4 * (n_seg - 1) + 1 + 2), (mms, ref_mms)


@pytest.mark.parametrize("variant, split", [("mac", 16), ("mac", 24), ("lmm", 13)])
def test_carried_memory_continues_the_sequence(variant, split):
    """MAC split on a segment boundary (and LMM anywhere) with the memory states carried equals one pass."""
    m = exact(variant)
    ids = tokens()
    full = logits(m, ids)
    with torch.no_grad():
        first = m(ids[:, :split])
        second = m(ids[:, split:], memory=first.memory)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------------------------------
# Masks


@pytest.mark.parametrize("variant", ["mac", "mag"])
def test_the_layers_attentions_keep_one_converted_mask(variant):
    """Every attention of a forward (each block's, and each MAC segment's) reaches SDPA with the same additive
    mask, converted once from the forward's boolean one; SDPA, given the boolean mask, converted and saved its
    own copy for the backward per call (16 for 2 MAC blocks of 8 segments here: one storage now)."""
    torch.manual_seed(0)
    model = build(tiny(variant, n_layers=3))
    ids = tokens(T=64)
    storages, saved = set(), []

    def pack(t):
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[-1] in (NP + t.shape[-2], NP + 2 * t.shape[-2]):  # masks
            saved.append(tuple(t.shape))
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids.roll(-1, 1)).loss_sum.backward()
    calls = 3 * (64 // SEG) if variant == "mac" else 3
    assert len(saved) == calls and len(storages) == 1, (saved, len(storages))


def test_mac_projects_keys_and_values_with_one_stacked_weight():
    """MAC's keys and values (the segments', the persistent tokens', each segment's retrieved rows) come from one
    GEMM with ``wk`` and ``wv`` stacked (``kv_weight``, built once per block forward): the same keys, values and
    gradients of both weights as the two projections, in float64."""
    from memtrain.model.titans.attention import PrefixAttention

    torch.manual_seed(0)
    model = build(tiny("mac", n_layers=2)).double()
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, attn.wk.in_features, dtype=torch.float64)
    cos, sin = model.rope(torch.arange(7).expand(2, 7))
    cos, sin = cos.double(), sin.double()
    per = [attn.keys_values(x, cos, sin), attn.keys_values(x, cos, sin, lambda r: F.linear(r, attn.kv_weight()))]
    for a, b in zip(*per):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(sum((t * t).sum() for t in kv), [attn.wk.weight, attn.wv.weight]) for kv in per]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    calls = []
    stacked = PrefixAttention.kv_weight
    PrefixAttention.kv_weight = lambda self: calls.append(self) or stacked(self)
    try:
        model(tokens(T=64))
    finally:
        PrefixAttention.kv_weight = stacked
    assert calls == [b.attn for b in model.blocks]  # once per block forward, not per segment


def test_mask_builders_against_brute_force():
    T, W, P = 11, 4, 2
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]])
    allowed = window_allowed(doc, T, W, torch.device("cpu"))[0]
    for i in range(T):
        for j in range(T):
            assert bool(allowed[i, j]) == (j <= i and i - j < W and doc[0, i] == doc[0, j])
    dense = sliding_window_mask(doc, T, P, W, "sdpa", torch.device("cpu")).dense
    assert dense.shape == (1, 1, T, P + T) and dense[..., :P].all()
    assert torch.equal(dense[0, 0, :, P:], allowed)
    seg = segment_mask(doc[:, :6], 6, P, torch.device("cpu")).dense[0, 0]
    causal_doc = window_allowed(doc[:, :6], 6, None, torch.device("cpu"))[0]
    assert seg.shape == (6, P + 12) and seg[:, :P].all()
    assert torch.equal(seg[:, P:P + 6], causal_doc) and torch.equal(seg[:, P + 6:], causal_doc)


@pytest.mark.parametrize("variant", ["mag", "mal"])
def test_sdpa_and_flex_agree(variant):
    ids = tokens(eots=(7, 30))
    ref = logits(exact(variant), ids, docs=True)
    with torch.no_grad():  # eager flex on CPU runs without gradients only
        out = logits(exact(variant, attention="flex"), ids, docs=True)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Training


def test_activation_checkpointing_same_loss_and_grads():
    ids = tokens(T=24)
    grads = []
    for ckpt in (False, True):
        m = exact("mac").train()
        m.set_activation_checkpointing(ckpt)
        loss = F.cross_entropy(m(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains(variant):
    """A plain AdamW loop on a fixed batch of periodic sequences: the loss must fall well below its start."""
    torch.manual_seed(0)
    m = build(tiny(variant)).train()
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(1, VOCAB, (4, 7), generator=g)
    ids = pattern.repeat(1, 6)[:, :41]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(m(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


@pytest.mark.slow
def test_titans_cpu_mac_recipe_end_to_end(tmp_path):
    """recipes/titans-cpu-mac.yaml through the real CLI (prepare + train, DeepSpeed) for 4 steps."""
    recipe = str(ROOT / "recipes" / "titans-cpu-mac.yaml")
    short = ["data.dir=data", "run.dir=run", "train.max_steps=4", "train.schedule.warmup=1 steps",
             "checkpoint.every_steps=4", "train.eval.every_steps=4", "logging.every_steps=1"]
    out = subprocess.run([sys.executable, "-m", "memtrain", "prepare", recipe, *short], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "memtrain", "train", recipe, *short], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "1,789,104 parameters" in out.stdout and "step 4/4" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss/train"] < rows[0]["loss/train"], [r["loss/train"] for r in rows]
    assert "loss/val" in rows[-1]
    assert (tmp_path / "run" / "checkpoints" / "global_step4").is_dir()


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm"])
def test_start_of_run_line_names_the_length_the_variant_attends_over_and_the_key_it_ignores(variant):
    """A recipe copied across variants keeps the other variant's length key silently: the start-of-run line (and
    `memtrain recipe show`) says which one this variant reads and that the other is not used."""
    from memtrain.config import load_recipe
    from memtrain.launcher.cli import recipe_show

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "titans-cpu-mac.yaml",
                         [f"model.titans.variant={variant}", "model.titans.segment_len=24", "model.titans.window=40"])
    lines = [line for line in recipe_show(recipe, 1).splitlines() if line.startswith("titans ")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"titans {variant.upper()}: 4 blocks, ")
    if variant == "mac":
        assert "segments of 24 tokens (model.titans.segment_len; model.titans.window is not used by MAC)" in line
    elif variant == "lmm":
        assert "no attention (model.titans.window and segment_len are not used by LMM)" in line
    else:
        assert (f"sliding-window attention over 40 keys (model.titans.window; model.titans.segment_len is not used "
                f"by {variant.upper()})") in line
    assert "memory depth 2, 4 heads, chunks of 16 tokens, 4 persistent tokens" in line

