"""The FLOP estimates behind MFU (memtrain/model/flops.py) against counts that do not use them.

Two independent sources, per model (the anchor, and Titans LMM, MAC, MAG, MAL):

- hand counts for a very small configuration, derived in the comments from the architecture (which
  matmuls run for one token) and written as integer literals;
- ``torch.utils.flop_counter.FlopCounterMode`` over a real forward and backward of a slightly larger
  model. It counts the matmul-like ops (mm, addmm, bmm, baddbmm, the fused attention kernels it knows,
  convolutions) at 2 FLOPs per multiply-add, and nothing elementwise (norms, RoPE, softmax, SiLU,
  gates, the inner loop's momentum and decay updates, the loss) -- neither do the estimates.

What the counter cannot see, or sees differently, and how the tests deal with it:

- the CPU's fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu``) is not in the
  counter's registry and counts 0. Under ``sdpa_kernel(MATH)`` attention runs as visible matmuls
  over the dense ``[T, prefix + T]`` score matrix, so (count with MATH) - (count fused) is exactly the
  attention's FLOPs. Dense is what the estimates assume (PaLM: no causal halving); for MAG / MAL the
  estimate's context is ``window + N_p`` keys per query, so that count is taken at ``T = window``;
- convolutions are left out: the counter's ``convolution_backward`` counts the input gradient of the
  memory's depthwise (grouped) convolution as if it were dense (x channels), and the estimate does not
  count that convolution (3 * inner * kernel weights, 0.1% of a block's at the 170M scale);
- the inner loop runs its per-token reference (``algorithm="sequential"``): the recurrences as
  written, i.e. the model FLOPs. The chunk-parallel form does the same math with more matmuls (the
  read is split into decayed-weights and momentum products plus intra-chunk mixing, and the weights
  are materialised at each chunk end) -- hardware FLOPs, not what MFU counts;
- per-sequence work (the persistent tokens written into the memory, their keys and values in
  MAG / MAL) is not per token: it cancels in the marginal cost ``(C(2T) - C(T)) / T``. MAC recomputes
  the persistent tokens' keys and values in every segment (input-independent, so an implementation
  detail); that is subtracted, derived by hand below.

With those, estimate and count agree exactly (up to float rounding of per-token divisions).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from memtrain.config import ModelConfig, TitansConfig
from memtrain.model import build, flops_per_token
from memtrain.model.flops import titans_flops_per_token
from memtrain.model.titans.memory import NeuralMemory

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = ("lmm", "mac", "mag", "mal")
EXACT = 1e-12  # relative: both sides are integers, only per-token divisions round


# --------------------------------------------------------------------------------------------------
# Counting


def _count(model: torch.nn.Module, seq_len: int, visible_attention: bool = True) -> int:
    """FLOPs the counter sees in one forward + backward of one sequence of ``seq_len`` tokens
    (convolutions left out, see the module docstring). ``visible_attention=False`` keeps the CPU's
    fused sdpa kernel, which the counter does not see."""
    ids = torch.randint(1, model.cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    backend = sdpa_kernel(SDPBackend.MATH) if visible_attention else contextlib.nullcontext()
    counter = FlopCounterMode(display=False)
    with backend, counter:
        model(ids).logits.float().sum().backward()
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if "convolution" not in str(op))


def _sequential(model: torch.nn.Module) -> torch.nn.Module:
    """Run every memory's per-token reference loop (the model FLOPs; module docstring)."""
    for m in model.modules():
        if isinstance(m, NeuralMemory):
            # every write (MAC calls write directly; MAG / MAL / LMM through forward), whatever it asks for
            m.write = lambda x, state=None, algorithm=None, m=m, **kw: NeuralMemory.write(m, x, state, "sequential",
                                                                                      **kw)
    return model


def _titans(variant: str, **titans) -> ModelConfig:
    return ModelConfig(type="titans", vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16,
                       max_seq_len=64, attention="sdpa", titans=TitansConfig(variant=variant, **titans))


# --------------------------------------------------------------------------------------------------
# Hand counts


def test_anchor_flops_match_hand_count():
    """Independent source: matmuls counted by hand below (literals). Tolerance: none (integers).

    V=10, d=8, L=2, H=2, head_dim=6 (attention width 12 != d), one key/value head, ffn 16, T=8.
    Forward matmuls per token, 2 FLOPs per weight: per layer wq 8x12 = 96, wk 8x6 = 48, wv 48,
    wo 12x8 = 96, SwiGLU 3 x 8x16 = 384: 672 weights; head 8x10 = 80 (a matmul even when tied).
    2 x (2 x 672 + 80) = 2848. Attention per layer: QK^T and AV over all T=8 keys (dense, as PaLM
    counts: no causal halving), 2 x 2 x H x head_dim x T = 4 x 12 x 8 = 384; two layers 768.
    Forward 3616; backward twice the forward (input and weight gradients): 3 x 3616 = 10848.
    """
    cfg = ModelConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=6, ffn_dim=16)
    assert flops_per_token(cfg, 8) == 10848
    assert flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), 8) == 10848
    # The attention term alone grows with the context: 4 x 12 x 2 layers x 3 (fwd + bwd) = 288 per key.
    assert flops_per_token(cfg, 16) - flops_per_token(cfg, 8) == 8 * 288


# Shared shape of the Titans hand counts: V=10, d=8, 2 layers; attention H=2, head_dim 4, one key/value
# head; memory 2 heads of 4, depth 2, expansion 2 (hidden 8); N_p=2, segment 4, window 3; ffn 16.
# Weights per layer (forward: 2 FLOPs each per token):
#   memory to_qkv 8x24 = 192, to_gates 8x6 = 48, to_out_gate 8x8 = 64, to_out 8x8 = 64   -> 368
#   SwiGLU 3 x 8x16                                                                        -> 384
#   attention wq 8x8 = 64, wk 8x4 = 32, wv 32, wo 8x8 = 64 (MAC, MAG, MAL)                -> 192
#   gate W_g 8x8 (MAC, MAG)                                                                 ->  64
# head 8x10 = 80. Memory MLP per head W1 8x4 + W2 4x8 = 64 weights, P = 128 per layer (P_1 = 64).
# Inner loop per token and layer, forward (the per-token recurrence, inner_loop._sequential):
#   loss forward M(k) 2P = 256, deltas back through W2 2 x 64 = 128 (none through W1: k needs no
#   gradient), weight gradients (outer products) 2P = 256, read M_t(q) 2P = 256           -> 896
# Attention per token and layer, forward: QK^T and AV over C keys, 2 x 2 x H x head_dim x C = 32 C;
# C = window + N_p = 5 (MAG, MAL: 160), 2 x segment + N_p = 10 (MAC: 320).
# Training = 3 x forward (backward: input and weight gradient of each matmul).
HAND = {
    # linear 2 x (368 + 384) + 80 = 1584 -> 3168; inner 2 x 896 = 1792. 3 x 4960
    "lmm": 14880,
    # linear 2 x (368 + 384 + 192 + 64) + 80 = 2096 -> 4192; attention 2 x 160; inner 1792. 3 x 6304
    "mag": 18912,
    # linear 2 x (368 + 384 + 192) + 80 = 1968 -> 3936; attention 320; inner 1792. 3 x 6048
    "mal": 18144,
    # as MAG's linears (4192), plus per layer the read before the segment (eq. 21): the query third of
    # to_qkv 64, to_out_gate 64, to_out 64, the MLP forward 2P = 256, and the read tokens' keys and
    # values wk + wv = 64: 2 x (2 x 256 + 256) = 1536; attention 2 x 320 = 640; inner 1792. 3 x 8160
    "mac": 24480,
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_titans_flops_match_hand_count(variant):
    """Independent source: the matmuls of one token counted by hand (comment above HAND), integer
    literals. Tolerance: none (integers)."""
    cfg = _titans(variant, memory_heads=2, memory_head_dim=4, memory_depth=2, expansion=2.0, persistent_tokens=2,
                  segment_len=4, window=3)
    torch.manual_seed(0)
    assert titans_flops_per_token(build(cfg), cfg) == HAND[variant]


# --------------------------------------------------------------------------------------------------
# FlopCounterMode


def test_anchor_flops_match_flop_counter():
    """Independent source: FlopCounterMode over a forward and backward (attention as visible MATH-sdpa
    matmuls over the full T x T scores, which is what the estimate counts). Tolerance: exact -- every
    counted op is a Linear or one of the two attention products, and what the counter skips
    (norms, RoPE, softmax, SiLU, the loss) the estimate skips too."""
    cfg = ModelConfig(vocab_size=37, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=10, ffn_dim=40,
                      max_seq_len=32, attention="sdpa")
    torch.manual_seed(0)
    model = build(cfg)
    T = 24
    counted = _count(model, T)
    assert counted / T == pytest.approx(flops_per_token(cfg, T), rel=EXACT)
    assert counted / T == pytest.approx(flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), T), rel=EXACT)


# Counter configurations: widths that differ from each other and from d_model (attention 4 x 10 with 2
# key/value heads, memory 2 heads of 12), a different memory depth per variant (the P_1 term), segment
# 8, window 12 and N_p = 3 all distinct so that a context built from the wrong one shows.
COUNTER = dict(vocab_size=37, d_model=24, n_heads=4, n_kv_heads=2, head_dim=10, ffn_dim=40)
SEG, WINDOW, NP = 8, 12, 3
DEPTH = {"lmm": 1, "mac": 2, "mag": 3, "mal": 2}


@pytest.mark.parametrize("variant", VARIANTS)
def test_titans_flops_match_flop_counter(variant):
    """Independent source: FlopCounterMode over forwards and backwards of the model with its inner loop
    run as the per-token reference. Per token: attention = (MATH count - fused count) / T at T = window
    (MAG / MAL: then every query's dense keys are window + N_p, the estimate's context) or T = 2
    segments (MAC); the rest = the marginal fused count (C(2T) - C(T)) / T, so per-sequence
    persistent-token work cancels; MAC's per-segment recomputation of the persistent keys and values
    is subtracted (hand-derived). Tolerance: exact (see the module docstring for what is excluded
    and why)."""
    cfg = dataclasses.replace(_titans(variant, memory_heads=2, memory_head_dim=12, memory_depth=DEPTH[variant],
                                      memory_chunk_size=4, persistent_tokens=NP, segment_len=SEG, window=WINDOW),
                              **COUNTER)
    torch.manual_seed(0)
    model = _sequential(build(cfg))
    T = 2 * SEG if variant == "mac" else WINDOW
    fused = _count(model, T, visible_attention=False)
    attention = (_count(model, T) - fused) / T
    rest = (_count(model, 2 * T, visible_attention=False) - fused) / T
    # (MAC projects the N_p persistent rows through wk and wv once per block and call, for all its segments:
    # the same in the T and 2T counts, so their difference `rest` holds none of it.)
    if variant == "lmm":
        assert attention == 0
    else:
        assert attention > 0  # the MATH path made the attention visible
    estimate = titans_flops_per_token(model, cfg)
    no_context = dataclasses.replace(cfg, titans=dataclasses.replace(cfg.titans, segment_len=0, window=0,
                                                                       persistent_tokens=0))
    # The estimate's attention term (the only part that depends on the context) against the counted one...
    assert estimate - titans_flops_per_token(model, no_context) == pytest.approx(attention, rel=EXACT)
    # ...and the whole estimate against the whole count.
    assert estimate == pytest.approx(attention + rest, rel=EXACT)


# --------------------------------------------------------------------------------------------------
# Cross-attention memory layers (memtrain.model.flops.crossattn_flops_per_token)


def _crossattn_model(crossattn: dict, **model):
    from memtrain.config import CrossAttnConfig, MemoryConfig

    cfg = ModelConfig(**{**dict(vocab_size=37, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=10,
                                ffn_dim=40, max_seq_len=32, attention="sdpa"), **model})
    torch.manual_seed(0)
    return cfg, build(cfg, MemoryConfig(type="crossattn", crossattn=CrossAttnConfig(**crossattn)))


def test_crossattn_flops_match_hand_count():
    """Independent source: one memory layer (decoder layer 1) of width 8 (2 heads of 4) on d = 8, a bank of
    6 tokens, T = 3 tokens per forward. Per token, forward x 3 for training:
    W_Q 8x8 + W_O 8x8 = 128 weights -> 6 x 128 = 768; attention over the 6 keys 12 x 6 x 8 = 576; the
    bank's keys and values once per forward, W_K + W_V = 128 weights x 6 tokens / 3 tokens -> 6 x 256 =
    1536. Unrouted variant A: 2880. Variant B adds its SwiGLU 3 x 8x16 = 384 weights: + 2304 = 5184.
    Token routing to all 3 chapters of 2 tokens (k = C, so every chapter is projected): the same 6 keys,
    plus the router 8x3 = 24 weights: + 144 = 3024; sequence routing runs the router once per sequence
    of 3: + 48 = 2928."""
    from memtrain.model.flops import crossattn_flops_per_token

    small = dict(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16)
    base = dict(tokens=6, layers=[1])
    for extra, want in (({}, 2880), ({"variant": "B"}, 5184),
                        ({"chapters": 3, "top_k": 3, "routing": "token"}, 3024),
                        ({"chapters": 3, "top_k": 3, "routing": "sequence"}, 2928)):
        _, model = _crossattn_model({**base, **extra}, **small)
        assert crossattn_flops_per_token(model.crossattn, batch=1, seq_len=3) == pytest.approx(want, rel=EXACT)


@pytest.mark.parametrize("crossattn", [
    {"tokens": 18, "placement": "every", "placement_k": 1, "heads": 3, "dim": 12},
    {"tokens": 18, "chapters": 6, "top_k": 6, "routing": "token", "variant": "B", "shared": True},
    {"tokens": 18, "chapters": 3, "top_k": 3, "routing": "sequence", "bank_rank": 4, "proj_rank": 5},
], ids=["unrouted-reduced-dim", "token-routed-variant-B", "sequence-routed-lowrank"])
def test_crossattn_flops_match_flop_counter(crossattn):
    """Independent source: FlopCounterMode over a forward and backward of the model with memory layers
    minus the same anchor without them (attention as visible MATH-sdpa or einsum matmuls). Routing picks
    every chapter (k = C), so the chapters projected per forward are known exactly. Tolerance: exact."""
    from memtrain.model.flops import crossattn_flops_per_token

    T = 20
    cfg, model = _crossattn_model(crossattn)
    torch.manual_seed(0)
    anchor = build(cfg)
    counted = (_count(model, T) - _count(anchor, T)) / T
    assert counted == pytest.approx(crossattn_flops_per_token(model.crossattn, batch=1, seq_len=T), rel=EXACT)
