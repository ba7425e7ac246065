"""Hierarchical parametric memories (hierarchical-memories paper, Sections 2.1-2.2, 4, Appendices F, I):
sizes against the paper's worked example and tables, no effect at initialisation, per-sequence
memories, gradients on fetched rows only, the generic memory, and recipe validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from memtrain.config import MemoryConfig, ModelConfig, RecipeError, recipe_from_dict
from memtrain.model import build
from memtrain.model.anchor import anchor_dims
from memtrain.model.hierarchical import FetchedMemory, MemoryLayout, generic_mask, placement_layers, spread
from memtrain.parallel.bank import MemoryBank

OPENLM_160M = ModelConfig(d_model=512, n_layers=35, n_heads=12, head_dim=32, ffn_dim=2048, tie_embeddings=True)
OPENLM_410M = ModelConfig(d_model=1024, n_layers=24, n_heads=16, ffn_dim=2816)
OPENLM_1B = ModelConfig(d_model=2048, n_layers=24, n_heads=16, ffn_dim=5632)

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=24)
TINY_GQA = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=24,
                       norm="rmsnorm", qk_norm=False)
KINDS = [("ffn", "ffn"), ("lora", "qk"), ("lora", "vo"), ("lora", "ffn"), ("kv", "ffn")]
K = 3


def layout(cfg: ModelConfig, levels, kind="ffn", target="ffn", branching=16, **kw) -> MemoryLayout:
    return MemoryLayout.build(MemoryConfig(type=kind, levels=list(levels), lora_target=target, **kw), anchor_dims(cfg),
                              branching)


# --------------------------------------------------------------------------------------------------
# Sizes


def test_appendix_i1_worked_example():
    """(256, 64, 16, 0) FFN memories on the 160M anchor: c0 = 3 l d = 53,760; fetched 18,063,360 and
    bank 4,624,220,160 parameters (Appendix I.1)."""
    lay = layout(OPENLM_160M, (256, 64, 16, 0))
    assert lay.c0 == 53_760
    assert [lay.block_size(l) for l in range(4)] == [13_762_560, 3_440_640, 860_160, 0]
    assert lay.fetched_parameters == 18_063_360
    assert lay.bank_parameters == 4_624_220_160


@pytest.mark.parametrize("levels, bank_b, fetched_m", [
    ((0, 16, 4, 1), 4.6, 1.1), ((98, 42, 18, 0), 4.6, 8.5), ((256, 64, 16, 0), 4.6, 18.1),
    ((768, 96, 12, 0), 4.6, 47.1), ((1792, 112, 7, 0), 4.6, 102.7), ((5376, 0, 0, 0), 4.6, 289),
    # Table 9 prints 18.1 here, the same as (256, 64, 16, 0): it leaves out s_4 = 4 c0 = 215,040, which the
    # bank size 18.7B does include (16 s_1 + 16^2 s_2 + 16^3 s_3 + 16^4 s_4 = 18,717,081,600).
    ((256, 64, 16, 4), 18.7, 18.28), ((328, 156, 74, 0), 18.7, 30), ((1216, 164, 22, 3), 18.7, 75.5),
    ((4096, 320, 17, 2), 18.7, 238.4),
])
def test_table9_configurations(levels, bank_b, fetched_m):
    """Every row of Table 9 (160M anchor): bank size in B and fetched size in M, as the paper rounds them."""
    lay = layout(OPENLM_160M, levels)
    assert round(lay.bank_parameters / 1e9, 1) == bank_b
    assert lay.fetched_parameters / 1e6 == pytest.approx(fetched_m, abs=0.06 if fetched_m < 100 else 0.6)


@pytest.mark.parametrize("cfg, levels, bank_b, fetched_m", [
    (OPENLM_160M, (256, 64, 16, 0), 4.6, 18), (OPENLM_410M, (512, 128, 32, 0), 12.7, 50),
    (OPENLM_1B, (768, 256, 16, 0), 21.1, 153),
])
def test_table1_rows(cfg, levels, bank_b, fetched_m):
    lay = layout(cfg, levels)
    assert round(lay.bank_parameters / 1e9, 1) == bank_b
    assert round(lay.fetched_parameters / 1e6) == fetched_m


def test_lora_and_kv_sizes_follow_appendix_i():
    """LoRA-QK and -VO: 2 r l (d + h d_h); LoRA-FFN: 3 r l (d + d_f); KV: 2 r l h d_h; FFN: 3 r l d."""
    cfg, r = OPENLM_160M, 7
    d, h_dh, f, l = 512, 12 * 32, 2048, 35
    sizes = {(k, t): layout(cfg, (0, r, 0, 0), k, t).block_size(1) for k, t in KINDS}
    assert sizes[("lora", "qk")] == 2 * r * l * (d + h_dh)
    assert sizes[("lora", "vo")] == 2 * r * l * (d + h_dh)
    assert sizes[("lora", "ffn")] == 3 * r * l * (d + f)
    assert sizes[("kv", "ffn")] == 2 * r * l * h_dh
    assert sizes[("ffn", "ffn")] == 3 * r * l * d


@pytest.mark.parametrize("placement, layers", [("uniform", list(range(35))), ("early", list(range(10))),
                                               ("middle", list(range(12, 22))), ("late", list(range(25, 35)))])
def test_placement_moves_the_same_parameters(placement, layers):
    """Appendix F: early / middle / late put the uniform total on 10 layers; sizes never change."""
    lay = layout(OPENLM_160M, (0, 64, 0, 0), placement=placement)
    assert list(lay.layers) == layers
    assert sum(lay.units[1]) == 64 * 35
    assert lay.block_size(1) == layout(OPENLM_160M, (0, 64, 0, 0)).block_size(1)
    assert [lay.layer_rank(i) for i in layers] == spread(64 * 35, len(layers))
    assert placement_layers("late", 4, 10) == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------------------
# Model with memories


def models(cfg: ModelConfig, kind: str, target: str, levels=(2, 3), **kw):
    mem = MemoryConfig(type=kind, levels=list(levels), lora_target=target, **kw)
    torch.manual_seed(0)
    with_mem = build(cfg, mem, branching=K)
    torch.manual_seed(0)
    plain = build(cfg, None)
    bank = MemoryBank(with_mem.memory_layout, seed=5)
    return with_mem, plain, bank


def batch(B=4, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (B, T), generator=g)
    leaf = torch.tensor([0, 4, 4, 8][:B])
    ids = torch.stack([leaf // K, leaf], dim=1)  # level-1 and level-2 ids of each leaf
    return x, ids


@pytest.mark.parametrize("cfg", [TINY, TINY_GQA], ids=["openlm", "llama-gqa"])
@pytest.mark.parametrize("kind, target", KINDS)
def test_memories_have_no_effect_at_initialisation(cfg, kind, target):
    """Identical logits with and without memories, fetched and generic, for every memory type."""
    model, plain, bank = models(cfg, kind, target)
    x, ids = batch()
    generic = torch.tensor([False, True, False, False])
    with torch.no_grad():
        ref = plain(x).logits
        assert torch.equal(model(x).logits, ref)  # no memory passed: the anchor alone
        torch.testing.assert_close(model(x, memory=bank.fetch(ids, generic)).logits, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(x, memory=FetchedMemory.all_generic(4, 2)).logits, ref, rtol=0, atol=1e-6)


def _perturb(bank: MemoryBank, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in bank.parameters():
            t.add_(torch.randn(t.shape, generator=g) * 0.2)


@pytest.mark.parametrize("kind, target", KINDS)
def test_a_sequence_depends_only_on_its_own_blocks(kind, target):
    """Changing the rows fetched by sequence 0 only changes sequence 0; the batched forward equals
    running each sequence alone with its own memory."""
    model, _, bank = models(TINY, kind, target)
    _perturb(bank)
    x, ids = batch()
    with torch.no_grad():
        before = model(x, memory=bank.fetch(ids)).logits
        alone = torch.cat([model(x[i:i + 1], memory=bank.fetch(ids[i:i + 1])).logits for i in range(4)])
        torch.testing.assert_close(before, alone, rtol=1e-5, atol=1e-5)
        bank.tables[1][0].add_(1.0)  # the level-2 block of leaf 0, fetched by sequence 0 only
        after = model(x, memory=bank.fetch(ids)).logits
    assert not torch.allclose(after[0], before[0])
    assert torch.equal(after[1:], before[1:])


@pytest.mark.parametrize("kind, target", KINDS)
def test_gradients_reach_exactly_the_fetched_rows(kind, target):
    model, _, bank = models(TINY, kind, target)
    _perturb(bank)  # away from init, where zero B / w3 parts would zero some gradients
    x, ids = batch()
    generic = torch.tensor([False, False, False, True])  # sequence 3 (leaf 8) uses the generic memory
    model(x, memory=bank.fetch(ids, generic)).logits.square().mean().backward()
    for level, table in enumerate(bank.tables):
        touched = sorted(set(ids[:3, level].tolist()))
        assert (table.grad.abs().sum(1) > 0).nonzero().flatten().tolist() == touched
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.generic_memory.parameters())


def test_generic_memory_replaces_the_fetched_blocks():
    model, _, bank = models(TINY, "ffn", "ffn")
    _perturb(bank)
    with torch.no_grad():
        for p in model.generic_memory.parameters():
            p.normal_(0, 0.2)
    x, ids = batch()
    generic = torch.tensor([True, False, True, False])
    with torch.no_grad():
        mixed = model(x, memory=bank.fetch(ids, generic)).logits
        fetched = model(x, memory=bank.fetch(ids)).logits
        all_generic = model(x, memory=FetchedMemory.all_generic(4, 2)).logits
    torch.testing.assert_close(mixed[generic], all_generic[generic], rtol=0, atol=1e-6)
    torch.testing.assert_close(mixed[~generic], fetched[~generic], rtol=0, atol=1e-6)
    assert not torch.allclose(fetched[0], all_generic[0])


def test_generic_probability_is_one_over_k_plus_one():
    """Section 4: generic memory with probability 1/(k+1) per sequence (k = 16: 1/17)."""
    recipe = recipe_from_dict({"data": {"clustering": {"enabled": True}},
                               "memory": {"type": "ffn", "levels": [1, 1, 1, 0]}})
    assert recipe.generic_prob == 1 / 17
    n = 200_000
    draws = generic_mask(torch.arange(n), 5, 0, recipe.generic_prob)
    sigma = math.sqrt(n * (1 / 17) * (16 / 17))
    assert abs(int(draws.sum()) - n / 17) < 4 * sigma
    # Independent across steps (a hash of seed, step and sample index) and the same for the same key.
    other = generic_mask(torch.arange(n), 6, 0, recipe.generic_prob)
    assert abs(int((draws & other).sum()) - n / 17**2) < 4 * math.sqrt(n / 17**2)
    assert torch.equal(generic_mask(torch.arange(n).flip(0), 5, 0, recipe.generic_prob).flip(0), draws)
    assert torch.equal(generic_mask(torch.tensor([7, 70_000]), 5, 0, 1 / 17), draws[[7, 70_000]])
    assert recipe_from_dict({**recipe.to_dict(), "memory": {**recipe.to_dict()["memory"], "generic_prob": 0.0}}
                            ).generic_prob == 0.0


def test_bank_counters_and_state_round_trip():
    model, _, bank = models(TINY, "ffn", "ffn")
    x, ids = batch()
    bank.fetch(ids, torch.tensor([False, False, False, True]))
    stats = bank.stats()
    assert stats["memory_module/rows_touched_frac/level1"] == 2 / 3  # level-1 ids 0, 1 of 3
    assert stats["memory_module/rows_touched_frac/level2"] == 2 / 9  # leaves 0, 4 of 9
    assert stats["memory_module/generic_rate"] == 0.25
    assert bank.stats()["memory_module/rows_touched_frac/all"] == 0.0  # reset
    bank.build_optimizer(1e-2, (0.9, 0.95), 1e-8, 0.1)
    model(x, memory=bank.fetch(ids)).logits.square().mean().backward()
    bank.step(1e-2)
    state = bank.state_dict()
    other = MemoryBank(model.memory_layout, seed=99)
    other.build_optimizer(1e-2, (0.9, 0.95), 1e-8, 0.1)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(bank.parameters(), other.parameters()))
    wrong = MemoryBank(MemoryLayout.build(MemoryConfig(type="ffn", levels=[2, 4]), anchor_dims(TINY), K))
    with pytest.raises(ValueError, match="levels"):
        wrong.load_state_dict(state)


def test_dense_adamw_moves_untouched_rows_by_weight_decay_only():
    """The single-process bank is dense AdamW: a row not fetched in a step has zero gradient and only
    decays (lr * wd * w), exactly as torch.optim.AdamW on the whole table."""
    model, _, bank = models(TINY, "ffn", "ffn")
    bank.build_optimizer(1e-2, (0.9, 0.95), 1e-8, 0.1)
    before = bank.tables[1].detach().clone()
    x, ids = batch()
    model(x, memory=bank.fetch(ids)).logits.square().mean().backward()
    bank.step(1e-2)
    untouched = 2  # leaf 2 is fetched by no sequence
    torch.testing.assert_close(bank.tables[1][untouched], before[untouched] * (1 - 1e-2 * 0.1))


def test_bad_ids_are_rejected():
    _, _, bank = models(TINY, "ffn", "ffn")
    with pytest.raises(ValueError, match=r"level-2 cluster ids must lie in \[0, 9\)"):
        bank.fetch(torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match="one id per level"):
        bank.fetch(torch.tensor([0, 1]))


def test_activation_checkpointing_gives_the_same_gradients():
    model, _, bank = models(TINY, "lora", "ffn")
    _perturb(bank)
    x, ids = batch()
    grads = []
    for flag in (False, True):
        model.set_activation_checkpointing(flag)
        model.train()
        for t in bank.parameters():
            t.grad = None
        model(x, memory=bank.fetch(ids)).logits.square().mean().backward()
        grads.append([t.grad.clone() for t in bank.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------------------------
# Recipes


def memory_recipe(**memory):
    return {"data": {"clustering": {"enabled": True, "branching": 4, "depth": 2}},
            "memory": {"type": "ffn", "levels": [2, 1], **memory}}


@pytest.mark.parametrize("change, key", [
    ({"levels": [1]}, "memory.levels"),
    ({"levels": [0, 0]}, "memory.levels"),
    ({"generic_prob": 1.0}, "memory.generic_prob"),
    ({"placement_layers": 0}, "memory.placement_layers"),
    ({"optimizer": {"lr": 1e-4, "min_lr": 1e-3}}, "memory.optimizer.min_lr"),
])
def test_bad_memory_settings_name_the_key(change, key):
    with pytest.raises(RecipeError, match=rf"^recipe error: {re.escape(key)}") as e:
        recipe_from_dict(memory_recipe(**change))
    assert e.value.key == key


def test_memory_needs_clustered_data_and_a_decoder():
    with pytest.raises(RecipeError, match="data.clustering.enabled"):
        recipe_from_dict({"memory": {"type": "ffn", "levels": [1, 1, 1, 1]}})
    with pytest.raises(RecipeError, match="not 'titans'"):
        recipe_from_dict({**memory_recipe(), "model": {"type": "titans"}})
    assert recipe_from_dict({**memory_recipe(grad_clip="separate"), "parallel": {"zero_stage": 2}})
    for stage in (1, 2, 3):  # DeepSpeed clips the anchor by the joint norm (JointNorm)
        assert recipe_from_dict({**memory_recipe(grad_clip="joint"), "parallel": {"zero_stage": stage}})
    from memtrain.parallel.engine import joint_clipping

    picks = {(st, prec): joint_clipping(recipe_from_dict({**memory_recipe(), "parallel": {"zero_stage": st}}), prec)
             for st in (0, 1, 2, 3) for prec in ("fp32", "bf16")}
    assert picks == {(0, "fp32"): True, (0, "bf16"): False, (1, "fp32"): True, (1, "bf16"): True,
                     (2, "fp32"): True, (2, "bf16"): True, (3, "fp32"): True, (3, "bf16"): True}
    with pytest.raises(RecipeError, match="FFN memories"):
        recipe_from_dict({**memory_recipe(type="kv"), "model": {"type": "hf", "pretrained": "x"}})


def test_a_level_nobody_fetched_still_takes_a_dense_step():
    """All sequences generic: no row gets a gradient, yet every table decays (dense AdamW over the whole
    bank, the same in one process as on many ranks, where the all-reduce fills zeros)."""
    model, _, bank = models(TINY, "ffn", "ffn")
    bank.build_optimizer(1e-2, (0.9, 0.95), 1e-8, 0.1)
    before = [t.detach().clone() for t in bank.parameters()]
    x, ids = batch()
    model(x, memory=bank.fetch(ids, torch.ones(4, dtype=torch.bool))).logits.square().mean().backward()
    bank.step(1e-2)
    for b, t in zip(before, bank.parameters()):
        torch.testing.assert_close(t.detach(), b * (1 - 1e-2 * 0.1))


@pytest.mark.parametrize("name, fetched, bank", [
    ("hmem-160m-a3-frozen", 18_063_360, 4_624_220_160), ("hmem-160m-a2-cotrain", 18_063_360, 4_624_220_160),
    ("hmem-160m-a4-scratch", 18_063_360, 4_624_220_160), ("hmem-160m-table9", 18_063_360, 4_624_220_160),
    ("hmem-410m-b2", 49_545_216, 12_683_575_296), ("hmem-1b-c2", 153_354_240, 21_139_292_160),
])
def test_paper_recipes_resolve_to_their_table_sizes(name, fetched, bank):
    from pathlib import Path

    from memtrain.config import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml")
    with torch.device("meta"):
        model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    assert (model.memory_layout.fetched_parameters, model.memory_layout.bank_parameters) == (fetched, bank)
    assert recipe.memory.optimizer.weight_decay == 1e-3 and recipe.data.clustering.branching == 16
    assert recipe.memory.freeze_anchor == (name in ("hmem-160m-a3-frozen", "hmem-160m-table9"))
    assert (recipe.model.init_from is None) == (name == "hmem-160m-a4-scratch")


@pytest.mark.parametrize("name", ["hmem-posthoc-gemma3-270m", "hmem-posthoc-qwen2.5-0.5b", "hmem-posthoc-llama3.2-1b"])
def test_posthoc_recipes_load(name):
    from pathlib import Path

    from memtrain.config import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml")
    assert recipe.model.type == "hf" and recipe.memory.type == "ffn" and recipe.memory.freeze_anchor
    assert recipe.data.tokenizer.path == recipe.model.pretrained


def test_memory_parameters_get_their_own_group_lr_and_decay():
    """Appendices A.2 / A.5: the memories (here the generic memory, part of the DeepSpeed module) have their
    own learning rate, schedule floor and weight decay; the anchor keeps train.optimizer's."""
    from memtrain.parallel.engine import build_optimizer, build_scheduler

    recipe = recipe_from_dict({**memory_recipe(optimizer={"lr": 1e-4, "min_lr": 1e-5, "weight_decay": 1e-3}),
                               "train": {"optimizer": {"lr": 1e-3, "weight_decay": 0.05}, "max_steps": 10,
                                         "schedule": {"warmup": 2, "min_lr": 1e-4}}})
    model = build(TINY, recipe.memory, branching=4)
    opt = build_optimizer(model, recipe)
    roles = {g["role"]: g for g in opt.param_groups}
    assert roles["memory"]["weight_decay"] == 1e-3 and roles["memory"]["lr"] == 1e-4
    assert {id(p) for p in roles["memory"]["params"]} == {id(p) for p in model.memory_parameters()}
    anchor = [g for g in opt.param_groups if g["role"] == "anchor"]
    assert max(g["weight_decay"] for g in anchor) == 0.05 and all(g["lr"] == 1e-3 for g in anchor)
    sched = build_scheduler(opt, recipe)
    for _ in range(10):
        opt.step()
        sched.step()
    assert roles["memory"]["lr"] == pytest.approx(1e-5) and anchor[0]["lr"] == pytest.approx(1e-4)
