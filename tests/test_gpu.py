"""The GPU tier (``pytest -m gpu``): what only a CUDA device exercises.

- flex attention's fused (compiled) forward and backward against a float64 dense reference, with
  document masks, grouped-query heads and a length that is not a multiple of the block size;
- a bf16 training step of a tiny anchor and of each memory family (hierarchical memories with their
  bank, Titans LMM / MAC / MAG / MAL, MemoryLlama): bf16 logits within bf16 rounding of fp32, finite
  gradients that reach the memory's parameters, and a loss that falls over a few steps;
- eager MAC's grouped per-segment weight gradients (memtrain.model.grouped_linear) in bf16, as close to fp32
  as autograd's per-use sums;
- the SwiGLU's recomputed activation (memtrain.model.swiglu) equal to autograd's ops bit for bit, bf16 and fp32;
- ``torch.compile`` against eager: outputs and every parameter's gradient; and Titans blocks compiled
  regionally (``model.compile: true``, the Triton kernels eager inside) in bf16, as close to fp32 as
  eager bf16 is.

Every test is marked ``gpu``; on a machine without CUDA they are collected and skipped with their
reason (tests/conftest.py), the only skips a CPU run may have. ``MEMTRAIN_GPU_TIER_ON_CPU=1`` runs the
tier on CPU anyway, to check the tests' own code where no GPU is at hand (flex and compile then run
their CPU paths; tolerances stay those of the GPU).

Triton kernels (``memtrain/kernels``) are tested by their own test files, which run compiled on a GPU
and under ``TRITON_INTERPRET=1`` elsewhere.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.config import MemoryConfig, ModelConfig, TitansConfig
from memtrain.data.loader import document_ids
from memtrain.model import build
from memtrain.model.attention import attend, build_attention_mask, document_mask
from memtrain.model.titans.memory_llama import inject_memory, memory_blocks
from memtrain.parallel.bank import MemoryBank

pytestmark = pytest.mark.gpu
EOT = 0
VOCAB = 97


@pytest.fixture(scope="module")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    assert os.environ.get("MEMTRAIN_GPU_TIER_ON_CPU") == "1"  # conftest skips the tier otherwise
    return torch.device("cpu")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def tokens(B: int, T: int, seed: int, device: torch.device, eots: tuple[int, ...] = ()) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    for p in eots:
        ids[:, p] = EOT
    return ids.to(device)


# --------------------------------------------------------------------------------------------------
# Flex attention


def dense_reference(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention in float64; ``allowed`` [B, 1, T, T]; k/v heads repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# fp32: flex's Triton dots may run in TF32 (10-bit mantissa), so ~1e-3 relative, not 1e-6.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_flex_attention_forward_and_backward_match_a_float64_reference(device, dtype, tol):
    B, H, KV, T, D = 2, 4, 2, 200, 64  # T not a multiple of flex's 128-token blocks
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(B, KV, T, D, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(B, KV, T, D, generator=g).to(device, dtype).requires_grad_()
    ids = tokens(B, T, 1, device, eots=(37, 130, 131))
    doc = document_ids(ids, EOT)
    mask = build_attention_mask(doc, T, "flex", device)
    assert mask.backend == ("flex" if device.type == "cuda" else "sdpa")  # CPU: flex has no backward there
    w = torch.randn(B, H, T, D, generator=g).to(device)
    out = attend(q, k, v, mask)
    (out.float() * w).sum().backward()

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = dense_reference(*leaves, document_mask(doc))
    (ref * w.double()).sum().backward()
    assert rel_err(out, ref) < tol
    for got, want, name in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves), "qkv"):
        assert rel_err(got, want) < tol, name


# --------------------------------------------------------------------------------------------------
# bf16 training steps, one per family


def _anchor_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64,
                attention="auto", tie_embeddings=False)
    base.update(kw)
    return ModelConfig(**base)


def _titans_cfg(variant: str) -> ModelConfig:
    return _anchor_cfg(type="titans", attention="sdpa", titans=TitansConfig(
        variant=variant, memory_heads=2, memory_chunk_size=8, segment_len=16, window=12, persistent_tokens=2))


class _Family:
    """A tiny model of one family with what its forward needs and the names of the memory's parameters."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
        torch.manual_seed(seed)
        self.name, self.bank, self.ids = name, None, None
        if name == "anchor":
            self.model = build(_anchor_cfg())
            self.memory_params = []
        elif name == "hierarchical":
            self.model = build(_anchor_cfg(), MemoryConfig(type="ffn", levels=[2, 1]), branching=2)
            self.bank = MemoryBank(self.model.memory_layout, device, dtype=dtype, seed=seed)
            self.ids = torch.tensor([[0, 1], [1, 2], [0, 0], [1, 3]], device=device)  # leaf path per sequence
            self.memory_params = []  # the bank's rows (checked separately)
        elif name.startswith("titans-"):
            self.model = build(_titans_cfg(name.split("-", 1)[1]))
            self.memory_params = [n for n, _ in self.model.named_parameters() if "memory" in n]
        elif name == "memory-llama":
            llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
            self.model = inject_memory(llama, "alma", None, dict(heads=2, chunk_size=8), gate_bias_init=0.0)
            self.memory_params = [n for n, _ in self.model.named_parameters() if "memory_block" in n]
        else:
            raise AssertionError(name)
        if name != "memory-llama":
            self.model.to(device, dtype)
        else:  # MemoryLlama keeps its memory blocks in fp32 (memory_dtype), the base model in the run's dtype
            self.model.to(device)
            for n, p in self.model.named_parameters():
                if "memory_block" not in n:
                    p.data = p.data.to(dtype)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x, y = ids[:, :-1], ids[:, 1:]
        if self.name == "memory-llama":
            logits = self.model(input_ids=x).logits
        else:
            memory = self.bank.fetch(self.ids) if self.bank is not None else None
            logits = self.model(x, doc_ids=document_ids(x, EOT), memory=memory).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def parameters(self) -> list[torch.Tensor]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return params + (list(self.bank.parameters()) if self.bank is not None else [])


FAMILIES = ["anchor", "hierarchical", "titans-lmm", "titans-mac", "titans-mag", "titans-mal", "memory-llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_training_step_of_each_family(device, family):
    """bf16 weights (as DeepSpeed's bf16 mode holds the module): the first loss within bf16 rounding of the
    fp32 model's, finite gradients that reach the memory, and a loss that falls over five AdamW steps on
    one batch."""
    ids = tokens(4, 49, 2, device, eots=(20,))
    ref = _Family(family, device, torch.float32)
    ref_loss = ref.loss(ids)
    ref_loss.backward()
    want = float(ref_loss)
    # the memory parameters the fp32 model trains: bf16 must reach the same ones
    reached = {n for n in ref.memory_params if float(dict(ref.model.named_parameters())[n].grad.abs().sum()) > 0}
    assert reached or not ref.memory_params, family
    fam = _Family(family, device, torch.bfloat16)
    params = fam.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    losses = []
    for step in range(5):
        loss = fam.loss(ids)
        assert math.isfinite(float(loss)), (family, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            assert abs(float(loss) - want) < 3e-2 * abs(want), (float(loss), want)
            for p in params:
                assert p.grad is None or bool(torch.isfinite(p.grad).all()), family
            named = dict(fam.model.named_parameters())
            got = {n for n in fam.memory_params if named[n].grad is not None and float(named[n].grad.abs().sum()) > 0}
            assert got == reached, (family, sorted(reached ^ got))
            if fam.bank is not None:
                assert any(t.grad is not None and float(t.grad.abs().sum()) > 0 for t in fam.bank.parameters())
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    if family == "memory-llama":
        assert all(b.w_h.weight.dtype == torch.float32 for b in memory_blocks(fam.model))


# --------------------------------------------------------------------------------------------------
# torch.compile against eager


def _logits_and_grads(model, x: torch.Tensor, doc: torch.Tensor, module=None) -> tuple[torch.Tensor, dict]:
    """One forward and backward of the mean squared logits: the logits and every gradient of ``module``'s
    parameters (``module``: the eager module behind a ``torch.compile`` wrapper; default ``model``)."""
    logits = model(x, doc_ids=doc).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in (module or model).named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def _batch_and_twin(family: str, device, dtype: torch.dtype, seed: int, eot: int):
    """A batch (inputs and document ids) and two ``family`` models in ``dtype`` with the same weights."""
    ids = tokens(2, 49, seed, device, eots=(eot,))
    x = ids[:, :-1]
    a = _Family(family, device, dtype).model
    b = _Family(family, device, dtype).model
    b.load_state_dict(a.state_dict())
    return x, document_ids(x, EOT), a, b


@pytest.mark.parametrize("family", ["anchor", "titans-mac", "titans-mag"])
def test_compiled_model_equals_eager_outputs_and_gradients(device, family):
    """The whole model under torch.compile (what GPU training will use) against the same weights eager,
    fp32: logits and every parameter's gradient to 1e-4 relative (kernel fusion reorders sums)."""
    x, doc, eager, compiled_src = _batch_and_twin(family, device, torch.float32, seed=3, eot=11)
    compiled = torch.compile(compiled_src)
    outs, grads = zip(*(_logits_and_grads(m, x, doc, module) for m, module in ((eager, eager),
                                                                              (compiled, compiled_src))))
    assert rel_err(outs[1], outs[0]) < 1e-4
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) < 1e-4, n


def test_titans_mac_grouped_weight_gradients_in_bf16(device, monkeypatch):
    """Eager MAC in bf16 (``kernel: auto``: the Triton kernels on a GPU) computes each per-segment projection's
    weight gradient once for all segments (memtrain.model.grouped_linear: one GEMM with fp32 accumulation, one
    rounding); autograd's per-use sums (``MEMTRAIN_GROUPED_WGRAD=0``) round each use's GEMM and each sum to bf16.
    Against an fp32 model with the same weights, the grouped gradients are as close as the per-use sums (at most
    1.5x their error, or 1e-2) and the logits equal. The GPU check runs this first and switches grouping off
    for its later phases should it fail."""
    x, doc, grouped, per_use = _batch_and_twin("titans-mac", device, torch.bfloat16, seed=5, eot=23)
    ref = _Family("titans-mac", device, torch.float32).model
    ref.load_state_dict(grouped.state_dict())  # the bf16 weights, held in fp32
    runs = [_logits_and_grads(ref, x, doc), _logits_and_grads(grouped, x, doc)]
    monkeypatch.setenv("MEMTRAIN_GROUPED_WGRAD", "0")
    runs.append(_logits_and_grads(per_use, x, doc))
    (_, g_ref), (out_g, g_g), (out_u, g_u) = runs
    assert torch.equal(out_g, out_u)  # the forward is the same GEMMs
    projections = [n for n in g_ref if n.endswith(("to_qkv.weight", "to_gates.weight", "to_gates.bias",
                                                   "to_out.weight", "attn.wk.weight", "attn.wv.weight",
                                                   "attn.wo.weight"))]
    assert len(projections) == 2 * 7, projections
    for n in g_ref:
        assert rel_err(g_g[n], g_ref[n]) < max(1.5 * rel_err(g_u[n], g_ref[n]), 1e-2), n


@pytest.mark.parametrize("family", ["titans-mac", "titans-mal"])
def test_titans_compiled_blocks_in_bf16_equal_eager(device, family):
    """``model.compile: true`` on Titans as bf16 training runs it: regional compilation of the blocks with the
    memory's scan left eager (on a GPU the Triton kernels, ``kernel: auto``). Against an fp32 model with the
    same weights, the compiled bf16 model's logits and gradients are as close as the eager bf16 model's (at
    most twice its error, or 1e-2 / 3e-2), and reach the same parameters."""
    x, doc, eager, compiled = _batch_and_twin(family, device, torch.bfloat16, seed=4, eot=17)
    ref = _Family(family, device, torch.float32).model
    ref.load_state_dict(eager.state_dict())  # the bf16 weights, held in fp32
    assert compiled.compile_blocks() == len(compiled.blocks)
    outs, grads = zip(*(_logits_and_grads(m, x, doc) for m in (ref, eager, compiled)))
    assert rel_err(outs[2], outs[0]) < max(2 * rel_err(outs[1], outs[0]), 1e-2)
    assert grads[0].keys() == grads[1].keys() == grads[2].keys() and any("memory" in n for n in grads[0])
    for n in grads[0]:
        assert rel_err(grads[2][n], grads[0][n]) < max(2 * rel_err(grads[1][n], grads[0][n]), 3e-2), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_recomputation_equals_autograd_on_the_device(device, dtype, monkeypatch):
    """memtrain.model.swiglu on the device: the anchor's SwiGLU keeping only its gate and up projections (backward
    recomputes the SiLU and the product) gives the output and every gradient autograd's ops give
    (``MEMTRAIN_SWIGLU_RECOMPUTE=0``) bit for bit, the same GEMM and elementwise calls in the same order, at a
    recipe-like width (768 -> 2048) and an odd token count."""
    from memtrain.model.anchor import SwiGLU

    torch.manual_seed(0)
    ffn = SwiGLU(768, 2048).to(device=device, dtype=dtype)
    x = torch.randn(3, 517, 768, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    runs = []
    for recompute in ("1", "0"):
        monkeypatch.setenv("MEMTRAIN_SWIGLU_RECOMPUTE", recompute)
        out = ffn(x)
        runs.append((out, *torch.autograd.grad(out, (x, *ffn.parameters()), grad)))
    for a, b in zip(*runs):
        assert torch.equal(a, b), rel_err(a, b)
