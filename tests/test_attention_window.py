"""Sliding-window attention of the decoder (``model.attention_window``; the SWA baseline of Titans
Section 5.2, Table 2): every backend against a float64 reference built from an explicit mask, the
receptive field of a windowed model, forward and greedy generation past ``model.max_seq_len``, and the
recipe errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from memtrain.config import ModelConfig, RecipeError, load_recipe
from memtrain.eval.longctx import greedy_generate, model_context
from memtrain.model import build
from memtrain.model.attention import attend, build_attention_mask, flex_available

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "reproduce-titans.yaml"


def reference(q, k, v, doc_ids, window):
    """Softmax attention in float64 with the mask written out: key s visible to query t iff s <= t,
    t - s < window and both lie in the same document."""
    B, H, T, D = q.shape
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    allowed = (s <= t) & (t - s < window)
    allowed = allowed[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [B, T, T]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v.double()


def inputs(B=2, H=2, T=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    doc_ids = torch.tensor([[0] * 9 + [1] * 15, [0] * T])[:B]
    return q, k, v, doc_ids


BACKENDS = ["sdpa"] + (["flex"] if flex_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 7])
@pytest.mark.parametrize("with_docs", [True, False])
def test_windowed_attention_matches_masked_reference(backend, window, with_docs):
    q, k, v, doc_ids = inputs()
    T = q.shape[2]
    docs = doc_ids if with_docs else None
    with torch.no_grad():  # flex has no CPU backward; without gradients it runs itself
        mask = build_attention_mask(docs, T, backend, torch.device("cpu"), window=window)
        assert mask.backend == backend
        out = attend(q, k, v, mask)
    ref = reference(q, k, v, doc_ids if with_docs else torch.zeros_like(doc_ids), window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    full = reference(q, k, v, doc_ids if with_docs else torch.zeros_like(doc_ids), T)
    assert (out - full).abs().max() > 1e-3  # the window really cut something


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_at_least_the_length_is_full_causal_attention(backend):
    q, k, v, doc_ids = inputs()
    T = q.shape[2]
    with torch.no_grad():
        for docs in (doc_ids, None):
            full = attend(q, k, v, build_attention_mask(docs, T, backend, torch.device("cpu")))
            for window in (T, T + 5):
                out = attend(q, k, v, build_attention_mask(docs, T, backend, torch.device("cpu"), window=window))
                torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    plain = build_attention_mask(None, T, "sdpa", torch.device("cpu"), window=T)
    assert plain.dense is None  # plain causal sdpa (FlashAttention on GPU) is kept


def windowed_model(window=4, n_layers=2, max_seq_len=16):
    cfg = ModelConfig(vocab_size=53, d_model=32, n_layers=n_layers, n_heads=4, head_dim=8, ffn_dim=64,
                      max_seq_len=max_seq_len, attention="sdpa", attention_window=window)
    torch.manual_seed(0)
    return build(cfg).eval().double()


def test_receptive_field_and_forward_past_max_seq_len():
    window, n_layers = 4, 2
    model = windowed_model(window, n_layers, max_seq_len=16)
    T, t = 40, 35  # T > max_seq_len: allowed for a windowed decoder
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 53, (1, T), generator=g)
    field = n_layers * (window - 1)  # position t sees t - field .. t through n_layers windows
    with torch.no_grad():
        base = model(ids).logits[0, t]
        far = ids.clone()
        far[0, : t - field] = (far[0, : t - field] % 52) + 1  # every token before the receptive field
        torch.testing.assert_close(model(far).logits[0, t], base, rtol=0, atol=1e-12)
        edge = ids.clone()
        edge[0, t - field] = edge[0, t - field] % 52 + 1  # the farthest token it can see
        assert (model(edge).logits[0, t] - base).abs().max() > 1e-6


def test_full_attention_model_still_refuses_long_inputs():
    cfg = ModelConfig(vocab_size=53, d_model=32, n_layers=1, n_heads=4, head_dim=8, ffn_dim=64, max_seq_len=16,
                      attention="sdpa")
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        build(cfg)(torch.ones(1, 17, dtype=torch.long))


def test_windowed_decoder_reads_long_prompts_whole():
    recipe = load_recipe(RECIPE, ["model.attention_window=4", "model.d_model=32", "model.n_heads=4",
                                  "model.max_seq_len=16", "data.seq_len=16"])
    model = windowed_model(4, 2, max_seq_len=16)
    assert model_context(model, recipe) is None
    assert model_context(model, load_recipe(RECIPE, ["model.max_seq_len=16", "data.seq_len=16"])) == 16
    prompts = [list(range(1, 41)), list(range(5, 30))]
    out, truncated = greedy_generate(model, prompts, 3, eot_id=0, max_context=None)
    assert truncated == [False, False] and all(len(o) <= 3 for o in out)
    # the same tokens as generating one prompt alone with its full-length forwards
    alone, _ = greedy_generate(model, prompts[:1], 3, eot_id=0, max_context=None)
    assert out[0] == alone[0]


@pytest.mark.parametrize("overrides, text", [
    (["model.attention_window=0"], "model.attention_window: must be >= 1"),
    (["model.type=titans", "model.attention_window=64"], "model.attention_window: is only used with model.type 'decoder'"),
])
def test_recipe_errors_are_one_line(overrides, text):
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, overrides)
    assert text in str(e.value) and "\n" not in str(e.value)


def test_window_is_part_of_the_checkpointed_model():
    from memtrain.config import recipe_hash_fields

    a = recipe_hash_fields(load_recipe(RECIPE, ["model.attention_window=64"]))
    b = recipe_hash_fields(load_recipe(RECIPE))
    assert a["model"]["attention_window"] == 64 and b["model"]["attention_window"] is None
