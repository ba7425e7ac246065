"""MemoryLlama (memtrain.model.titans.memory_llama): Titans memory injected into a tiny random Hugging Face
Llama at the ELMA / ALMA / GeMA positions. Identity at initialisation, training step, trainable set,
optimizer groups, gate statistics, LoRA (peft), memory state reset / carry. CPU, a few seconds."""

from __future__ import annotations

import math

import pytest
import torch

import transformers  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.model.titans.memory_llama import (
    POSITIONS, default_layers, gate_stats, inject_memory, load_memory_llama, memory_blocks, param_groups,
    reset_memory, set_memory_mode,
)

MEM = dict(heads=2, chunk_size=8)   # NeuralMemory kwargs (dim = hidden size 64)
CLOSED = -30.0                      # sigmoid(-30) = 9e-14: the gate is numerically closed
SIG6 = 1 / (1 + math.exp(6))        # sigmoid(-6), the thesis's initial gate


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def base_model(base_dir):
    return LlamaForCausalLM.from_pretrained(base_dir).eval()


def ids(B: int = 2, T: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def load(base_dir, position="alma", seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("memory_kwargs", MEM)
    return load_memory_llama(base_dir, position, **kw)


def perturb(model, gate_bias: float = 0.0, seed: int = 3) -> None:
    """Make the memory matter: open the gate and give W_h, W_g random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in memory_blocks(model):
            b.w_h.weight.copy_(0.3 * torch.randn(b.w_h.weight.shape, generator=g))
            b.w_g.weight.copy_(0.1 * torch.randn(b.w_g.weight.shape, generator=g))
            b.w_g.bias.fill_(gate_bias)


# -------------------------------------------------------------------------------------------------
# Positions and identity at initialisation


def test_default_layers():
    assert default_layers("elma", 16) == [0, 1]
    assert default_layers("alma", 16) == [14, 15]          # Table B.1: memory_layer_id [14, 15]
    assert default_layers("gema", 16) == list(range(0, 16, 2))
    assert default_layers("gema", 16, every=4) == [0, 4, 8, 12]
    assert default_layers("alma", 1) == [0]
    with pytest.raises(ValueError, match="unknown position 'mal'; expected one of elma, alma, gema"):
        default_layers("mal", 16)


@pytest.mark.parametrize("position", POSITIONS)
def test_identity_with_closed_gate(base_dir, base_model, position):
    """W_x = I, W_h = 0, W_g = 0 and a closed gate: the logits are the base model's (fp32, 1e-5)."""
    model = load(base_dir, position, gate_bias_init=CLOSED).eval()
    assert [b.layer_idx for b in memory_blocks(model)] == default_layers(position, 2)
    x = ids()
    torch.testing.assert_close(logits(model, x), logits(base_model, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", POSITIONS)
def test_thesis_init_is_identity_up_to_the_gate(base_dir, base_model, position):
    """b_g = -6: g = sigmoid(-6) everywhere, y = a + g (m - a): close to the base, not equal (eq. 4.11)."""
    model = load(base_dir, position).eval()
    x = ids()
    diff = (logits(model, x) - logits(base_model, x)).abs().max().item()
    assert 1e-6 < diff < 0.1
    stats = gate_stats(model)
    for b in memory_blocks(model):
        for k in ("gate_mean", "gate_min", "gate_max"):
            assert stats[f"memory_module/layer{b.layer_idx}/{k}"] == pytest.approx(SIG6, rel=1e-5)
        assert stats[f"memory_module/layer{b.layer_idx}/gate_std"] < 1e-9


def test_x_dp_is_exactly_rmsnorm_at_init(base_dir):
    """Eq. 4.4 with W_x = I, W_h = 0: x_DP = RMSNorm(x_t) bit for bit."""
    model = load(base_dir, "elma").eval()
    layer = model.model.layers[0]
    seen = {}
    h1 = layer.input_layernorm.register_forward_hook(lambda m, a, o: seen.update(x=a[0], out=o))
    with torch.no_grad():
        model(ids())
    h1.remove()
    ref = layer.input_layernorm.weight * (seen["x"] * torch.rsqrt(seen["x"].pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(seen["out"], ref, atol=0, rtol=0)


@pytest.mark.parametrize("residual", ["input", "x_dp"])
def test_block_implements_eq_4_1_to_4_10(base_dir, residual):
    """Recompute the block from its parts (perturbed away from the identity) and compare."""
    model = load(base_dir, "elma", residual=residual).eval()
    perturb(model, gate_bias=-1.0)
    block = memory_blocks(model)[1]
    with torch.no_grad():
        block.w_x.weight.add_(0.05 * torch.randn(64, 64, generator=torch.Generator().manual_seed(4)))
    layer = model.model.layers[1]
    seen = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a: seen.update(x=a[0])),
        layer.input_layernorm.register_forward_hook(lambda m, a, o: seen.update(x_dp=o)),
        layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(a=o[0]), prepend=True),
        layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(out=o[0])),
        layer.register_forward_hook(lambda m, a, o: seen.update(layer_out=o)),
    ]
    with torch.no_grad():
        model(ids())
        for h in hooks:
            h.remove()
        x, a = seen["x"], seen["a"]
        normed = layer.input_layernorm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        h_t = block.memory.retrieve(x)                                     # (4.1)-(4.2), M_0
        x_dp = normed @ block.w_x.weight.T + h_t @ block.w_h.weight.T      # (4.3)-(4.4)
        torch.testing.assert_close(seen["x_dp"], x_dp, atol=1e-5, rtol=1e-5)
        m_t, _ = block.memory(a)                                           # (4.6)-(4.7)
        g = torch.sigmoid(a @ block.w_g.weight.T + block.w_g.bias)         # (4.8)
        y = (1 - g) * a + g * m_t                                          # (4.9)
        o = y + (x if residual == "input" else x_dp)                       # (4.10)
        torch.testing.assert_close(seen["out"] + x, o, atol=1e-5, rtol=1e-5)
        post = layer.mlp(layer.post_attention_layernorm(o))
        torch.testing.assert_close(seen["layer_out"], o + post, atol=1e-5, rtol=1e-5)


def test_literal_eq_4_10_residual_is_not_identity(base_dir, base_model):
    """residual="x_dp" (o = y + x_DP as printed) replaces the residual stream by RMSNorm(x)."""
    model = load(base_dir, "alma", gate_bias_init=CLOSED, residual="x_dp").eval()
    x = ids()
    assert (logits(model, x) - logits(base_model, x)).abs().max().item() > 1e-2


def test_inject_validation(base_dir):
    model = LlamaForCausalLM.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="unknown position 'mac'"):
        inject_memory(model, "mac", None, MEM)
    with pytest.raises(ValueError, match=r"layers must be distinct indices in \[0, 2\); got \[0, 0\]"):
        inject_memory(model, "gema", [0, 0], MEM)
    with pytest.raises(ValueError, match=r"layers must be distinct indices in \[0, 2\); got \[2\]"):
        inject_memory(model, "gema", [2], MEM)
    inject_memory(model, "gema", [1], MEM)
    with pytest.raises(ValueError, match="decoder layer 1 already has a memory_block"):
        inject_memory(model, "gema", [1], MEM)
    assert any(k.startswith("model.layers.1.memory_block.") for k in model.state_dict())
    base_keys = set(LlamaForCausalLM(tiny_config()).state_dict())
    assert base_keys <= set(model.state_dict())


# -------------------------------------------------------------------------------------------------
# Training: trainable set, optimizer groups, one step


@pytest.mark.parametrize("position", POSITIONS)
def test_one_step_changes_logits_and_only_memory_trains(base_dir, position):
    model = load(base_dir, position)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".memory_block." in n for n in trainable)
    groups = param_groups(model, memory_lr=1e-3, lora_lr=1e-4, weight_decay=0.1)
    assert {g["name"] for g in groups} == {"memory", "memory_no_decay"}
    grouped = [p for g in groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(trainable)

    x = ids()
    model.eval()
    before = logits(model, x)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model.train()
    opt = torch.optim.AdamW(groups)
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, n
        else:
            assert p.grad is None, n
    opt.step()
    model.eval()
    after = logits(model, x)
    assert (after - before).abs().max().item() > 1e-4
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    assert gate_stats(model)["memory_module/all/w_h_norm"] > 0


def test_param_groups_lrs_and_decay(base_dir):
    model = load(base_dir, "gema")
    groups = {g["name"]: g for g in param_groups(model, memory_lr=3e-4, lora_lr=1e-5, weight_decay=0.1)}
    assert groups["memory"]["lr"] == groups["memory_no_decay"]["lr"] == 3e-4
    assert groups["memory"]["weight_decay"] == 0.1 and groups["memory_no_decay"]["weight_decay"] == 0.0
    block = memory_blocks(model)[0]
    no_decay = {id(p) for p in groups["memory_no_decay"]["params"]}
    assert id(block.w_x.weight) in no_decay and id(block.w_g.bias) in no_decay
    assert id(block.memory.out_norm) in no_decay
    assert id(block.w_h.weight) not in no_decay and id(block.w_g.weight) not in no_decay
    # a trainable parameter that is neither memory nor LoRA needs an explicit learning rate
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="neither memory nor LoRA"):
        param_groups(model, 3e-4, 1e-5, 0.1)
    other = [g for g in param_groups(model, 3e-4, 1e-5, 0.1, other_lr=1e-6) if g["name"] == "other"]
    assert other[0]["lr"] == 1e-6 and other[0]["params"] == [model.lm_head.weight]


def test_gate_stats_keys(base_dir):
    model = load(base_dir, "elma").eval()
    assert gate_stats(model) and all(  # weight norms are there before any forward
        k.split("/")[-1] in ("w_h_norm", "w_x_dev", "w_g_norm", "gate_bias") for k in gate_stats(model))
    logits(model, ids())
    stats = gate_stats(model)
    names = ("gate_mean", "gate_std", "gate_min", "gate_max", "contribution", "contribution_per_token",
             "residual_ratio", "w_h_norm", "w_x_dev", "w_g_norm", "gate_bias")
    scopes = [f"layer{i}" for i in (0, 1)] + ["all"]
    assert set(stats) == {f"memory_module/{s}/{n}" for s in scopes for n in names}
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())
    assert stats["memory_module/all/gate_mean"] == pytest.approx(SIG6, rel=1e-5)
    assert stats["memory_module/all/w_h_norm"] == stats["memory_module/all/w_x_dev"] == 0.0
    assert stats["memory_module/all/gate_bias"] == -6.0
    assert 0 < stats["memory_module/all/contribution"] and 0 < stats["memory_module/all/residual_ratio"]
    perturb(model, gate_bias=0.0)
    logits(model, ids())
    stats = gate_stats(model)
    assert stats["memory_module/all/gate_std"] > 1e-3
    assert stats["memory_module/all/gate_min"] == min(stats[f"memory_module/layer{i}/gate_min"] for i in (0, 1))


# -------------------------------------------------------------------------------------------------
# LoRA


def test_lora(base_dir, base_model):
    model = load(base_dir, "alma", lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}, gate_bias_init=CLOSED)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n in names if "lora_" in n}
    assert lora and all(n in lora or ".memory_block." in n for n in names)
    assert not any("memory_block" in n and "lora_" in n for n in names)  # LoRA never wraps the memory
    x = ids()
    model.eval()
    torch.testing.assert_close(logits(model, x), logits(base_model, x), atol=1e-5, rtol=0)  # lora_B = 0
    groups = {g["name"]: g for g in param_groups(model, memory_lr=1e-3, lora_lr=1e-4, weight_decay=0.1)}
    assert set(groups) == {"memory", "memory_no_decay", "lora"} and groups["lora"]["lr"] == 1e-4
    assert {id(p) for p in groups["lora"]["params"]} == {id(p) for n, p in model.named_parameters() if n in lora}
    model.train()
    opt = torch.optim.AdamW(list(groups.values()))
    model(x, labels=x).loss.backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    opt.step()
    assert any(p.abs().max() > 0 for p in lora_b)


def test_freeze_lora(base_dir):
    model = load(base_dir, "elma", lora={"r": 4}, freeze_lora=True)
    assert any("lora_" in n for n, _ in model.named_parameters())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".memory_block." in n for n in trainable)
    assert {g["name"] for g in param_groups(model, 1e-3, 1e-4, 0.1)} == {"memory", "memory_no_decay"}


# -------------------------------------------------------------------------------------------------
# Memory state: reset per sample, no carry across batches, KV-cached continuation


def test_stream_mode_reset_gives_identical_outputs(base_dir):
    model = load(base_dir, "alma").eval()
    perturb(model)
    set_memory_mode(model, "stream")
    a, b = ids(1, 32, seed=5), ids(1, 32, seed=6)
    first = logits(model, a)
    logits(model, b)                                    # memory now holds a and b
    carried = logits(model, a)
    assert (carried - first).abs().max().item() > 1e-3  # the carried memory changes the output
    reset_memory(model)
    torch.testing.assert_close(logits(model, a), first, atol=0, rtol=0)
    assert all(blk.state is not None and blk.state.pos == 32 for blk in memory_blocks(model))


def test_auto_mode_resets_every_sequence(base_dir):
    model = load(base_dir, "gema").eval()
    perturb(model)
    a, b = ids(1, 24, seed=7), ids(1, 24, seed=8)
    first = logits(model, a)
    logits(model, b)
    torch.testing.assert_close(logits(model, a), first, atol=0, rtol=0)
    model.train()                                       # training: nothing carried across batches
    reset_memory(model)
    model(a, labels=a).loss.backward()
    model(b, labels=b)
    assert all(blk.state is None for blk in memory_blocks(model))


def test_samples_in_a_batch_do_not_share_memory(base_dir):
    model = load(base_dir, "alma").eval()
    perturb(model)
    x = ids(3, 24, seed=9)
    both = logits(model, x)
    for i in range(3):
        torch.testing.assert_close(logits(model, x[i:i + 1]), both[i:i + 1], atol=1e-5, rtol=1e-5)


def kv_decode(model, x: torch.Tensor, prefix: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(x[:, :prefix], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for t in range(prefix, x.shape[1]):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.logits)
    return torch.cat(parts, dim=1)


def test_kv_cached_decoding_carries_the_memory(base_dir):
    model = load(base_dir, "alma").eval()
    x = ids(2, 30, seed=10)
    # W_h = 0: h does not enter, so cached decoding must reproduce the full forward exactly
    torch.testing.assert_close(kv_decode(model, x, 20), logits(model, x), atol=1e-5, rtol=1e-5)
    assert all(blk.state.pos == 30 for blk in memory_blocks(model))
    set_memory_mode(model, "per_forward")              # every decoding step from a fresh memory
    kv_decode(model, x, 20)
    assert all(blk.state is None for blk in memory_blocks(model))
    set_memory_mode(model, "auto")
    perturb(model)
    inc = kv_decode(model, x, 20)
    with torch.no_grad():
        gen = model.generate(x[:1, :20], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 24)
    torch.testing.assert_close(inc[:, :20], logits(model, x[:, :20]), atol=1e-5, rtol=1e-5)
    # with W_h != 0 each decoded token's h reads the memory after the prefix (M_{t-1} of eq. 4.2),
    # where the full forward reads M_0 for every token
    assert (inc[:, 20:] - logits(model, x)[:, 20:]).abs().max().item() > 1e-4


def test_gradient_checkpointing_non_reentrant(base_dir):
    model = load(base_dir, "alma")
    perturb(model, gate_bias=-2.0)
    model.train()
    x = ids()
    model(x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-4)


def test_stream_mode_under_gradient_checkpointing_recomputes_from_the_forwards_state(base_dir):
    """Truncated BPTT ("stream": the state carried across forwards) with gradient checkpointing: the
    recomputation in backward starts from the state the forward started from, not from the state the forward
    has since moved on to, and moves nothing on itself (non-reentrant checkpointing, as load_memory_llama's
    docstring asks). Before 2026-11-30 the first segment's backward raised torch's CheckpointError (a
    different number of saved tensors)."""

    def segments(checkpointing: bool):
        model = load(base_dir, "alma", gate_bias_init=-1.0)
        perturb(model, gate_bias=-1.0)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        set_memory_mode(model, "stream")
        out = []
        for seed in (1, 2, 3):
            x = ids(1, 24, seed=seed)
            loss = model(x, labels=x).loss
            loss.backward()
            block = memory_blocks(model)[0]
            gate = block.stats()["gate_mean"]
            out.append((float(loss.detach()), block.state.pos, block.w_h.weight.grad.clone(), gate))
            model.zero_grad()
        return out

    for (loss, pos, grad, gate), (loss_c, pos_c, grad_c, gate_c) in zip(segments(False), segments(True)):
        assert (pos, gate) == (pos_c, gate_c) and loss == pytest.approx(loss_c, rel=1e-6)
        torch.testing.assert_close(grad_c, grad, atol=1e-6, rtol=1e-4)
    assert [pos for _, pos, _, _ in segments(True)] == [24, 48, 72]


def test_loaded_model_keeps_its_mode_and_generate_carries_the_memory(base_dir, base_model):
    """load_memory_llama / augment return the model in the mode it was loaded in (from_pretrained: eval), the
    new blocks and peft's wrapper included, so generate()'s decoding steps carry the memory (eval mode keeps
    it). Before 2026-11-30 the blocks came out in training mode: every decoding step silently restarted the
    memory (|cached decoding - full forward| 1.58 with W_h = 0)."""
    from memtrain.model.titans.memory_llama import augment

    x = ids(1, 30, seed=4)
    for lora in (None, {"r": 4}):
        model = load(base_dir, "gema", lora=lora, gate_bias_init=0.0)
        assert not model.training and not any(m.training for m in model.modules())
        torch.testing.assert_close(kv_decode(model, x, 20), logits(model, x), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            model.generate(x[:, :20], max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert all(block.state is not None and block.state.pos == 22 for block in memory_blocks(model))
    trained = augment(LlamaForCausalLM.from_pretrained(base_dir).train(), "gema", None, MEM, {"r": 4})
    assert all(m.training for m in trained.modules())


def test_library_memory_defaults_are_the_thesis(base_dir):
    """memory_kwargs=None builds the thesis's memory (Section 4.2.1 / Table B.1: one head on the full width,
    expansion 2, inner learning rate at most 1e-2), as memory.memory_llama's defaults do; NeuralMemory's own
    defaults are Titans' (4 heads, max_lr 0.1), which the library functions used until 2026-11-30."""
    from memtrain.config import MemoryLlamaConfig
    from memtrain.model.hf import memory_llama_kwargs
    from memtrain.model.titans.memory_llama import THESIS_MEMORY

    recipe = memory_llama_kwargs(MemoryLlamaConfig())
    assert {k: recipe[k] for k in THESIS_MEMORY} == THESIS_MEMORY
    memory = memory_blocks(load(base_dir, "alma", memory_kwargs=None))[0].memory
    assert (memory.heads, memory.inner, memory.max_lr, memory.chunk_size) == (1, 64, 0.01, 16)
    assert memory_blocks(load(base_dir, "alma", memory_kwargs={"heads": 2}))[0].memory.heads == 2


def test_memory_shapes_the_model_cannot_take_are_recipe_errors():
    """The memory's heads and kernel against the pretrained model's hidden size, checked where the width is
    known (the recipe check does not know it): one RecipeError naming the key, where 100 heads on a 64-wide
    model raised a traceback from deep inside (zero-wide heads) and 3 heads silently narrowed it to 63."""
    from memtrain.config import MemoryLlamaConfig, RecipeError
    from memtrain.model.hf import check_memory_llama_shape

    for heads in (100, 3):
        with pytest.raises(RecipeError, match=f"memory.memory_llama.heads: {heads} heads do not split the hidden size "
                                              "64 of tiny; use a divisor of 64 or set memory.memory_llama.head_dim"):
            check_memory_llama_shape(MemoryLlamaConfig(heads=heads), 64, "tiny")
    check_memory_llama_shape(MemoryLlamaConfig(heads=3, head_dim=16), 64, "tiny")
    check_memory_llama_shape(MemoryLlamaConfig(heads=2, kernel="triton"), 64, "tiny")
    with pytest.raises(RecipeError, match=r"memory.memory_llama.kernel: triton: the Triton kernels take .* head size "
                                          r"2048, hidden 4096 \(Llama, 1 head\(s\)\); use auto"):
        check_memory_llama_shape(MemoryLlamaConfig(kernel="triton"), 2048, "Llama")


def test_bf16_base_with_fp32_memory(base_dir):
    model = load(base_dir, "gema", torch_dtype=torch.bfloat16, gate_bias_init=CLOSED).eval()
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).eval()
    assert memory_blocks(model)[0].w_g.weight.dtype == torch.float32
    x = ids()
    torch.testing.assert_close(logits(model, x), logits(base, x), atol=0, rtol=0)
    model.train()
    model(x, labels=x).loss.backward()
    assert memory_blocks(model)[0].w_h.weight.grad is not None


def test_state_dict_round_trip_and_deepcopy(base_dir):
    import copy

    model = load(base_dir, "gema", seed=0).eval()
    perturb(model)
    x = ids()
    ref = logits(model, x)
    fresh = load(base_dir, "gema", seed=1).eval()
    assert (logits(fresh, x) - ref).abs().max() > 1e-4
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(fresh, x), ref, atol=0, rtol=0)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(logits(twin, x), ref, atol=0, rtol=0)
    with torch.no_grad():
        memory_blocks(twin)[0].w_g.bias.fill_(3.0)   # the copy's hooks use the copy's blocks
    assert (logits(twin, x) - ref).abs().max() > 1e-4
    torch.testing.assert_close(logits(model, x), ref, atol=0, rtol=0)


def test_augment_is_load_memory_llama_on_a_loaded_model(base_dir):
    """augment() (what memtrain's MemoryLlamaLM uses on AutoModelForCausalLM) == load_memory_llama."""
    from memtrain.model.titans.memory_llama import augment

    loaded = load(base_dir, "gema", seed=0, lora={"r": 4}, freeze_lora=True)
    torch.manual_seed(0)
    augmented = augment(LlamaForCausalLM.from_pretrained(base_dir), "gema", None, MEM, {"r": 4}, True)
    assert type(augmented) is type(loaded)
    sa, sb = loaded.state_dict(), augmented.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ({n for n, p in loaded.named_parameters() if p.requires_grad}
            == {n for n, p in augmented.named_parameters() if p.requires_grad})
