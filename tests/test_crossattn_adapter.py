"""Memory adapters (``model.type: hf`` + ``memory.type: crossattn``; crossattn-memory-banks paper, Section 5):
cross-attention memory layers inserted by hooks into tiny random Llama, Qwen2 and Gemma 3 models saved to a tmp
folder (:mod:`memtrain.model.crossattn.adapter`, :class:`memtrain.model.hf.CrossAttnAdapterLM`). Zero effect at
initialisation, where variant A and B read, the frozen base, parameter groups and Section 5.5's differential
learning rates and staged freezing, the router's gradients, LoRA through peft, training on a learnable task,
activation checkpointing, the recipe checks, the Section 5.4 recipes, and `memtrain train` end to end. CPU,
no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import peft  # noqa: F401 - a hard dependency (LoRA): a broken install fails here, it is not skipped
import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import (
    AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
    Qwen2ForCausalLM,
)

from memtrain.config import RecipeError, load_recipe, recipe_from_dict
from memtrain.model import build, count_parameters
from memtrain.model.crossattn.adapter import attention_branch
from memtrain.model.hf import CrossAttnAdapterLM, HFMemoryLM

from tiny_hf import make_tiny_llama  # tests/tiny_hf.py

REPO = Path(__file__).resolve().parents[1]
V, D, L, T = 128, 64, 3, 24

ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads (as in the real Gemma 3); sandwich norms around attention and MLP.
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
# The norm in front of each family's MLP: its input is the residual stream after (attention + memory read).
MLP_NORM = {"llama": "post_attention_layernorm", "qwen2": "post_attention_layernorm",
            "gemma3": "pre_feedforward_layernorm"}
ROUTINGS = {"unrouted": {}, "sequence": {"chapters": 4, "top_k": 2, "routing": "sequence"},
            "token": {"chapters": 4, "top_k": 2, "routing": "token"}}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """arch -> folder of a saved tiny random model."""
    out = {}
    for i, (name, make) in enumerate(ARCHS.items()):
        torch.manual_seed(i)
        path = tmp_path_factory.mktemp(name)
        make().save_pretrained(path)
        out[name] = str(path)
    return out


def adapter_recipe(path: str, crossattn: dict | None = None, **sections):
    """A recipe of memory adapters on the model folder ``path``: memory.crossattn (32 tokens unless given)
    from ``crossattn``, other settings per section (``memory={"optimizer": ...}``, ``train={...}``)."""
    data = {"model": {"type": "hf", "pretrained": path},
            "memory": {"type": "crossattn", "crossattn": {"tokens": 32, **(crossattn or {})}}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


def adapter(path: str, crossattn: dict | None = None, seed: int = 0, **sections) -> CrossAttnAdapterLM:
    r = adapter_recipe(path, crossattn, **sections)
    torch.manual_seed(seed)
    return build(r.model, r.memory, r.data.clustering.branching)


def tokens(B: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def perturb_outputs(model: CrossAttnAdapterLM, layers=None, scale: float = 0.3, seed: int = 3) -> None:
    """Random W_O (and variant B's MLP output) in memory layers ``layers`` (default all): the memory matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, part in model.crossattn.parts.items():
            if layers is None or int(i) in layers:
                for w in [part.attn.wo.weight] + ([part.ffn.w3.weight] if hasattr(part, "ffn") else []):
                    w.copy_(scale * torch.randn(w.shape, generator=g))


def base_state(model: CrossAttnAdapterLM) -> dict[str, torch.Tensor]:
    """The pretrained weights under their Hugging Face names (peft's prefixes and base_layer removed)."""
    ids = {id(p) for p in model.anchor_parameters()}
    return {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p.detach().clone()
            for n, p in model.hf_model.named_parameters() if id(p) in ids}


# -------------------------------------------------------------------------------------------------
# Zero effect at initialisation, and where the memory is read


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_crossattn_adapter_is_the_pretrained_model_at_initialisation(saved, arch, variant, routing):
    model = adapter(saved[arch], {"variant": variant, **ROUTINGS[routing]}).eval()
    plain = AutoModelForCausalLM.from_pretrained(saved[arch], dtype=torch.float32).eval()
    assert isinstance(model, CrossAttnAdapterLM) and model.crossattn.layer_indices == [0, 1, 2]
    x = tokens()
    with torch.no_grad():
        out = model(x, doc_ids=torch.zeros_like(x))
        reference = plain(x).logits
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=1e-5)
    assert (out.aux_loss is not None) == (routing != "unrouted")
    perturb_outputs(model)  # the same model with live memory layers is another model
    with torch.no_grad():
        assert float((model(x).logits - reference).abs().max()) > 1e-3


@pytest.mark.parametrize("settings", [
    {"shared": True}, {"bank_rank": 4}, {"proj_rank": 8}, {"dim": 32, "heads": 2},
    {"bank_dtype": "int8", "freeze_bank": True}, {"bank_dtype": "bf16"},
    {"shared": True, "chapters": 8, "top_k": 3, "bank_rank": 4, "proj_rank": 8, "dim": 48, "heads": 3},
], ids=["shared", "bank_rank", "proj_rank", "dim", "int8", "bf16", "all"])
def test_crossattn_adapter_banks_and_compressions(saved, settings):
    """Shared and per-layer banks (Section 3.4) and Section 5.3's compressions as adapters: identity at
    initialisation, a live read once W_O moves, gradients for every trainable memory parameter."""
    model = adapter(saved["llama"], settings)
    plain = AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float32)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=1e-5)
    perturb_outputs(model)
    lm_loss(model(x).logits, x).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("crossattn.") for n, _ in trainable)
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for _, p in trainable)
    assert len(model.crossattn.banks) == (1 if settings.get("shared") else 3)


@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_crossattn_adapter_reads_where_the_variant_says(saved, arch, variant):
    """Variant A: the MLP of decoder layer 1 sees h + MemAttn(norm(h)), h = the residual stream after its
    self-attention (for Gemma 3 after post_attention_layernorm's residual add); variant B: the layer's output
    y becomes y + MemAttn(norm(y)) plus the extra MLP (Section 3.2)."""
    model = adapter(saved[arch], {"variant": variant, "chapters": 4, "top_k": 2}).eval()
    layer = model.hf_model.model.layers[1]
    part = model.crossattn.parts["1"]
    seen = {}
    if variant == "A":
        watched = getattr(layer, MLP_NORM[arch])
        handle = watched.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    else:
        handle = layer.register_forward_hook(
            lambda m, args, out: seen.__setitem__("x", out[0] if isinstance(out, tuple) else out))
    x = tokens()
    with torch.no_grad():
        model(x)
        before = seen["x"]  # memory layers at their initialisation: the pretrained model's stream
        perturb_outputs(model, layers=[1])  # layer 0 stays the identity, so layer 1's input is unchanged
        model(x)
        after = seen["x"]
        if variant == "A":
            read, _ = part.attn(part.norm(before), model.crossattn.bank_for(1))
            expected = before + read
        else:
            expected, _ = part(before, model.crossattn.bank_for(1))
    handle.remove()
    assert float((after - before).abs().max()) > 1e-3
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    if variant == "A":
        expected_branch = "post_attention_layernorm" if arch == "gemma3" else "self_attn"
        assert attention_branch(layer) is getattr(layer, expected_branch)


# -------------------------------------------------------------------------------------------------
# Parameters, freezing, optimizer groups


def test_crossattn_adapter_freezes_the_base_and_splits_its_parameters(saved):
    model = adapter(saved["qwen2"], {"chapters": 4, "top_k": 2, "placement": "last", "placement_k": 2,
                                     "variant": "B"})
    assert model.crossattn.layer_indices == [1, 2] and model.vocab_size == V
    assert all(not p.requires_grad for p in model.anchor_parameters())
    groups = [model.anchor_parameters(), model.memory_parameters(), model.bank_parameters(), model.lora_parameters()]
    ids = [{id(p) for p in g} for g in groups]
    assert sum(len(s) for s in ids) == len(set().union(*ids)) == len(list(model.parameters()))  # a partition
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == ids[1] | ids[2] and not ids[3]
    banks = {id(b.weight) for b in model.crossattn.banks}
    wk_wv = {id(p) for part in model.crossattn.parts.values() for p in (part.attn.wk.weight, part.attn.wv.weight)}
    assert ids[2] == banks | wk_wv
    routers = {id(part.attn.router.proj.weight) for part in model.crossattn.parts.values()}
    assert routers <= ids[1] and {id(part.attn.wq.weight) for part in model.crossattn.parts.values()} <= ids[1]
    counts = model.crossattn.parameter_counts()
    assert counts["total"] == sum(p.numel() for p in model.memory_parameters() + model.bank_parameters())
    assert count_parameters(model) == count_parameters(model.hf_model) + counts["total"]
    # the memory norms are the model's own RMSNorm class and epsilon
    assert type(model.crossattn.parts["1"].norm) is type(model.hf_model.model.layers[0].input_layernorm)
    # placements of Section 3.3 on the pretrained model's own layer count (3 here, not model.n_layers)
    assert adapter(saved["llama"], {"placement": "every", "placement_k": 2}).crossattn.layer_indices == [0, 2]
    assert adapter(saved["llama"], {"layers": [1]}).crossattn.layer_indices == [1]
    assert adapter(saved["llama"], {"shared": True}).crossattn.parameter_counts()["banks"] == 1
    # memory.crossattn.train_base: the base trains too (memory adapters + full fine-tuning)
    both = adapter(saved["llama"], {"train_base": True})
    assert all(p.requires_grad for p in both.parameters())


def test_crossattn_adapter_builds_on_the_meta_device(saved):
    r = adapter_recipe(saved["gemma3"], {"variant": "B", "lora": {"r": 2, "alpha": 4}, "dim": 32, "heads": 2})
    torch.manual_seed(0)
    real = build(r.model, r.memory)
    with torch.device("meta"):
        meta = build(r.model, r.memory)
    assert all(p.is_meta for p in meta.parameters())
    assert count_parameters(meta) == count_parameters(real) and meta.describe() == real.describe()
    lines = real.describe()
    assert "variant B memory layers in decoder layers [0, 1, 2]" in lines[0]
    assert "LoRA r=2" in lines[1] and "trainable" in lines[1] and "frozen" in lines[2]


def _train_steps(model, recipe, steps: int, x: torch.Tensor, snapshot=None) -> list:
    """``steps`` AdamW steps of the engine's optimizer and schedule (no DeepSpeed); snapshots after each."""
    from memtrain.parallel.engine import build_optimizer, build_scheduler

    opt = build_optimizer(model, recipe)
    sched = build_scheduler(opt, recipe)
    shots = []
    for _ in range(steps):
        out = model(x)
        loss = lm_loss(out.logits, x) + (out.aux_loss if out.aux_loss is not None else 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if snapshot is not None:
            shots.append(snapshot(model))
    return shots


def test_crossattn_adapter_training_changes_memory_only(saved):
    """A few optimizer steps (the engine's groups and schedule): the pretrained weights stay bit-identical;
    the bank, W_Q, W_K, W_V, W_O and the router move."""
    r = adapter_recipe(saved["llama"], {"chapters": 4, "top_k": 2, "balance_loss": 0.0},
                       memory={"optimizer": {"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.0}},
                       train={"max_steps": 3})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    original = base_state(model)
    start = {n: p.detach().clone() for n, p in model.crossattn.named_parameters()}
    _train_steps(model, r, 3, tokens(4))
    after = base_state(model)
    assert set(after) == set(original)
    for n, w in original.items():
        assert torch.equal(after[n], w), n
    moved = {n for n, p in model.crossattn.named_parameters() if not torch.equal(p, start[n])}
    for name in ("banks.0.weight", "parts.0.attn.wq.weight", "parts.0.attn.wk.weight", "parts.0.attn.wv.weight",
                 "parts.0.attn.wo.weight", "parts.0.attn.router.proj.weight", "parts.2.attn.router.proj.weight"):
        assert name in moved, name


@pytest.mark.parametrize("routing", ["sequence", "token"])
def test_crossattn_adapter_router_gets_gradients_once_wo_is_nonzero(saved, routing):
    model = adapter(saved["llama"], {"chapters": 4, "top_k": 2, "routing": routing, "balance_loss": 0.0})
    x = tokens()

    def router_grads() -> list[float]:
        model.zero_grad()
        lm_loss(model(x).logits, x).backward()
        return [float(part.attn.router.proj.weight.grad.abs().sum()) for part in model.crossattn.parts.values()]

    assert router_grads() == [0.0, 0.0, 0.0]  # W_O = 0: the memory read, routing included, has no effect yet
    perturb_outputs(model)
    assert all(g > 0 for g in router_grads())


def test_crossattn_adapter_freeze_bank_at_stops_the_bank_and_wk_wv(saved):
    """Section 5.5: the bank and its W_K, W_V train at bank_lr until freeze_bank_at, then stop (bit-identical)
    while W_Q and W_O keep training; freeze_bank freezes them from the start."""
    from memtrain.parallel.engine import build_optimizer, lr_at

    r = adapter_recipe(saved["llama"], {"chapters": 4, "top_k": 2, "bank_lr": 2e-3, "freeze_bank_at": 2},
                       memory={"optimizer": {"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 1e-3}},
                       train={"max_steps": 5, "schedule": {"kind": "constant", "warmup": 0}})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    groups = build_optimizer(model, r).param_groups
    assert {g["role"] for g in groups} == {"memory", "bank"}
    assert all(g["lr"] == (2e-3 if g["role"] == "bank" else 1e-2) for g in groups)
    assert [lr_at(r, "bank")(s) for s in range(4)] == [2e-3, 2e-3, 0.0, 0.0]

    def snapshot(m):
        return {n: p.detach().clone() for n, p in m.crossattn.named_parameters()}

    start = snapshot(model)
    shots = _train_steps(model, r, 4, tokens(4), snapshot)
    bank_names = {n for n, p in model.crossattn.named_parameters()
                  if id(p) in {id(q) for q in model.bank_parameters()}}
    assert {"banks.1.weight", "parts.1.attn.wk.weight", "parts.1.attn.wv.weight"} <= bank_names
    for n in bank_names:
        assert not torch.equal(shots[1][n], start[n]), n  # trained in steps 0 and 1
        assert torch.equal(shots[3][n], shots[1][n]), n  # frozen from step 2 on: not even weight decay
    for n in ("parts.1.attn.wq.weight", "parts.1.attn.wo.weight"):
        assert not torch.equal(shots[3][n], shots[1][n]), n
    frozen = adapter(saved["llama"], {"freeze_bank": True})
    assert not any(p.requires_grad for p in frozen.bank_parameters())
    assert all(p.requires_grad for p in frozen.memory_parameters())


def test_crossattn_adapter_lowers_the_loss_on_a_learnable_task(saved):
    """A frozen random Llama cannot predict a fixed next-token permutation; memory adapters (variant B in the
    last layer) learn it within a few dozen steps on CPU."""
    r = adapter_recipe(saved["llama"], {"tokens": 64, "variant": "B", "placement": "last", "placement_k": 1},
                       memory={"optimizer": {"lr": 1e-2, "min_lr": 1e-2, "weight_decay": 0.0}},
                       train={"max_steps": 40, "schedule": {"kind": "constant", "warmup": 0}})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(V, generator=g)
    x = torch.randint(0, V, (16, 1), generator=g)
    for _ in range(T - 1):
        x = torch.cat([x, perm[x[:, -1:]]], dim=1)
    with torch.no_grad():
        first = float(lm_loss(model(x).logits, x))
    _train_steps(model, r, 40, x)
    with torch.no_grad():
        last = float(lm_loss(model(x).logits, x))
    assert last < first / 3, (first, last)  # 5.2 -> 0.4 nats when written


def test_crossattn_adapter_activation_checkpointing_gives_the_same_gradients(saved):
    model = adapter(saved["gemma3"], {"chapters": 4, "top_k": 2, "routing": "token"})
    perturb_outputs(model)
    x = tokens()

    def grads():
        model.zero_grad()
        out = model(x)
        (lm_loss(out.logits, x) + out.aux_loss).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = grads()
    model.set_activation_checkpointing(True)
    assert model.hf_model.is_gradient_checkpointing
    checkpointed = grads()
    assert set(plain) == set(checkpointed) and any("router" in n for n in plain)
    for n, g in plain.items():
        torch.testing.assert_close(checkpointed[n], g, rtol=1e-4, atol=1e-7)


# -------------------------------------------------------------------------------------------------
# LoRA


def test_crossattn_adapter_with_lora_trains_lora_and_memory_only(saved):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    r = adapter_recipe(saved["qwen2"], {"lora": lora}, memory={"optimizer": {"lr": 1e-2, "min_lr": 1e-3}},
                       train={"max_steps": 3})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    plain = AutoModelForCausalLM.from_pretrained(saved["qwen2"], dtype=torch.float32).eval()
    x = tokens()
    model.eval()
    with torch.no_grad():  # lora_B = 0 and W_O = 0: still the pretrained model
        torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=1e-5)
    model.train()
    lora_ids = {id(p) for p in model.lora_parameters()}
    assert lora_ids and all("lora_" in n for n, p in model.hf_model.named_parameters() if id(p) in lora_ids)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == lora_ids | {id(p) for p in model.memory_parameters() + model.bank_parameters()}
    original = base_state(model)
    assert set(original) == set(dict(plain.named_parameters()))
    lora_start = {n: p.detach().clone() for n, p in model.hf_model.named_parameters() if "lora_B" in n}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        lm_loss(model(x).logits, x).backward()
        opt.step()
    after = base_state(model)
    for n, w in original.items():
        assert torch.equal(after[n], w), n
    assert all(not torch.equal(p, lora_start[n]) for n, p in model.hf_model.named_parameters() if "lora_B" in n)
    # LoRA only (Section 5.4's LoRA baseline): no memory layers
    only = adapter(saved["qwen2"], {"memory_layers": False, "lora": lora})
    assert only.crossattn is None and not only.memory_parameters() and not only.bank_parameters()
    assert {id(p) for p in only.parameters() if p.requires_grad} == {id(p) for p in only.lora_parameters()}
    assert only(x).aux_loss is None and "none" in only.describe()[0]


def test_crossattn_adapter_lora_trains_at_its_own_learning_rate(saved):
    """The parameter-group role ``lora`` (memory.crossattn.lora_lr on train.schedule's warmup and cosine, to the
    fraction memory.optimizer.min_lr / lr of it) next to ``memory`` and ``bank``."""
    from memtrain.parallel.engine import build_optimizer, build_scheduler, lr_at, peak_lr

    r = adapter_recipe(saved["llama"], {"lora": {"r": 4, "alpha": 8}, "lora_lr": 5e-3, "bank_lr": 2e-3},
                       memory={"optimizer": {"lr": 1e-2, "min_lr": 1e-3}},
                       train={"max_steps": 6, "schedule": {"kind": "cosine", "warmup": 2}})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    opt = build_optimizer(model, r)
    roles = {}
    for g in opt.param_groups:
        roles.setdefault(g["role"], set()).update(id(p) for p in g["params"])
    assert set(roles) == {"memory", "bank", "lora"}
    assert roles["lora"] == {id(p) for p in model.lora_parameters()}
    assert peak_lr(r, "lora") == pytest.approx((5e-3, 5e-4))
    sched = build_scheduler(opt, r)
    for step in range(r.max_steps):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr_at(r, g["role"])(step), rel=1e-12)
        opt.step()
        sched.step()


# -------------------------------------------------------------------------------------------------
# Recipe checks


@pytest.mark.parametrize("memory, sections, key, match", [
    ({}, {"model": {"type": "titans", "pretrained": None}}, "memory.type", "not 'titans'"),
    ({"lora": {"r": 4}}, {"model": {"type": "decoder", "pretrained": None}}, "memory.crossattn.lora",
     "model.type hf"),
    ({"train_base": True}, {"model": {"type": "decoder", "pretrained": None}}, "memory.crossattn.train_base",
     "model.type hf"),
    ({"train_base": True, "lora": {"r": 4}}, {}, "memory.crossattn.train_base", "redundant"),
    ({"train_base": True}, {"memory": {"freeze_anchor": True}}, "memory.crossattn.train_base",
     "contradicts memory.freeze_anchor"),
    ({"memory_layers": False}, {}, "memory.crossattn.memory_layers", "only LoRA could train"),
    ({"memory_layers": False, "lora": {"freeze": True}}, {}, "memory.crossattn.memory_layers", "only LoRA"),
    ({"lora": {"dropout": 1.0}}, {}, "memory.crossattn.lora.dropout", r"\[0, 1\)"),
    ({"lora": {"target_modules": []}}, {}, "memory.crossattn.lora.target_modules", "is empty"),
    ({"lora": {"rank": 4}}, {}, "memory.crossattn.lora.rank", "unknown key"),
    ({"lora_lr": 0}, {}, "memory.crossattn.lora_lr", "must be positive"),
    ({"layers": [1, 1]}, {}, "memory.crossattn.layers", "distinct"),
    ({}, {"parallel": {"zero_stage": 3}}, "parallel.zero_stage", "ZeRO stage 0, 1 or 2"),
])
def test_crossattn_adapter_bad_recipes_name_the_key(memory, sections, key, match):
    data = {"model": {"type": "hf", "pretrained": "org/model"}, "memory": {"type": "crossattn", "crossattn": memory}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(RecipeError, match=match) as err:
        recipe_from_dict(data)
    assert err.value.key == key


@pytest.mark.parametrize("memory, key, match", [
    ({"placement": "last", "placement_k": 4}, "memory.crossattn.placement_k", "more than the 3 decoder layers"),
    ({"layers": [0, 3]}, "memory.crossattn.layers", "beyond the 3 layers"),
    ({"dim": 30, "heads": 4}, "memory.crossattn.heads", "does not split into 4 heads"),
    ({"lora": {"target_modules": ["nope_proj"]}}, "memory.crossattn.lora.target_modules", "do not fit"),
])
def test_crossattn_adapter_settings_beyond_the_model_name_the_key(saved, memory, key, match):
    """The recipe's model.* shape keys do not describe a pretrained model: placement and widths are checked
    against its own config when it is built (one RecipeError naming the key)."""
    with pytest.raises(RecipeError, match=match) as err:
        adapter(saved["llama"], memory)
    assert err.value.key == key


def test_crossattn_adapter_refuses_models_it_cannot_attach_to(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=T)).save_pretrained(tmp_path)
    with pytest.raises(RecipeError, match="is not supported by memory adapters") as err:
        adapter(str(tmp_path))
    assert err.value.key == "model.pretrained"


def test_crossattn_adapter_recipes_do_not_use_the_decoder_shape_keys():
    # 10 of the last layers of a deep pretrained model: model.n_layers (8 by default) is not its depth
    r = recipe_from_dict({"model": {"type": "hf", "pretrained": "org/model"},
                          "memory": {"type": "crossattn", "crossattn": {"placement": "last", "placement_k": 10,
                                                                        "layers": None, "dim": 96, "heads": 7}}})
    assert r.memory.crossattn.placement_k == 10
    assert recipe_from_dict(yaml.safe_load(r.to_yaml())).memory.crossattn == r.memory.crossattn  # round trip


# -------------------------------------------------------------------------------------------------
# The recipes of Section 5.4, and memtrain train end to end

ARMS = ("full", "lora", "memory", "memory-lora")
SEQ = 32


def test_crossattn_adapter_comparison_recipes_build_their_arms(saved):
    """The four arms of Section 5.4 on the tiny Qwen2 (model.pretrained overridden): what trains in each."""
    trainable = {}
    for arm in ARMS:
        r = load_recipe(REPO / f"recipes/crossattn-adapter-{arm}-qwen2.5-1.5b.yaml",
                        [f"model.pretrained={saved['qwen2']}"]
                        + (["memory.crossattn.dim=32", "memory.crossattn.heads=2"] if "memory" in arm else []))
        assert r.model.pretrained == saved["qwen2"] and r.data.seq_len == 2048 and r.sequences_per_step == 64
        torch.manual_seed(0)
        model = build(r.model, r.memory)
        params = dict(model.named_parameters())
        trainable[arm] = {n for n, p in params.items() if p.requires_grad}
        frozen = set(params) - trainable[arm]
        if arm == "full":
            assert isinstance(model, HFMemoryLM) and not frozen  # memory.type none: every weight trains
            continue
        assert isinstance(model, CrossAttnAdapterLM) and all(n.startswith("hf_model.") for n in frozen)
        assert {id(params[n]) for n in frozen} == {id(p) for p in model.anchor_parameters()}
        assert any("lora_" in n for n in trainable[arm]) == ("lora" in arm)
        assert any(n.startswith("crossattn.") for n in trainable[arm]) == ("memory" in arm)
    assert all(n.startswith("crossattn.") for n in trainable["memory"])
    assert trainable["memory-lora"] == trainable["memory"] | trainable["lora"]
    paper = load_recipe(REPO / "recipes/crossattn-adapter-memory-lora-qwen2.5-1.5b.yaml")
    c = paper.memory.crossattn
    assert paper.model.pretrained == "Qwen/Qwen2.5-1.5B" and c.lora.r == 16 and c.lora_lr < paper.memory.optimizer.lr
    assert c.bank_lr < paper.memory.optimizer.lr and c.dim == 512 and c.placement == "every"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1"})
    return env


def tiny_arm_recipe(root: Path, arm: str) -> dict:
    """recipes/crossattn-adapter-<arm>-qwen2.5-1.5b.yaml on the tiny local Llama and corpus: the model, data,
    length, batch and sizes shrunk; everything else as shipped."""
    data = yaml.safe_load((REPO / f"recipes/crossattn-adapter-{arm}-qwen2.5-1.5b.yaml").read_text())
    data["run"] = {"name": f"crossattn-adapter-{arm}-tiny", "seed": 3}
    data["model"]["pretrained"] = str(root / "tiny-llama")
    data["data"] = {"dir": str(root / "data"), "sources": [str(root / "docs.jsonl")], "seq_len": SEQ,
                    "val_fraction": 0.05, "tokenizer": {"path": str(root / "tiny-llama")}}
    data["train"].update({"max_steps": 6, "global_batch_tokens": 4 * SEQ, "micro_batch_size": 2,
                          "schedule": {"kind": "cosine", "warmup": "1 steps"},
                          "eval": {"every_steps": 3, "batches": 2}})
    data["parallel"] = {"zero_stage": 0, "precision": "fp32"}
    data["checkpoint"] = {"every_steps": 3, "keep_last": 3}
    data["logging"] = {"every_steps": 1}
    data.pop("slurm")
    return data


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The tiny Llama folder (model + tokenizer), a small jsonl corpus and its prepared data."""
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("crossattn-adapter")
    make_tiny_llama(root / "tiny-llama", documents=300, layers=3)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::10]))
    (root / "tiny.yaml").write_text(yaml.safe_dump(tiny_arm_recipe(root, "memory-lora")))
    prepare(load_recipe(root / "tiny.yaml"))
    return root


@pytest.mark.slow
def test_crossattn_adapter_trains_end_to_end_with_memtrain_train(root):
    """`memtrain train` on the memory adapters + LoRA arm with a routed bank and staged freezing: the frozen base
    stays the model folder's, LoRA and the memory move, the bank and W_K, W_V stop at freeze_bank_at, the
    router statistics and both memory learning rates are logged."""
    overrides = [f"run.dir={root / 'runs' / 'e2e'}", "memory.crossattn.tokens=64", "memory.crossattn.dim=32",
                 "memory.crossattn.heads=2", "memory.crossattn.chapters=4", "memory.crossattn.top_k=2",
                 "memory.crossattn.routing=token", "memory.crossattn.freeze_bank_at=3",
                 "memory.crossattn.lora.r=4", "memory.crossattn.lora.alpha=8", "memory.crossattn.lora.dropout=0.0"]
    cmd = [sys.executable, "-m", "memtrain", "train", str(root / "tiny.yaml"), *overrides]
    out = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert "cross-attention memory: 1 layer(s) [0], variant A" in out.stdout
    assert out.stdout.count("step 3: the cross-attention bank and its W_K, W_V are frozen from here on") == 1
    rows = {m["step"]: m for m in map(json.loads, (root / "runs/e2e/metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(1, 7))
    assert all(m["loss/train"] == m["loss/train"] for m in rows.values())  # finite
    assert rows[1]["optim/bank_lr"] > 0 and rows[4]["optim/bank_lr"] == rows[6]["optim/bank_lr"] == 0.0
    assert rows[4]["optim/memory_lr"] > 0 and "memory_module/chapter_entropy" in rows[6]
    # the load-balancing term apart from the LM loss: balance_loss 0.01 x the one routed layer's router loss
    assert rows[2]["loss/balance"] == pytest.approx(0.01 * rows[2]["memory_module/router_loss"], rel=1e-5)
    from memtrain.parallel.engine import lr_at

    assert rows[2]["optim/lora_lr"] == pytest.approx(lr_at(load_recipe(root / "tiny.yaml"), "lora")(1))
    assert "memory adapters: LoRA r=" in out.stdout  # describe() in the training log
    assert "loss/val" in rows[6]

    from safetensors.torch import load_file

    def state(step: int) -> dict:
        path = root / "runs/e2e/checkpoints" / f"global_step{step}" / "mp_rank_00_model_states.pt"
        return torch.load(path, weights_only=True)["module"]

    original = load_file(str(root / "tiny-llama" / "model.safetensors"))
    mid, end = state(3), state(6)
    base = {k.removeprefix("hf_model.base_model.model.").replace(".base_layer.", "."): k
            for k in end if k.startswith("hf_model.") and "lora_" not in k}
    assert set(base) == set(original)
    for name, key in base.items():
        assert torch.equal(end[key], original[name]), name
    assert any("lora_B" in k and not torch.equal(end[k], mid[k]) for k in end)
    for k in ("crossattn.banks.0.weight", "crossattn.parts.0.attn.wk.weight", "crossattn.parts.0.attn.wv.weight"):
        assert torch.equal(end[k], mid[k]), k  # frozen from step 3 (0-based) on
    for k in ("crossattn.parts.0.attn.wq.weight", "crossattn.parts.0.attn.wo.weight",
              "crossattn.parts.0.attn.router.proj.weight"):
        assert not torch.equal(end[k], mid[k]), k
    # Resumed past freeze_bank_at, the run freezes the bank again before its first step.
    out = subprocess.run([*cmd, "train.max_steps=8"], cwd=root, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-5000:]
    assert out.stdout.count("step 6: the cross-attention bank and its W_K, W_V are frozen from here on") == 1
    assert torch.equal(state(8)["crossattn.banks.0.weight"], mid["crossattn.banks.0.weight"])
