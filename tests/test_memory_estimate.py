"""The peak-memory estimate of `memtrain recipe show` (memtrain.parallel.memory_estimate): model states
and activations against numbers counted by hand for a tiny decoder, the activation formula against the
bytes autograd really saves on CPU, and the line recipe show prints."""

from __future__ import annotations

import pytest
import torch

from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel.memory_estimate import activation_bytes, estimate_peak_memory

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _recipe(*overrides, **model):
    base = {"model": {"vocab_size": 100, "d_model": 16, "n_layers": 2, "n_heads": 2, "ffn_dim": 32, "max_seq_len": 8,
                      "attention": "sdpa", **model},
            "data": {"seq_len": 8, "tokenizer": {"vocab_size": 100}},
            "train": {"global_batch_tokens": 64, "micro_batch_size": 2}}
    return recipe_from_dict(base, list(overrides))


# Hand count of the tiny decoder: embedding 100 x 16 = 1600, separate head 1600, per block wq/wk/wv/wo
# 4 x 256 + norms 4 x 16 (norm1, norm2, q_norm, k_norm) + w1/w2/w3 3 x 512 = 2624, final norm 16.
N = 1600 + 1600 + 2 * 2624 + 16  # 8464


def test_model_states_by_precision_and_zero_stage():
    with torch.device("meta"):
        model = build(_recipe().model)
    assert sum(p.numel() for p in model.parameters()) == N
    est = estimate_peak_memory(_recipe(), 1, "fp32", model)
    assert (est.weights, est.gradients, est.optimizer, est.bank) == (4 * N, 4 * N, 8 * N, 0)
    zero2 = estimate_peak_memory(_recipe("parallel.zero_stage=2"), 4, "bf16", model)
    assert (zero2.weights, zero2.gradients, zero2.optimizer) == (2 * N, 2 * N / 4, 16 * N / 4)
    zero3 = estimate_peak_memory(_recipe("parallel.zero_stage=3"), 4, "bf16", model)
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (2 * N / 4, 2 * N / 4, 16 * N / 4)
    zero1 = estimate_peak_memory(_recipe("parallel.zero_stage=1"), 4, "fp32", model)
    assert (zero1.weights, zero1.gradients, zero1.optimizer) == (4 * N, 4 * N, 8 * N / 4)


def test_activations_by_checkpointing_attention_and_loss():
    # Per token and plain block: 4d + 4q + 3k + 4f = 64 + 64 + 48 + 128 = 304 values; 16 tokens of 4 bytes.
    tokens, a = 2 * 8, 4
    mask = 2 * 8 * 8  # the dense document mask of sdpa, bool
    acts, loss, text = activation_bytes(_recipe("train.loss_chunk_tokens=0"), "fp32")
    assert acts == (2 * 304 + 2 * 16) * tokens * a + mask
    assert loss == tokens * 100 * (a + 12)  # full logits
    assert "no checkpointing" in text and "sdpa" in text
    # every block checkpointed: the inputs (d each), one block recomputed at a time, the final 2d
    acts, _, _ = activation_bytes(_recipe("parallel.activation_checkpointing=true"), "fp32")
    assert acts == (16 + 16 + 304 + 2 * 16) * tokens * a + mask
    # every 2nd of 2 blocks: block 0 keeps its input only, block 1 everything
    acts, _, text = activation_bytes(_recipe("parallel.activation_checkpointing=2"), "fp32")
    assert acts == (16 + 304 + 304 + 2 * 16) * tokens * a + mask and "(1 of 2)" in text
    # flex (auto on CUDA) has no dense mask; bf16 halves the values; the fused loss in chunks of 5 tokens
    acts, loss, _ = activation_bytes(_recipe("train.loss_chunk_tokens=5", attention="auto"), "bf16")
    assert acts == (2 * 304 + 2 * 16) * tokens * 2
    assert loss == 5 * 100 * (2 * 2 + 8) + 4 * 100 * 16
    # without qk-norm: 3q + 2k instead of 4q + 3k
    acts, _, _ = activation_bytes(_recipe(qk_norm=False), "fp32")
    assert acts == (2 * (304 - 16 - 16) + 2 * 16) * tokens * a + mask


@pytest.mark.parametrize("memory", [False, True])
def test_activation_formula_matches_what_autograd_saves(memory):
    """On CPU: the bytes of every tensor autograd saves in a forward (parameters excluded), against the
    estimate of the blocks and final norm plus the fused loss's fp32 head gradient (4 V d)."""
    extra = ["memory.type=ffn", "memory.levels=[2,1]", "data.clustering.enabled=true", "data.clustering.depth=2",
             "data.clustering.branching=2", "memory.placement_layers=2"] if memory else []
    recipe = recipe_from_dict({
        "model": {"vocab_size": 200, "d_model": 64, "n_layers": 3, "n_heads": 4, "ffn_dim": 256, "max_seq_len": 16,
                  "attention": "sdpa"},
        "data": {"seq_len": 16, "tokenizer": {"vocab_size": 200}},
        "train": {"global_batch_tokens": 64, "micro_batch_size": 2}}, extra)
    torch.manual_seed(0)
    model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    model.set_fused_loss(4096)
    x = torch.randint(0, 200, (2, 16))
    doc = torch.tensor([[0] * 8 + [1] * 8] * 2)
    fetched, ranks, params = None, None, {p.data_ptr() for p in model.parameters()}
    if memory:
        from memtrain.parallel.bank import MemoryBank

        bank = MemoryBank(model.memory_layout, seed=0)
        fetched = bank.fetch(torch.tensor([[0, 1], [1, 2]]))
        ranks = [model.memory_layout.layer_rank(i) for i in range(3)]
        params |= {p.data_ptr() for p in bank.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, doc_ids=doc, memory=fetched, labels=x)
    acts, _, _ = activation_bytes(recipe, "fp32", ranks)
    expected = acts + 4 * 200 * 64
    assert sum(saved.values()) == pytest.approx(expected, rel=0.05)


def test_recipe_show_prints_the_estimate():
    from pathlib import Path

    from memtrain.config import load_recipe
    from memtrain.launcher.cli import recipe_show

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "openlm-160m.yaml",
                         ["parallel.activation_checkpointing=2"])
    text = recipe_show(recipe, 8)
    line = next(l for l in text.splitlines() if l.startswith("peak memory per GPU"))
    assert "8 rank(s), bf16, ZeRO" in line and "activations" in line and "loss" in line
    n = recipe.model.n_layers
    assert f"1 in 2 blocks checkpointed ({(n + 1) // 2} of {n})" in text and "fused loss in chunks of 4096 tokens" in text
