"""The anchor model: paper parameter counts, document masking, attention paths, init, FLOPs,
activation checkpointing. CPU-only, tiny configurations (the paper models only on the meta device)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtrain.config import MemoryConfig, ModelConfig, load_recipe
from memtrain.data.loader import document_ids
from memtrain.model import (
    DecoderLM, ModelOutput, build, count_parameters, flops_per_token, peak_flops, position_ids_from_doc_ids,
)
from memtrain.model.attention import AttentionMask, attend, build_attention_mask, flex_available
from memtrain.model.flops import peak_flops_from_name

# Eager flex attention on CPU is deliberate here (a numerical check, not a fast path).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ROOT = Path(__file__).resolve().parents[1]
EOT = 0


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, head_dim=8, ffn_dim=64, max_seq_len=64,
                attention="sdpa", tie_embeddings=False)
    base.update(overrides)
    return ModelConfig(**base)


def seeded(cfg: ModelConfig, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return build(cfg).eval()


def exact(cfg: ModelConfig, seed: int = 0) -> DecoderLM:
    """A float64 model: invariance tests then hold to 1e-9 (float32 rounding alone reaches ~1e-6 when
    the same document is computed inside a differently shaped batch)."""
    return seeded(cfg, seed).double()


TIGHT = dict(rtol=0, atol=1e-9)


def packed(lengths: list[int], seed: int = 1, vocab: int = 97) -> torch.Tensor:
    """One sequence of documents with the given lengths, each ending in EOT: [1, sum(lengths)]."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        doc = torch.randint(1, vocab, (n,), generator=g)
        doc[-1] = EOT
        docs.append(doc)
    return torch.cat(docs)[None]


def logits(model: DecoderLM, ids: torch.Tensor, docs: bool = True) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, document_ids(ids, EOT) if docs else None).logits


# --------------------------------------------------------------------------------------------------
# The paper's models (Appendix A.1, Tables 6-8)


@pytest.mark.parametrize("recipe, expected", [
    ("openlm-160m.yaml", 163_510_016),
    ("openlm-410m.yaml", 411_665_408),
    ("openlm-1b.yaml", 1_439_893_504),
])
def test_paper_parameter_counts(recipe, expected):
    recipe = load_recipe(ROOT / "recipes" / recipe)
    with torch.device("meta"):
        model = build(recipe.model, recipe.memory)
    assert count_parameters(model) == expected
    assert all(p.is_meta for p in model.parameters())


def test_import_is_light():
    code = ("import sys, memtrain.model; heavy = [m for m in ('deepspeed', 'streaming', 'transformers', "
            "'sentence_transformers') if m in sys.modules]; print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------
# Packed sequences


def test_document_and_position_ids():
    ids = torch.tensor([[5, 6, EOT, 7, EOT, 8, 9, 3], [EOT, 1, 2, 3, 4, EOT, EOT, 5]])
    docs = document_ids(ids, EOT)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]]
    assert position_ids_from_doc_ids(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 0]]
    assert position_ids_from_doc_ids(docs[0]).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # unbatched too


def test_document_masking_same_length_change():
    model = exact(tiny())
    ids = packed([7, 9, 8])
    changed = ids.clone()
    changed[0, 7:15] = (changed[0, 7:15] + 11) % 96 + 1  # new tokens for document 2, EOT kept
    a, b = logits(model, ids), logits(model, changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], **TIGHT)
    torch.testing.assert_close(a[:, 16:], b[:, 16:], **TIGHT)
    assert not torch.allclose(a[:, 7:16], b[:, 7:16], atol=1e-3)  # document 2 itself did change
    # Without the document mask the later document would see the change.
    assert not torch.allclose(logits(model, ids, docs=False)[:, 16:], logits(model, changed, docs=False)[:, 16:],
                              atol=1e-3)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_document_masking_shifted_boundary(attention):
    if attention == "flex":
        _require_flex()
    model = exact(tiny(attention=attention, reset_positions=True))
    doc1, doc2, doc3 = packed([7]), packed([9], seed=2), packed([8], seed=3)
    short2 = doc2[:, 3:]  # a 6-token document 2: document 3 moves 3 positions to the left
    a = logits(model, torch.cat([doc1, doc2, doc3], 1))
    b = logits(model, torch.cat([doc1, short2, doc3], 1))
    torch.testing.assert_close(a[:, :7], b[:, :7], **TIGHT)
    torch.testing.assert_close(a[:, 16:], b[:, 13:], **TIGHT)
    # The same document alone at offset 0 gives the same logits.
    torch.testing.assert_close(logits(model, doc3), a[:, 16:], **TIGHT)


@pytest.mark.parametrize("reset", [True, False])
def test_rope_positions_follow_reset_positions(reset):
    model = seeded(tiny(reset_positions=reset))
    seen = []
    model.rope.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    ids = packed([3, 4, 2])
    logits(model, ids)
    expected = [0, 1, 2, 0, 1, 2, 3, 0, 1] if reset else list(range(9))
    assert seen[0].expand(1, 9).tolist() == [expected]
    logits(model, ids, docs=False)  # no document ids: always 0..T-1
    assert seen[1].expand(1, 9).tolist() == [list(range(9))]


def test_causal():
    model = exact(tiny())
    ids = torch.randint(1, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] % 96) + 1
    for docs in (True, False):
        a, b = logits(model, ids, docs), logits(model, changed, docs)
        torch.testing.assert_close(a[:, :12], b[:, :12], **TIGHT)
        assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


# --------------------------------------------------------------------------------------------------
# Attention paths


def _require_flex():
    """flex attention is part of every supported torch (>= 2.5, setup.py): its absence fails, never skips.
    Its CPU path runs forward only; the model's checks run like this (backward is the GPU tier's)."""
    assert flex_available(), "torch.nn.attention.flex_attention is not importable: torch >= 2.5 is required"
    q = torch.randn(1, 1, 16, 8)
    with torch.no_grad():
        mask = build_attention_mask(None, 16, "flex", torch.device("cpu"))
        assert mask.backend == "flex"
        attend(q, q, q, mask)


def test_sdpa_and_flex_agree():
    _require_flex()
    ids = packed([5, 11, 8, 6])
    for kv in (4, 2):
        cfg = tiny(n_kv_heads=kv)
        sdpa = seeded(cfg)
        flex = DecoderLM(dataclasses.replace(cfg, attention="flex")).eval()
        flex.load_state_dict(sdpa.state_dict())
        for docs in (True, False):
            torch.testing.assert_close(logits(flex, ids, docs), logits(sdpa, ids, docs), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex attention has no backward on CPU")
def test_flex_on_cpu_with_gradients_uses_the_dense_path():
    _require_flex()
    cfg = tiny(n_kv_heads=2)
    sdpa = seeded(cfg).train()
    flex = DecoderLM(dataclasses.replace(cfg, attention="flex")).train()
    flex.load_state_dict(sdpa.state_dict())
    ids = packed([5, 11, 8])
    docs = document_ids(ids, EOT)
    flex(ids, docs).logits.square().mean().backward()
    sdpa(ids, docs).logits.square().mean().backward()
    for (name, a), b in zip(flex.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        assert build_attention_mask(docs, 24, "flex", ids.device).backend == "flex"
    assert build_attention_mask(docs, 24, "flex", ids.device).backend == "sdpa"


def test_dense_mask_equals_is_causal_for_one_document():
    model = seeded(tiny())
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    one_doc = torch.zeros_like(ids)
    with torch.no_grad():
        dense = model(ids, one_doc).logits
        causal = model(ids).logits
    torch.testing.assert_close(dense, causal, rtol=1e-5, atol=1e-5)
    # and the two paths really are different code: the mask object says which
    assert build_attention_mask(one_doc, 24, "sdpa", ids.device).dense is not None
    assert build_attention_mask(None, 24, "sdpa", ids.device).dense is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_mask_is_converted_once_and_gives_sdpas_own_result(dtype, op_names):
    """A dense boolean mask reaches SDPA as the additive mask SDPA itself would make of it (0 / -inf in the queries'
    dtype), converted on the first call and reused by later calls with the same mask object (every layer and MAC
    segment of a forward): outputs and gradients bitwise equal to SDPA given the boolean mask."""
    torch.manual_seed(0)
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    mask = build_attention_mask(doc, 9, "sdpa", torch.device("cpu"))
    assert mask.dense.dtype == torch.bool and not mask._additive
    for call in range(2):
        q, k, v = (torch.randn(2, 4, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
        gy = torch.randn(2, 4, 9, 8, dtype=dtype)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
        ref_grads = torch.autograd.grad(ref, (q, k, v), gy)
        with op_names() as ops:
            out = attend(q, k, v, mask)
        grads = torch.autograd.grad(out, (q, k, v), gy)
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        converted = {"masked_fill_", "where", "logical_not"} & set(ops.names)
        assert bool(converted) == (call == 0), (call, ops.names)
    additive = mask.sdpa_mask(dtype)
    assert additive.dtype == dtype and list(mask._additive) == [dtype]
    assert torch.equal(additive == 0, mask.dense) and torch.isinf(additive[~mask.dense]).all()


def test_auto_backend_is_sdpa_on_cpu():
    mask = build_attention_mask(torch.zeros(1, 8, dtype=torch.long), 8, "auto", torch.device("cpu"))
    assert isinstance(mask, AttentionMask) and mask.backend == "sdpa"


def test_grouped_query_attention_equals_repeated_heads():
    gqa = seeded(tiny(n_heads=4, n_kv_heads=2))
    mha = DecoderLM(tiny(n_heads=4, n_kv_heads=None)).eval()
    state = gqa.state_dict()
    for name, tensor in list(state.items()):
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # [kv*dh, d] -> [h*dh, d]
            state[name] = tensor.view(2, 8, -1).repeat_interleave(2, dim=0).reshape(32, -1)
        elif name.endswith("attn.k_norm.weight"):
            state[name] = tensor.view(2, 8).repeat_interleave(2, dim=0).reshape(32)
    mha.load_state_dict(state)
    assert gqa.blocks[0].attn.wk.weight.shape == (16, 32)
    ids = packed([9, 7, 8])
    for docs in (True, False):
        torch.testing.assert_close(logits(gqa, ids, docs), logits(mha, ids, docs), rtol=1e-5, atol=1e-5)


def test_head_dim_differs_from_d_model():
    model = seeded(tiny(d_model=40, n_heads=3, head_dim=8))  # attention width 24 != 40, like the 160M
    assert model.blocks[0].attn.wq.weight.shape == (24, 40)
    assert model.blocks[0].attn.q_norm.weight.shape == (24,)
    assert logits(model, packed([5, 6])).shape == (1, 11, 97)


def test_rmsnorm_and_no_qk_norm():
    model = seeded(tiny(norm="rmsnorm", qk_norm=False))
    assert type(model.norm).__name__ == "RMSNorm"
    assert isinstance(model.blocks[0].attn.q_norm, torch.nn.Identity)
    out = model(packed([4, 4]))
    assert isinstance(out, ModelOutput) and out.aux_loss is None and torch.isfinite(out.logits).all()


def _llama_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's formula (HF ``LlamaRMSNorm``): in fp32, rounded to the input's dtype, then times the gain."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def test_rmsnorm_is_llamas_formula_through_torchs_fused_op():
    """RMSNorm runs ``F.rms_norm`` (one fused kernel each way on CUDA) where input and gain share a dtype:
    bitwise Llama's formula in fp32 and float64, output and both gradients; within one bf16 rounding in bf16
    (the gain is applied before rounding); mixed dtypes (bf16 input, fp32 gain) keep the formula exactly."""
    from memtrain.model.anchor import RMSNorm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        norm = RMSNorm(48, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=gen))
        x = (3 * torch.randn(2, 5, 48, generator=gen)).to(dtype).requires_grad_(True)
        y, ref = norm(x), _llama_rmsnorm(x, norm.weight, 1e-5)
        g = torch.randn(y.shape, generator=gen).to(dtype)
        grads = torch.autograd.grad(y, (x, norm.weight), g)
        ref_grads = torch.autograd.grad(ref, (x, norm.weight), g)
        if dtype == torch.bfloat16:
            torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=0)
            torch.testing.assert_close(grads[0], ref_grads[0], rtol=2 ** -6, atol=2 ** -6)
        else:
            assert torch.equal(y, ref)
            assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    mixed = RMSNorm(48)
    x = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    out = mixed(x)
    assert out.dtype == torch.float32 and torch.equal(out, _llama_rmsnorm(x, mixed.weight, mixed.eps))


def test_memory_argument_and_bad_shapes_are_rejected():
    model = seeded(tiny(max_seq_len=16))
    with pytest.raises(ValueError, match="memory"):
        model(packed([4]), memory=object())
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="memory.levels must give one multiplier"):
        build(tiny(), MemoryConfig(type="lora"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Initialisation and parameter sharing


def test_seeded_init_is_reproducible():
    a, b, c = seeded(tiny(), 5), seeded(tiny(), 5), seeded(tiny(), 6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.weight"], sc["embed.weight"])
    assert not torch.equal(sa["blocks.1.ffn.w3.weight"], sc["blocks.1.ffn.w3.weight"])


def test_init_statistics():
    cfg = tiny(vocab_size=2000, d_model=64, n_heads=4, head_dim=12, ffn_dim=160, n_layers=3)
    model = seeded(cfg)
    trunc = 0.98658  # std of a unit normal truncated at +-3 sigma

    def check(weight, sigma):
        assert weight.std().item() == pytest.approx(trunc * sigma, rel=0.05)
        assert weight.abs().max().item() <= 3 * sigma + 1e-7
        assert abs(weight.mean().item()) < 0.1 * sigma

    check(model.embed.weight, 1 / math.sqrt(64))
    check(model.lm_head.weight, 1 / math.sqrt(64))
    for i, block in enumerate(model.blocks):
        depth = 1 / math.sqrt(2 * (i + 1))
        check(block.attn.wq.weight, 1 / math.sqrt(64))
        check(block.ffn.w1.weight, 1 / math.sqrt(64))
        check(block.attn.wo.weight, depth / math.sqrt(48))  # fan-in h*dh = 48, not d_model
        check(block.ffn.w3.weight, depth / math.sqrt(160))
        assert torch.equal(block.norm1.weight, torch.ones(64))
        assert torch.equal(block.attn.k_norm.weight, torch.ones(48))
    assert not torch.equal(model.embed.weight, model.lm_head.weight)

    override = seeded(dataclasses.replace(cfg, init_std=0.02))
    check(override.embed.weight, 0.02)


def test_tied_and_separate_heads():
    tied, separate = seeded(tiny(tie_embeddings=True)), seeded(tiny(tie_embeddings=False))
    assert tied.lm_head.weight is tied.embed.weight
    assert separate.lm_head.weight is not separate.embed.weight
    assert count_parameters(separate) - count_parameters(tied) == 97 * 32
    assert count_parameters(tied, include_embedding=False) == count_parameters(tied) - 97 * 32
    assert count_parameters(separate, include_embedding=False) == count_parameters(separate) - 97 * 32
    # a gradient step on the head moves the embedding of a tied model
    tied.train()
    tied(packed([6])).logits.sum().backward()
    assert tied.embed.weight.grad is tied.lm_head.weight.grad
    assert tied.embed.weight.grad[EOT].abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_per_token_by_hand():
    cfg = tiny(vocab_size=100, d_model=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=6, ffn_dim=40)
    per_layer = 16 * 24 + 2 * 16 * 12 + 24 * 16 + 3 * 16 * 40  # wq, wk+wv, wo, SwiGLU = 3072
    n_matmul = 3 * per_layer + 16 * 100  # + LM head = 10816
    assert flops_per_token(cfg, 128) == 6 * n_matmul + 12 * 3 * 4 * 6 * 128 == 175_488
    # tying does not remove the head matmul, and the model agrees with the config-only count
    assert flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), 128) == 175_488
    model = seeded(cfg)
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embed"))
    assert matrices == n_matmul


def test_peak_flops():
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops_from_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_from_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_from_name("NVIDIA H200") == 989e12
    assert peak_flops_from_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_from_name("NVIDIA A10G") == 125e12
    assert peak_flops_from_name("NVIDIA L4") == 121e12
    assert peak_flops_from_name("NVIDIA L40S") is None


# --------------------------------------------------------------------------------------------------
# Activation checkpointing


def test_activation_checkpointing_same_loss_and_grads():
    ids = packed([9, 8, 7])
    docs = document_ids(ids, EOT)

    def step(model):
        model.zero_grad()
        out = model(ids[:, :-1], docs[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), ids[0, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    model = seeded(tiny()).train()
    calls = []
    for block in model.blocks:  # wrap forward itself: torch skips module hooks when recomputing
        def counted(*args, _forward=block.forward):
            calls.append(1)
            return _forward(*args)
        block.forward = counted
    loss_plain, grads_plain = step(model)
    assert len(calls) == 2  # one forward per block
    model.set_activation_checkpointing(True)
    calls.clear()
    loss_ckpt, grads_ckpt = step(model)
    assert len(calls) == 4  # each block ran again in backward: it really was recomputed
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-6, atol=1e-7)
    # no recomputation in eval / no-grad
    calls.clear()
    model.eval()
    logits(model, ids)
    assert len(calls) == 2
