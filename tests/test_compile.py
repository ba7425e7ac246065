"""Regional compilation of the decoder blocks (model.compile): one Dynamo frame for every block of the
anchor (no recompilation per block), and compiled = eager outputs and gradients through inductor on CPU
(float64, document mask, grouped-query attention, a tied head, checkpointing every second block and the
fused loss)."""

from __future__ import annotations

import shutil

import pytest
import torch

from memtrain.config import MemoryConfig, ModelConfig, compile_enabled, recipe_from_dict
from memtrain.model import build

CFG = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16, attention="sdpa")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.randint(0, 64, (2, 16), generator=g)
    labels[0, :3] = -100
    doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    return x, labels, doc


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("n_layers", [2, 5])
def test_one_frame_serves_every_block(n_layers):
    """Dynamo compiles the block's code once, whatever the number of blocks; a second forward with
    another batch of the same shape compiles nothing new."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = build(ModelConfig(n_layers=n_layers, **CFG))
    counter = CompileCounter()
    assert model.compile_blocks(backend=counter) == n_layers
    x, labels, doc = _batch()
    model(x, doc_ids=doc).logits.sum().backward()
    assert counter.frame_count == 1
    model(x.flip(0), doc_ids=doc.flip(0)).logits.sum().backward()
    assert counter.frame_count == 1


def test_memory_layers_add_one_variant_not_one_per_block():
    """FFN memories on some layers: blocks with and without a memory are two variants of one code."""
    from torch._dynamo.testing import CompileCounter

    from memtrain.model.hierarchical import FetchedMemory
    from memtrain.parallel.bank import MemoryBank

    frames = []
    for layers in (4, 6):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build(ModelConfig(n_layers=layers, **CFG),
                      MemoryConfig(type="ffn", levels=[1, 1], placement_layers=2), branching=2)
        bank = MemoryBank(model.memory_layout, seed=0)
        counter = CompileCounter()
        model.compile_blocks(backend=counter)
        x, _, doc = _batch()
        memory = bank.fetch(torch.tensor([[0, 1], [1, 3]]))
        assert isinstance(memory, FetchedMemory)
        model(x, doc_ids=doc, memory=memory).logits.sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] == frames[1] <= 2


def test_compiled_blocks_match_eager_outputs_and_gradients():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler (none on PATH)")
    cfg = ModelConfig(n_layers=3, tie_embeddings=True, **CFG)
    torch.manual_seed(0)
    eager = build(cfg).double()
    compiled = build(cfg).double()
    compiled.load_state_dict(eager.state_dict())
    compiled.set_activation_checkpointing(2)
    compiled.set_fused_loss(7)
    assert compiled.compile_blocks() == 3
    x, labels, doc = _batch()
    results = []
    for model in (eager, compiled):
        out = model(x, doc_ids=doc, labels=labels)
        out.loss_sum.backward()
        with torch.no_grad():
            logits = model.eval()(x, doc_ids=doc).logits
        model.train()
        results.append((out.loss_sum.detach(), logits, {n: p.grad for n, p in model.named_parameters()}))
    (loss_e, logits_e, grads_e), (loss_c, logits_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-12, atol=1e-12)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-10, atol=1e-12, msg=name)


def _recipe(**model):
    return recipe_from_dict({"model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64,
                                       "max_seq_len": 32, **model},
                             "data": {"seq_len": 32, "tokenizer": {"vocab_size": 320}},
                             "train": {"global_batch_tokens": 256, "micro_batch_size": 2}})


def test_model_compile_key():
    assert _recipe().model.compile == "auto"
    assert not compile_enabled(_recipe(), "cpu") and compile_enabled(_recipe(), "cuda")
    assert compile_enabled(_recipe(compile=True), "cpu") and not compile_enabled(_recipe(compile=False), "cuda")
    zero3 = recipe_from_dict({**_recipe().to_dict(), "parallel": {"zero_stage": 3}})
    assert not compile_enabled(zero3, "cuda")
    from memtrain.config import RecipeError

    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: .*ZeRO 3"):
        recipe_from_dict({**_recipe().to_dict(), "parallel": {"zero_stage": 3}}, ["model.compile=true"])
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: .*'decoder' only"):
        recipe_from_dict({**_recipe().to_dict()}, ["model.compile=true", "model.type=titans"])
    with pytest.raises(RecipeError, match=r"^recipe error: model\.compile: expected"):
        _recipe(compile="yes")
