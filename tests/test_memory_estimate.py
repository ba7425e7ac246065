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
    # Per token and plain block, eager (model.compile false): 4d + 4q + 3k + 2f = 64 + 64 + 48 + 64 = 240 values (the
    # SwiGLU keeps its gate and up projections, memtrain.model.swiglu); 16 tokens of 4 bytes.
    tokens, a = 2 * 8, 4
    mask = 2 * 8 * 8  # the dense document mask of sdpa, bool
    acts, loss, text = activation_bytes(_recipe("train.loss_chunk_tokens=0", "model.compile=false"), "fp32")
    assert acts == (2 * 240 + 2 * 16) * tokens * a + mask
    assert loss == tokens * 100 * (a + 12)  # full logits
    assert "no checkpointing" in text and "sdpa" in text and "SwiGLU keeps 2 of 4" in text
    # compiled blocks (model.compile auto, as a decoder on CUDA runs): the partitioner keeps the product too (3f);
    # ZeRO 3 (eager, autograd's SwiGLU): all four (4f)
    for overrides, ffn in ((["model.compile=auto"], 3), (["model.compile=true"], 3), (["parallel.zero_stage=3"], 4)):
        acts, _, text = activation_bytes(_recipe("train.loss_chunk_tokens=0", *overrides), "fp32")
        assert acts == (2 * (240 + (ffn - 2) * 32) + 2 * 16) * tokens * a + mask, overrides
        assert f"SwiGLU keeps {ffn} of 4" in text, (overrides, text)
    # every block checkpointed: the inputs (d each), one block recomputed at a time, the final 2d
    acts, _, _ = activation_bytes(_recipe("parallel.activation_checkpointing=true", "model.compile=false"), "fp32")
    assert acts == (16 + 16 + 240 + 2 * 16) * tokens * a + mask
    # every 2nd of 2 blocks: block 0 keeps its input only, block 1 everything
    acts, _, text = activation_bytes(_recipe("parallel.activation_checkpointing=2", "model.compile=false"), "fp32")
    assert acts == (16 + 240 + 240 + 2 * 16) * tokens * a + mask and "(1 of 2)" in text
    # flex (auto on CUDA) has no dense mask; bf16 halves the values; the fused loss in chunks of 5 tokens
    acts, loss, _ = activation_bytes(_recipe("train.loss_chunk_tokens=5", "model.compile=false", attention="auto"),
                                     "bf16")
    assert acts == (2 * 240 + 2 * 16) * tokens * 2
    assert loss == 5 * 100 * (2 * 2 + 8) + 4 * 100 * 16
    # without qk-norm: 3q + 2k instead of 4q + 3k
    acts, _, _ = activation_bytes(_recipe("model.compile=false", qk_norm=False), "fp32")
    assert acts == (2 * (240 - 16 - 16) + 2 * 16) * tokens * a + mask


@pytest.mark.parametrize("memory", [False, True])
def test_activation_formula_matches_what_autograd_saves(memory):
    """On CPU: the bytes of every tensor autograd saves in a forward (parameters excluded), against the
    estimate of the blocks and final norm plus the fused loss's fp32 head gradient (4 V d)."""
    extra = ["memory.type=ffn", "memory.levels=[2,1]", "data.clustering.enabled=true", "data.clustering.depth=2",
             "data.clustering.branching=2", "memory.placement_layers=2"] if memory else []
    recipe = recipe_from_dict({
        "model": {"vocab_size": 200, "d_model": 64, "n_layers": 3, "n_heads": 4, "ffn_dim": 256, "max_seq_len": 16,
                  "attention": "sdpa", "compile": False},
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


# -- Titans: the traced estimate ---------------------------------------------------------------------


def _titans_recipe(variant: str, *overrides: str):
    return recipe_from_dict({
        "model": {"type": "titans", "vocab_size": 100, "d_model": 32, "n_layers": 3, "n_heads": 2, "ffn_dim": 64,
                  "max_seq_len": 24, "titans": {"variant": variant, "memory_heads": 2, "memory_chunk_size": 4,
                                                "segment_len": 8, "window": 6, "persistent_tokens": 2}},
        "data": {"seq_len": 24, "tokenizer": {"vocab_size": 100}},
        "train": {"global_batch_tokens": 48, "micro_batch_size": 2}}, list(overrides))


@pytest.mark.parametrize("variant", ["mac", "mag", "mal"])
def test_traced_activations_are_what_a_real_forward_saves(variant):
    """The trace on fake CPU tensors (PyTorch inner loop) against a real CPU forward of the same model with the
    same attention stand-in, block by block: the bytes of every tensor autograd saves, once per storage,
    parameters excluded."""
    from unittest import mock

    import torch.nn.functional as F

    from memtrain.parallel import activation_trace

    recipe = _titans_recipe(variant, "model.titans.kernel=torch")
    traced = activation_trace.trace_saved_activations(recipe, "fp32", device="cpu")
    model = build(recipe.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, counted, real = ["before"], set(), {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: where.append(i))
        block.register_forward_hook(lambda m, a, out: where.append("after"))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in counted:
            counted.add(storage.data_ptr())
            real[where[-1]] = real.get(where[-1], 0) + storage.nbytes()
        return t

    ids = torch.zeros(2, 24, dtype=torch.long)
    with mock.patch.object(F, "scaled_dot_product_attention", activation_trace._attention_stand_in), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, doc_ids=torch.zeros_like(ids))
    assert traced.blocks == [float(real[i]) for i in range(3)] and min(traced.blocks) > 0
    assert (traced.before, traced.after) == (float(real.get("before", 0)), float(real.get("after", 0)))


def test_traced_titans_estimate_on_cuda_takes_the_kernel_path(monkeypatch):
    """bf16 on fake CUDA tensors: the memory's inner loop goes through the Triton kernels' custom operators
    (their fake implementations), as training on a GPU does, and keeps less than the PyTorch form."""
    from memtrain.kernels.titans import triton_kernels
    from memtrain.parallel import activation_trace

    calls = []
    real = triton_kernels.chunk_scan
    monkeypatch.setattr(triton_kernels, "chunk_scan", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernels = activation_trace.trace_saved_activations(_titans_recipe("mag"), "bf16")
    assert len(calls) == 3  # one memory call per block
    calls.clear()
    torch_form = activation_trace.trace_saved_activations(_titans_recipe("mag", "model.titans.kernel=torch"), "bf16")
    assert not calls and sum(kernels.blocks) < sum(torch_form.blocks)


def test_checkpointing_of_traced_blocks():
    from memtrain.parallel.activation_trace import checkpointed_bytes

    assert checkpointed_bytes([3.0, 5.0, 4.0], 1.0, 0) == (12.0, None)
    # blocks 0 and 2 keep their inputs; backward recomputes one at a time, the larger of them (4)
    assert checkpointed_bytes([3.0, 5.0, 4.0], 1.0, 2) == (1.0 + 5.0 + 1.0 + 4.0, 2)
    assert checkpointed_bytes([3.0, 5.0, 4.0], 1.0, 1) == (3.0 + 5.0, 3)


def test_recipe_show_estimates_titans_activations_below_the_measured_peak(monkeypatch):
    """titans-170m-mac on one rank: the blocks' traced activations, 2d per token after them and the loss stage. One
    H200 measured a peak of 36.1 GiB for this run (docs/titans-kernels.md, "Measured on an H200"), when the kernels
    saved a state every ceil(sqrt(n_chunks)) chunks and MAC's retrievals ran in PyTorch; the estimate counts what the
    forward keeps, not the backward's working set, so for that code it lies below the measurement (by 17% when this was
    written). At today's spacing (one saved state per 32-chunk segment) the kernels keep 2.8 GiB less, the fused
    retrieval (memtrain.kernels.titans.read) keeps neither of its two hidden-layer tensors, and the convolution fused
    into the prologue and the retrieval queries neither its input nor its output. Since 2026-11-29 each block's SwiGLU
    keeps its gate and up projections alone (memtrain.model.swiglu), where the measured run kept all four."""
    from pathlib import Path

    from memtrain.config import load_recipe
    from memtrain.kernels.titans import triton_kernels
    from memtrain.parallel.memory_estimate import format_memory_estimate

    path = Path(__file__).resolve().parents[1] / "recipes" / "titans-170m-mac.yaml"
    recipe = load_recipe(path, ["train.micro_batch_size=4"])  # the measured run's (the recipe takes 8 since)
    with torch.device("meta"):
        model = build(recipe.model)
    with monkeypatch.context() as m:
        m.setattr(triton_kernels, "SCRATCH_BYTES", 0)  # the measured run's spacing
        recompute = estimate_peak_memory(recipe, 1, "bf16", model)
        m.setenv("MEMTRAIN_SWIGLU_RECOMPUTE", "0")  # autograd's SwiGLU
        fused_conv = estimate_peak_memory(recipe, 1, "bf16", model)
        m.setenv("MEMTRAIN_TITANS_FUSED_CONV", "0")  # its convolution in PyTorch
        fused_read = estimate_peak_memory(recipe, 1, "bf16", model)
        m.setenv("MEMTRAIN_TITANS_FUSED_READ", "0")  # and its PyTorch retrievals
        measured_code = estimate_peak_memory(recipe, 1, "bf16", model)
    assert 0.75 * 36.1 < measured_code.total / 2**30 < 36.1
    # the SwiGLU recomputing its activation and product keeps two [4, 4096, 2048] bf16 tensors fewer per block: 1.5 GiB
    assert fused_conv.total - recompute.total == 12 * 2 * 4 * 4096 * 2048 * 2
    # PyTorch's retrieval keeps W1 q and its SiLU ([4, 12, 512, 128] float32 each) for 12 blocks x 8 segments: 2.25 GiB
    saved = 12 * 8 * 2 * 4 * 12 * 512 * 128 * 4 / 2**30
    assert saved < (measured_code.total - fused_read.total) / 2**30 < 1.05 * saved
    # PyTorch's convolution keeps its input after the cache ([4, 3 + 512, 2304] bf16) and the q/k/v prologue its
    # output ([4, 512, 2304]) per write; the fused one neither (it keeps the projection, kept already, and the
    # cache, [4, 3, 2304], its own tensor): 1.69 GiB
    write = 12 * 8 * 4 * (515 + 512) * 2304 * 2 - 12 * 8 * 4 * 3 * 2304 * 2
    # and per block for the retrieval queries its input (8 segments of [4, 3 + 512, 768] bf16), SiLU's input
    # ([4, 4096, 768] bf16), the norm's ([4, 12, 4096, 64] float32) and its two [4, 12, 4096, 1] float32 tensors,
    # where the fused queries keep the projection (as large as SiLU's input): 0.86 GiB
    queries = 12 * (4 * 8 * 515 * 768 * 2 + 4 * 4096 * 768 * 4 + 2 * 4 * 12 * 4096 * 4)
    assert (fused_read.total - fused_conv.total) == pytest.approx(write + queries, rel=1e-3)
    # Today's spacing, on 2 of its 12 blocks (a shorter trace): per 512-token segment of 32 chunks 1 saved state
    # instead of 6, each the weights and momentum of both layers (2 x 2 x 64 x 128 fp32) of 48 programs.
    small = load_recipe(path, ["model.n_layers=2", "train.micro_batch_size=4"])
    with torch.device("meta"):
        small_model = build(small.model)
    est = estimate_peak_memory(small, 1, "bf16", small_model)
    with monkeypatch.context() as m:
        m.setattr(triton_kernels, "SCRATCH_BYTES", 0)
        sqrt_spacing = estimate_peak_memory(small, 1, "bf16", small_model)
    assert sqrt_spacing.activations - est.activations == 2 * 8 * 5 * 48 * 4 * 64 * 128 * 4
    assert est.loss is not None
    assert "activations traced on CUDA" in est.notes[0] and "no checkpointing" in est.notes[0]
    # every block checkpointed: the two inputs and one block recomputed instead of both blocks
    ckpt = estimate_peak_memory(load_recipe(path, ["model.n_layers=2", "train.micro_batch_size=4",
                                                   "parallel.activation_checkpointing=true"]),
                                1, "bf16", small_model)
    assert 0.45 * est.activations < ckpt.activations < 0.6 * est.activations
    text = "\n".join(format_memory_estimate(est, 1, "bf16", 1))  # recipe show's lines
    assert "activations n/a" not in text and "activations traced" in text


def test_titans_estimate_says_why_when_the_trace_fails(monkeypatch):
    from memtrain.parallel import activation_trace

    def fail(*a, **k):
        raise RuntimeError("no fake kernels\nsecond line")

    monkeypatch.setattr(activation_trace, "trace_saved_activations", fail)
    recipe = _titans_recipe("mac")
    with torch.device("meta"):
        model = build(recipe.model)
    est = estimate_peak_memory(recipe, 1, "bf16", model)
    assert est.activations is None
    assert est.notes[0] == "activations not estimated: the trace failed (RuntimeError: no fake kernels)"
