"""parallel.activation_checkpointing as none / every block / every n-th block in the anchor, Titans and
Hugging Face models: the chosen blocks (and only they) run again in backward, and the gradients equal
the plain ones exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import ModelConfig, RecipeError, TitansConfig, checkpoint_every, recipe_from_dict
from memtrain.model import build
from memtrain.model.anchor import checkpointed_blocks

CFG = dict(vocab_size=50, d_model=16, n_layers=5, n_heads=2, ffn_dim=32, max_seq_len=16, attention="sdpa")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _count_calls(blocks) -> list[int]:
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):  # wrap forward itself: torch skips module hooks when recomputing
        def counted(*args, _forward=block.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)
        block.forward = counted
    return calls


def _grads(model, x, doc):
    model.zero_grad()
    out = model(x, doc_ids=doc).logits
    F.cross_entropy(out.flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["decoder", "titans"])
@pytest.mark.parametrize("every", [True, 1, 2, 3])
def test_checkpointed_blocks_are_recomputed_and_gradients_are_exact(kind, every):
    extra = {"type": "titans", "titans": TitansConfig(variant="mag", window=8, memory_chunk_size=4)} if kind == "titans" else {}
    torch.manual_seed(0)
    model = build(ModelConfig(**CFG, **extra)).double()
    x = torch.randint(0, 50, (2, 12))
    doc = torch.tensor([[0] * 5 + [1] * 7] * 2)
    calls = _count_calls(model.blocks)
    logits, plain = _grads(model, x, doc)
    assert calls == [1] * 5
    model.set_activation_checkpointing(every)
    chosen = checkpointed_blocks(5, int(every))
    assert chosen == {True: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4], 2: [0, 2, 4], 3: [0, 3]}[every]
    calls[:] = [0] * 5
    ck_logits, ck = _grads(model, x, doc)
    assert calls == [2 if i in chosen else 1 for i in range(5)]
    torch.testing.assert_close(ck_logits, logits, rtol=0, atol=0)
    assert plain.keys() == ck.keys()
    for name, g in plain.items():
        torch.testing.assert_close(ck[name], g, rtol=0, atol=0, msg=name)
    model.set_activation_checkpointing(False)
    calls[:] = [0] * 5
    _grads(model, x, doc)
    assert calls == [1] * 5


def test_hf_model_checkpoints_every_nth_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    from memtrain.model.hf import HFMemoryLM, decoder_layers

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    model = HFMemoryLM(hf.double())
    x = torch.randint(0, 40, (2, 10))
    layers = decoder_layers(hf, 3)
    calls = [0, 0, 0]
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *a, _i=i: calls.__setitem__(_i, calls[_i] + 1))
    logits, plain = _grads(model, x, None)
    model.set_activation_checkpointing(2)
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True]
    calls[:] = [0, 0, 0]
    ck_logits, ck = _grads(model, x, None)
    assert calls == [2, 1, 2]
    torch.testing.assert_close(ck_logits, logits, rtol=0, atol=0)
    for name, g in plain.items():
        torch.testing.assert_close(ck[name], g, rtol=0, atol=0, msg=name)
    model.set_activation_checkpointing(False)
    assert not hf.is_gradient_checkpointing


def test_recipe_key_accepts_bool_names_and_intervals():
    assert [checkpoint_every(v) for v in (False, True, "none", "every", 0, 1, 4)] == [0, 1, 0, 1, 0, 1, 4]
    base = {"data": {"seq_len": 32, "tokenizer": {"vocab_size": 320}},
            "model": {"vocab_size": 320, "max_seq_len": 32}, "train": {"global_batch_tokens": 256, "micro_batch_size": 2}}
    assert recipe_from_dict(base, ["parallel.activation_checkpointing=2"]).parallel.activation_checkpointing == 2
    assert recipe_from_dict(base, ["parallel.activation_checkpointing=every"]).parallel.activation_checkpointing == "every"
    for bad in ("sometimes", "-1", "2.5"):
        with pytest.raises(RecipeError, match=r"^recipe error: parallel\.activation_checkpointing: "):
            recipe_from_dict(base, [f"parallel.activation_checkpointing={bad}"])
    with pytest.raises(RecipeError, match=r"^recipe error: train\.loss_chunk_tokens: must be >= 0"):
        recipe_from_dict(base, ["train.loss_chunk_tokens=-1"])
