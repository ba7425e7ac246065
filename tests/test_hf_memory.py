"""Post-hoc hierarchical FFN memories on pretrained Hugging Face models (memtrain.model.hf; paper
Section 4, Appendix A.6, Appendix I): tiny random Llama, Qwen2 and Gemma 3 (text) models saved to a
tmp folder. Zero effect at initialisation, sizes, per-sequence effect of bank rows, the widened-FFN
equivalence, gradients, activation checkpointing, the meta device, bad inputs. CPU, no network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
    Qwen2ForCausalLM,
)

from memtrain.config import MemoryConfig, ModelConfig, RecipeError
from memtrain.model import build, count_parameters
from memtrain.model.hf import HFMemoryLM, decoder_layers
from memtrain.parallel.bank import MemoryBank

V, D, L, T = 128, 64, 2, 24
BRANCHING = 2
LEVELS = [2, 1, 1]  # r_1..r_3; level l has 2^(l+1) rows
# Sequences 0-2 fetch different clusters (0 and 1 share their level-1 row); sequence 3 is generic.
IDS = torch.tensor([[0, 0, 0], [0, 1, 3], [1, 2, 5], [1, 3, 7]])
GENERIC = torch.tensor([False, False, False, True])

ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads = 16 (as in the real Gemma 3); gelu-tanh MLP; a sliding window < T.
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"])),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> folder of a saved tiny random model."""
    out = {}
    for i, (name, make) in enumerate(ARCHS.items()):
        torch.manual_seed(i)
        path = tmp_path_factory.mktemp(name)
        make().save_pretrained(path)
        out[name] = str(path)
    return out


def mem_cfg(**kw) -> MemoryConfig:
    return MemoryConfig(type="ffn", levels=list(LEVELS), **kw)


def load(path: str, memory: bool = True) -> HFMemoryLM:
    torch.manual_seed(0)
    return build(ModelConfig(type="hf", pretrained=path), mem_cfg() if memory else None, BRANCHING)


def tokens(B: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def noise_rows(bank: MemoryBank, scale: float = 0.2, seed: int = 5) -> None:
    """Give every row (and so every part, w3 included) random values: the memories matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in bank.parameters():
            t.copy_(scale * torch.randn(t.shape, generator=g))


def run(model: HFMemoryLM, bank: MemoryBank, x: torch.Tensor) -> torch.Tensor:
    return model(x, memory=bank.fetch(IDS, GENERIC)).logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_zero_effect_and_sizes(saved, arch):
    model = load(saved[arch]).eval()
    plain = load(saved[arch], memory=False).eval()
    assert isinstance(model, HFMemoryLM) and plain.memory_layout is None and plain.generic_memory is None
    layout = model.memory_layout
    d, n_layers = model.hf_model.config.hidden_size, model.hf_model.config.num_hidden_layers
    # Appendix I: FFN-memory size 3 r L d, i.e. c0 = 3 L d.
    assert layout.c0 == 3 * n_layers * d
    for l, r in enumerate(LEVELS):
        assert layout.block_size(l) == 3 * n_layers * d * r
    bank = MemoryBank(layout, seed=0)
    assert [tuple(t.shape) for t in bank.tables] == [(2 ** (l + 1), 3 * n_layers * d * r) for l, r in enumerate(LEVELS)]
    assert layout.bank_parameters == sum(t.numel() for t in bank.parameters())
    assert model.vocab_size == V
    x = tokens()
    with torch.no_grad():
        reference = model.hf_model(x).logits
        base = plain(x).logits
        with_mem = run(model, bank, x)
        with_doc_ids = model(x, doc_ids=torch.zeros_like(x), memory=bank.fetch(IDS, GENERIC)).logits
    torch.testing.assert_close(base, reference, rtol=0, atol=0)
    torch.testing.assert_close(with_mem, base, rtol=0, atol=1e-6)
    torch.testing.assert_close(with_doc_ids, with_mem, rtol=0, atol=0)  # doc_ids ignored (A.6)
    assert model._call.mems is None  # cleared after the call


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bank_rows_act_per_sequence(saved, arch):
    model = load(saved[arch]).eval()
    bank = MemoryBank(model.memory_layout, seed=0)
    x = tokens()
    with torch.no_grad():
        before = run(model, bank, x)
        g = torch.Generator().manual_seed(7)
        # (level, row) -> the sequences that fetched it (the generic sequence 3 fetches nothing).
        for level, row, changed in [(0, 0, {0, 1}), (2, 5, {2}), (2, 7, set())]:
            table = bank.tables[level]
            saved_row = table[row].clone()
            table[row] = 0.3 * torch.randn(table.shape[1], generator=g)
            after = run(model, bank, x)
            table[row] = saved_row
            for b in range(x.shape[0]):
                diff = float((after[b] - before[b]).abs().max())
                if b in changed:
                    assert diff > 1e-4, (level, row, b, diff)
                else:
                    assert diff <= 1e-6, (level, row, b, diff)
        # The generic memory acts on the generic sequence only.
        model.generic_memory.blocks[1].normal_(0, 0.3, generator=g)
        after = run(model, bank, x)
        model.generic_memory.reset_parameters()
    assert float((after[3] - before[3]).abs().max()) > 1e-4
    torch.testing.assert_close(after[:3], before[:3], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_memory_widens_the_ffn(saved, arch):
    """Appendix I / Fig. 18: with memory, a layer's MLP equals the MLP whose gate, up and down matrices
    are widened by the sequence's fetched channels, with the MLP's own activation (Gemma: gelu-tanh)."""
    model = load(saved[arch]).eval()
    bank = MemoryBank(model.memory_layout, seed=0)
    noise_rows(bank)
    mlp = decoder_layers(model.hf_model, L)[1].mlp
    seen = {}
    handle = mlp.register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out))
    memory = bank.fetch(IDS, GENERIC)
    with torch.no_grad():
        model(tokens(), memory=memory)
        handle.remove()
        mems = model.memory_layout.per_layer(model.generic_memory.mix(memory, 4))
        for b in range(4):
            mem = mems[1][b]  # [R, 3d]
            w1, w2, w3 = mem[:, :D], mem[:, D:2 * D], mem[:, 2 * D:]
            gate = torch.cat([mlp.gate_proj.weight, w1])
            up = torch.cat([mlp.up_proj.weight, w2])
            down = torch.cat([mlp.down_proj.weight, w3.T], dim=1)
            x = seen["x"][b]
            want = F.linear(mlp.act_fn(F.linear(x, gate)) * F.linear(x, up), down)
            torch.testing.assert_close(seen["out"][b], want, rtol=1e-5, atol=1e-5)
    if arch == "gemma3":
        assert type(mlp.act_fn).__name__ == "GELUTanh"


def grads(model: HFMemoryLM, bank: MemoryBank, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    for t in bank.parameters():
        t.grad = None
    logits = run(model, bank, x)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach(), [t.grad.clone() for t in bank.parameters()], \
        {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gradients_reach_fetched_rows(saved, arch):
    model = load(saved[arch]).train()
    bank = MemoryBank(model.memory_layout, seed=0)
    _, bank_grads, named = grads(model, bank, tokens())
    for level, g in enumerate(bank_grads):
        nonzero = set(torch.nonzero(g.abs().sum(1)).flatten().tolist())
        assert nonzero == set(IDS[~GENERIC, level].tolist()), (level, nonzero)
    assert all(float(named[n].abs().sum()) > 0 for n in named if n.startswith("generic_memory."))
    hf = [n for n in named if n.startswith("hf_model.")]
    assert hf and all(named[n] is not None for n in hf)
    assert sum(float(named[n].abs().sum()) > 0 for n in hf) >= len(hf) - 1  # all but maybe an unused row
    # Frozen anchor (Section 4: the open-weight anchors stay frozen): memories only.
    model.freeze_anchor()
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in model.memory_parameters()}
    _, frozen_grads, named = grads(model, bank, tokens())
    assert all(named[n] is None for n in hf)
    for g, want in zip(frozen_grads, bank_grads):
        torch.testing.assert_close(g, want)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_activation_checkpointing_matches(saved, arch):
    model = load(saved[arch]).train()
    bank = MemoryBank(model.memory_layout, seed=0)
    noise_rows(bank, scale=0.05)  # every memory part non-zero: w1/w2 get gradients too
    x = tokens()
    logits, bank_grads, named = grads(model, bank, x)
    model.set_activation_checkpointing(True)
    assert model.hf_model.is_gradient_checkpointing
    calls = []
    # A pre-hook: torch stops the recomputation once the last saved tensor is back (inside the MLP).
    handle = decoder_layers(model.hf_model, L)[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    ck_logits, ck_bank_grads, ck_named = grads(model, bank, x)
    handle.remove()
    assert len(calls) == 2  # forward + recomputation in backward
    assert model._call.mems is None
    torch.testing.assert_close(ck_logits, logits, rtol=0, atol=1e-6)
    for g, want in zip(ck_bank_grads, bank_grads):
        assert float(want.abs().sum()) > 0
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7)
    for n, g in named.items():
        torch.testing.assert_close(ck_named[n], g, rtol=1e-5, atol=1e-7)
    model.set_activation_checkpointing(False)
    assert not model.hf_model.is_gradient_checkpointing


@pytest.mark.parametrize("arch", list(ARCHS))
def test_meta_device_counts_parameters(saved, arch):
    real = load(saved[arch])
    with torch.device("meta"):
        meta = build(ModelConfig(type="hf", pretrained=saved[arch]), mem_cfg(), BRANCHING)
    assert all(p.is_meta for p in meta.parameters())
    assert count_parameters(meta) == count_parameters(real)
    assert sum(p.numel() for p in meta.anchor_parameters()) == sum(p.numel() for p in real.anchor_parameters())
    assert meta.memory_layout == real.memory_layout


def test_bad_inputs(tmp_path, saved):
    with pytest.raises(RecipeError, match="model.pretrained.*does not exist"):
        build(ModelConfig(type="hf", pretrained=str(tmp_path / "no_such_model")), mem_cfg(), BRANCHING)
    with pytest.raises(RecipeError, match="model.pretrained"):
        build(ModelConfig(type="hf", pretrained=None), mem_cfg(), BRANCHING)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecipeError, match="model.pretrained.*cannot be loaded"):
        build(ModelConfig(type="hf", pretrained=str(empty)), mem_cfg(), BRANCHING)
    # No gated MLP (GPT-2's c_fc / c_proj): the error names the architecture.
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(gpt2)
    with pytest.raises(RecipeError, match="model.pretrained.*GPT2LMHeadModel"):
        build(ModelConfig(type="hf", pretrained=str(gpt2)), mem_cfg(), BRANCHING)
    plain = load(saved["llama"], memory=False)
    with pytest.raises(ValueError, match="no memory modules"):
        plain(tokens(), memory=MemoryBank(load(saved["llama"]).memory_layout).fetch(IDS, GENERIC))


def test_import_is_light():
    code = "import memtrain.model, memtrain.model.hf, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("why", ["HF_HUB_OFFLINE", "no DNS"])
def test_unknown_hub_id_offline(why):
    """A hub id neither cached nor reachable: one line, no network tries. With HF_HUB_OFFLINE, and where the hub's
    host does not resolve (this machine): before, the hub's client retried for 27 s, logging each retry."""
    code = ("import socket\n"
            "from memtrain.config import MemoryConfig, ModelConfig, RecipeError\n"
            "from memtrain.model import build\n"
            "def no_dns(*a, **k):\n"
            "    raise socket.gaierror(-2, 'Name or service not known')\n"
            f"if {why == 'no DNS'}:\n"
            "    socket.getaddrinfo = no_dns\n"
            "try:\n"
            "    build(ModelConfig(type='hf', pretrained='nobody/no-such-model'),\n"
            "          MemoryConfig(type='ffn', levels=[1]))\n"
            "except RecipeError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    if why == "HF_HUB_OFFLINE":
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         env=env)
    reason = "HF_HUB_OFFLINE is set" if why == "HF_HUB_OFFLINE" else "huggingface.co does not resolve"
    assert out.stdout.splitlines() == [
        "recipe error: model.pretrained: 'nobody/no-such-model' is not a folder here "
        f"({os.path.abspath('nobody/no-such-model')}) nor in the local Hugging Face cache, and the hub cannot be "
        f"reached ({reason}" + out.stdout.split(reason, 1)[1].rstrip("\n")], out.stdout
    assert "Retrying" not in out.stderr and "download the model first" in out.stdout


def test_a_cached_hub_id_loads_without_the_network(saved, tmp_path):
    """A hub id whose snapshot is in the local Hugging Face cache loads with no network and no retries (this machine
    cannot resolve the hub; DNS is also cut in the process). Before, from_pretrained(local_files_only=True) still
    asked the hub for a PEFT adapter config, retrying for 27 s. Both the weights and the meta build (recipe show)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--memtrain-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(saved["llama"], repo / "snapshots" / commit)
    code = ("import socket, torch\n"
            "def no_dns(*a, **k):\n"
            "    raise socket.gaierror(-2, 'Name or service not known')\n"
            "socket.getaddrinfo = no_dns\n"
            "from memtrain.config import MemoryConfig, ModelConfig\n"
            "from memtrain.model import build\n"
            "cfg = ModelConfig(type='hf', pretrained='memtrain-test/tiny-llama')\n"
            "model = build(cfg, MemoryConfig(type='ffn', levels=[1]), 2)\n"
            "with torch.device('meta'):\n"
            "    meta = build(cfg, MemoryConfig(type='ffn', levels=[1]), 2)\n"
            "print(sum(p.numel() for p in model.anchor_parameters()),\n"
            "      sum(p.numel() for p in meta.anchor_parameters()),\n"
            "      float(model.anchor_parameters()[0].detach().sum()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HOME")}
    env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Retrying" not in out.stderr
    n, n_meta, first = out.stdout.split()
    want = load(saved["llama"])
    assert int(n) == int(n_meta) == sum(p.numel() for p in want.anchor_parameters())
    assert float(first) == pytest.approx(float(want.anchor_parameters()[0].detach().sum()), abs=1e-6)  # its weights
