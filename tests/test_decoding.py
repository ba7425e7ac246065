"""Decoding against a reference (issue 20, item 2): every logit of a decoded token, compared with a
reference written in this file from the equations, in float64.

- MemoryLlama (:mod:`memtrain.model.titans.memory_llama`), KV-cached decoding with the memory carried:
  the reference is a plain-PyTorch MemoryLlama (Llama attention with RoPE and grouped-query heads,
  RMSNorm, SwiGLU, and the gated memory block of thesis eq. 4.1-4.10) whose Titans memory is updated
  token by token from thesis eq. 2.38-2.40 / Titans eq. 13-14 with autograd gradients; a call's
  tokens read ``h_t = M*_{t-1}(q_t)``, the memory after every earlier call (thesis eq. 4.2).
- Titans LMM / MAC / MAG / MAL, streamed generation (:func:`memtrain.eval.longctx.greedy_generate`):
  prompts longer than ``max_seq_len`` read in calls with the memory state carried, call boundaries
  inside memory chunks, generation crossing a call boundary. References: one call over the whole
  sequence (with the calls as documents for MAG / MAL, whose attention restarts per call), the memory
  state after each call from the update equations, and for LMM a whole float64 model.

fp32 models against float64 references at 1e-5. CPU, a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memtrain.config import ModelConfig, TitansConfig
from memtrain.eval.longctx import greedy_generate, stream_call_tokens
from memtrain.model import build
from memtrain.model.titans.memory_llama import load_memory_llama, memory_blocks, set_memory_mode

from tiny_hf import make_tiny_llama  # tests/tiny_hf.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = dict(rtol=0, atol=1e-5)
F32_EPS = torch.finfo(torch.float32).eps  # the memory's output RMSNorm eps (F.rms_norm's default in fp32)


# --------------------------------------------------------------------------------------------------
# The Titans neural memory from its equations (float64, one token at a time)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class RefMemory:
    """One :class:`~memtrain.model.titans.NeuralMemory` (its parameters only, in float64) run from the
    equations, per batch element and head:

    - q, k, v: projection, then a causal depthwise convolution over the written stream (Titans 4.4),
      SiLU, q and k L2-normalised per head, v too when the memory's ``value_norm`` is on (the Titans models);
    - gates from the written token: theta = max_lr sigmoid(.), eta = max_momentum sigmoid(.) (max_momentum 1
      for MemoryLlama, the paper's form; ``model.titans.memory_max_momentum`` for Titans), alpha = sigmoid(.);
    - ``u_t = grad ||M_{t'}(k_t) - v_t||^2`` at the weights M_{t'} of the start of t's chunk (chunks at
      absolute multiples of chunk_size; thesis eq. 2.38, Titans 3.2), by autograd;
    - ``S_t = eta_t S_{t-1} - theta_t u_t`` (eq. 2.39), ``M_t = (1 - alpha_t) M_{t-1} + S_t`` (eq. 2.40);
    - :meth:`write` returns ``M_t(q_t)`` (read after the token's update, thesis eq. 4.7), :meth:`read`
      returns ``M*(q)`` with the current weights and no update (eq. 4.2 / 2.48): the query of a read is
      convolved over the read call's own inputs (zero left padding), as ``NeuralMemory.retrieve``
      documents (MAC reads each segment the same way);
    - outputs: RMSNorm per head with its gain, times ``sigmoid(x W_G)``, then ``W_O``.
    """

    def __init__(self, mem: nn.Module, batch: int):
        p = {n: t.detach().double() for n, t in mem.named_parameters()}
        self.H, self.d, self.C, self.K = mem.heads, mem.head_dim, mem.chunk_size, mem.conv_kernel
        self.inner, self.max_lr = mem.heads * mem.head_dim, mem.max_lr
        self.max_momentum, self.value_norm = mem.max_momentum, mem.value_norm
        self.w_qkv, self.conv_w, self.conv_b = p["to_qkv.weight"], p["conv.weight"][:, 0], p["conv.bias"]
        self.w_gates, self.b_gates = p["to_gates.weight"], p["to_gates.bias"]
        self.out_norm, self.w_gate_out, self.w_out = p["out_norm"], p["to_out_gate.weight"], p["to_out.weight"]
        depth = len(mem.init_weights)
        self.W = [p[f"init_weights.{i}"].unsqueeze(0).repeat(batch, 1, 1, 1) for i in range(depth)]
        self.W_init = [w.clone() for w in self.W]
        self.S = [torch.zeros_like(w) for w in self.W]
        self.W_chunk = self.W
        self.pos = 0
        self.read_initial = False  # the tests' guard: read M_0 instead of the current weights
        self.rows: list[torch.Tensor] = []  # q|k|v projections of every written token (the conv's input)

    def _conv(self, rows: list[torch.Tensor], channels: slice) -> torch.Tensor:
        """The causal depthwise convolution's output at the last of ``rows`` ([B, channels] each)."""
        w, out = self.conv_w[channels], self.conv_b[channels].clone()
        for j in range(self.K):  # tap j multiplies the row K-1-j steps back
            back = self.K - 1 - j
            if back < len(rows):
                out = out + w[:, j] * rows[-1 - back]
        return out

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, H*d] -> [B, H, d]
        return x.view(x.shape[0], self.H, self.d)

    @staticmethod
    def mlp(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``M(x) = W_L silu(... silu(W_1 x))``, weights [B, H, out, in], x [B, H, in]."""
        for i, w in enumerate(weights):
            x = torch.einsum("bhoi,bhi->bho", w, x)
            if i < len(weights) - 1:
                x = _silu(x)
        return x

    def _output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + F32_EPS) * self.out_norm
        return (y.flatten(1) * torch.sigmoid(x @ self.w_gate_out.T)) @ self.w_out.T

    def write(self, a: torch.Tensor) -> torch.Tensor:
        """Write one token ``a`` [B, dim] (update the memory), return ``M_t(q_t)`` [B, dim]."""
        self.rows.append(a @ self.w_qkv.T)
        qkv = self._conv(self.rows, slice(None))
        q, k, v = qkv.split(self.inner, dim=-1)
        q, k = F.normalize(_silu(self._heads(q)), dim=-1), F.normalize(_silu(self._heads(k)), dim=-1)
        v = _silu(self._heads(v))
        if self.value_norm:
            v = F.normalize(v, dim=-1)
        g = (a @ self.w_gates.T + self.b_gates).view(-1, 3, self.H)
        theta = self.max_lr * torch.sigmoid(g[:, 0])[..., None, None]
        eta = self.max_momentum * torch.sigmoid(g[:, 1])[..., None, None]
        alpha = torch.sigmoid(g[:, 2])[..., None, None]
        if self.pos % self.C == 0:
            self.W_chunk = [w.clone() for w in self.W]
        with torch.enable_grad():
            at = [w.clone().requires_grad_(True) for w in self.W_chunk]
            u = torch.autograd.grad((self.mlp(at, k) - v).pow(2).sum(), at)
        self.S = [eta * s - theta * ui for s, ui in zip(self.S, u)]
        self.W = [(1 - alpha) * w + s for w, s in zip(self.W, self.S)]
        self.pos += 1
        return self._output(self.mlp(self.W, q), a)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """``M*(q(x))`` for one call's inputs ``x`` [B, T, dim] with the current weights, no update."""
        rows = [x[:, t] @ self.w_qkv[: self.inner].T for t in range(x.shape[1])]
        outs = []
        for t in range(x.shape[1]):
            q = F.normalize(_silu(self._heads(self._conv(rows[: t + 1], slice(0, self.inner)))), dim=-1)
            weights = self.W_init if self.read_initial else self.W
            outs.append(self._output(self.mlp(weights, q), x[:, t]))
        return torch.stack(outs, 1)

    def assert_state_matches(self, state) -> None:
        """The implementation's carried :class:`MemoryState` equals this one (fp32 vs float64)."""
        assert state.pos == self.pos
        chunk = self.W if self.pos % self.C == 0 else self.W_chunk  # a new chunk starts at the current weights
        for got, want in zip(state.weights + state.momentum + state.chunk_weights, self.W + self.S + chunk,
                             strict=True):
            torch.testing.assert_close(got.double(), want, **TOL)
        tail = [torch.zeros_like(self.rows[0])] * (self.K - 1) + self.rows
        torch.testing.assert_close(state.conv_cache.double(), torch.stack(tail[len(tail) - (self.K - 1):], 1), **TOL)


# --------------------------------------------------------------------------------------------------
# MemoryLlama: the reference model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RefMemoryLlama:
    """A float64 MemoryLlama with residual="input", called like a KV-cached model: each call takes the
    next tokens [B, T] and returns their logits. Per decoder layer i (``p`` = its weights)::

        x_DP = RMSNorm(x) W_x + M*_{t-1}(q(x)) W_h         (4.1-4.4; M_{t-1}: the memory before this call)
        a    = Attn(x_DP)                                   (4.5; causal over every earlier call's keys)
        m_j  = M_j(q(a_j)), M_j = Update(M_{j-1}; a_j)      (4.6-4.7; token by token)
        y    = (1 - g) a + g m,  g = sigmoid(a W_g + b_g)   (4.8-4.9)
        x    = x + y;  x = x + SwiGLU(RMSNorm(x))           (4.10 with Llama's residual, then the MLP)

    and ``x_DP = RMSNorm(x)``, ``y = a`` in layers without memory. Attention: RoPE (rotate-half,
    theta from the config) at absolute positions, grouped-query heads, softmax(q k^T / sqrt(d_h)).
    """

    def __init__(self, model: nn.Module, batch: int):
        cfg = model.config
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_theta
        sd = {k: v.detach().double() for k, v in model.state_dict().items()}
        self.embed, self.norm = sd["model.embed_tokens.weight"], sd["model.norm.weight"]
        self.head = sd["lm_head.weight"]
        self.layers = [{k[len(f"model.layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"model.layers.{i}.")}
                       for i in range(cfg.num_hidden_layers)]
        self.memory = {b.layer_idx: RefMemory(b.memory, batch) for b in memory_blocks(model)}
        self.keys: list = [None] * len(self.layers)
        self.values: list = [None] * len(self.layers)
        self.pos = 0

    def _attention(self, i: int, p: dict, h: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        q = (h @ p["self_attn.q_proj.weight"].T).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = (h @ p["self_attn.k_proj.weight"].T).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = (h @ p["self_attn.v_proj.weight"].T).view(B, T, self.nkv, self.hd).transpose(1, 2)
        positions = torch.arange(self.pos, self.pos + T, dtype=torch.float64)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)
        angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
        q = q * angles.cos() + _rotate_half(q) * angles.sin()
        k = k * angles.cos() + _rotate_half(k) * angles.sin()
        if self.keys[i] is not None:
            k, v = torch.cat([self.keys[i], k], 2), torch.cat([self.values[i], v], 2)
        self.keys[i], self.values[i] = k, v
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        allowed = torch.arange(k.shape[2])[None, :] <= (self.pos + torch.arange(T))[:, None]
        out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        return out.transpose(1, 2).reshape(B, T, -1) @ p["self_attn.o_proj.weight"].T

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed[ids]
        for i, p in enumerate(self.layers):
            normed = _rms(x, p["input_layernorm.weight"], self.eps)
            mem = self.memory.get(i)
            if mem is None:
                x = x + self._attention(i, p, normed)
            else:
                h = mem.read(x)  # the memory before this call: M_{t-1} (eq. 4.2)
                x_dp = normed @ p["memory_block.w_x.weight"].T + h @ p["memory_block.w_h.weight"].T
                a = self._attention(i, p, x_dp)
                m = torch.stack([mem.write(a[:, j]) for j in range(a.shape[1])], 1)
                g = torch.sigmoid(a @ p["memory_block.w_g.weight"].T + p["memory_block.w_g.bias"])
                x = x + (1 - g) * a + g * m
            z = _rms(x, p["post_attention_layernorm.weight"], self.eps)
            gate, up = z @ p["mlp.gate_proj.weight"].T, z @ p["mlp.up_proj.weight"].T
            x = x + (_silu(gate) * up) @ p["mlp.down_proj.weight"].T
        self.pos += ids.shape[1]
        return _rms(x, self.norm, self.eps) @ self.head.T


# Gates that vary from token to token, an inner step large enough to move the memory, momentum that
# matters, chunk 4: the 13-token prefix ends inside a chunk and decoding crosses the boundary at 16.
MEM = dict(heads=2, chunk_size=4, max_lr=0.1, init_lr=0.05, init_momentum=0.7, init_forget=0.1)
PREFIX, NEW = 13, 6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(folder, documents=40, layers=4)  # ELMA [0, 1], ALMA [2, 3], GeMA [0, 2]
    return str(folder)


def memory_llama(llama_dir: str, position: str) -> nn.Module:
    """A tiny MemoryLlama (fp32) whose memory visibly matters: W_h, W_g random, gate bias 0."""
    torch.manual_seed(0)
    model = load_memory_llama(llama_dir, position, memory_kwargs=MEM).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in memory_blocks(model):
            b.w_h.weight.copy_(0.5 * torch.randn(b.w_h.weight.shape, generator=g))
            b.w_g.weight.copy_(0.1 * torch.randn(b.w_g.weight.shape, generator=g))
            b.w_g.bias.zero_()
            b.memory.to_gates.weight.normal_(std=0.1, generator=g)
    return model


def prompt_ids(model: nn.Module, B: int = 2, T: int = PREFIX, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("position", ["elma", "alma", "gema"])
def test_memory_llama_kv_cached_decoding_reads_the_carried_memory(llama_dir, position):
    """``generate`` (greedy, KV cache, memory mode "auto") after a 13-token prefix: the logits of the
    prefix's last token and of each of the 5 tokens decoded through the cache equal the float64
    :class:`RefMemoryLlama` fed the same tokens, in which each decoded token t reads
    ``h_t = M*_{t-1}(q_t)`` with M_{t-1} the memory after every earlier token (thesis eq. 4.2) and
    writes its attention output (eq. 4.6-4.7), the memory updated from eq. 2.38-2.40 token by token.
    The carried memory state after decoding equals the reference's. Guard: reading M_0 instead (what
    a full forward's tokens read) moves the decoded logits by far more than the tolerance."""
    model = memory_llama(llama_dir, position)
    ids = prompt_ids(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape == (2, PREFIX + NEW) and len(out.logits) == NEW
    ref = RefMemoryLlama(model, batch=2)
    reads_m0 = RefMemoryLlama(model, batch=2)  # the guard: decoded tokens read M_0
    want = [ref(ids)[:, -1]]
    reads_m0(ids)
    for mem in reads_m0.memory.values():
        mem.read_initial = True
    for t in range(PREFIX, PREFIX + NEW - 1):
        want.append(ref(out.sequences[:, t:t + 1])[:, -1])
        assert (reads_m0(out.sequences[:, t:t + 1])[:, -1] - want[-1]).abs().max() > 1e-3
    for step, (got, exp) in enumerate(zip(out.logits, want)):
        torch.testing.assert_close(got.double(), exp, **TOL, msg=lambda s, step=step: f"step {step}: {s}")
    for block in memory_blocks(model):
        ref.memory[block.layer_idx].assert_state_matches(block.state)  # written: 13 + 5 tokens


@pytest.mark.parametrize("mode, kv_cache", [("auto", True), ("stream", True), ("stream", False)])
def test_memory_llama_decoding_in_uneven_calls(llama_dir, mode, kv_cache):
    """GeMA fed one sample in calls of 7, 6, 1, 3, 1, 1 tokens (chunk boundaries at 8, 12 and 16 fall
    inside calls and between them): every logit of every call equals :class:`RefMemoryLlama`'s, where
    all tokens of a call read the memory left by the earlier calls and write theirs in order. With the
    KV cache ("auto" and "stream") attention sees every earlier token; "stream" without a cache (the
    documented way to feed segments) restarts attention and positions at each call while the memory
    state is carried, which the reference does by clearing its keys and positions between calls."""
    model = memory_llama(llama_dir, "gema")
    set_memory_mode(model, mode)
    calls = (7, 6, 1, 3, 1, 1)
    ids = prompt_ids(model, T=sum(calls), seed=4)
    ref = RefMemoryLlama(model, batch=2)
    cache, start = None, 0
    for n in calls:
        with torch.no_grad():
            out = model(ids[:, start:start + n], past_key_values=cache, use_cache=kv_cache)
        if kv_cache:
            cache = out.past_key_values
        else:
            ref.keys, ref.values, ref.pos = [None] * len(ref.layers), [None] * len(ref.layers), 0
        want = ref(ids[:, start:start + n])
        torch.testing.assert_close(out.logits.double(), want, **TOL, msg=lambda s, a=start: f"call at {a}: {s}")
        start += n
    for block in memory_blocks(model):
        ref.memory[block.layer_idx].assert_state_matches(block.state)


# --------------------------------------------------------------------------------------------------
# Titans: streamed generation across call boundaries

VOCAB, NP, NEW_TITANS = 61, 3, 6
NEVER = -1  # no end-of-text: every row generates NEW_TITANS tokens


def titans_config(variant: str, max_seq_len: int) -> ModelConfig:
    """Memory chunk 4, MAC segment 6, MAG / MAL window 5, 3 persistent tokens. With max_seq_len 20,
    MAC streams calls of 18 tokens (three segments; its memory holds 18, 36 tokens at the boundaries:
    mid-chunk, then on a chunk boundary), MAG and MAL calls of 15 (20 less the window; the memory holds
    3 + 15, 3 + 30 tokens with the persistent ones: mid-chunk), LMM calls of 20 (3 + 20, 3 + 40)."""
    t = TitansConfig(variant=variant, memory_heads=2, memory_chunk_size=4, segment_len=6, window=5,
                     persistent_tokens=NP, memory_max_lr=0.1, memory_init_lr=0.03)
    return ModelConfig(type="titans", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, ffn_dim=64,
                       max_seq_len=max_seq_len, attention="sdpa", titans=t)


def titans_pair(variant: str) -> tuple[nn.Module, nn.Module]:
    """The fp32 model with max_seq_len 20 (streamed) and the same weights with max_seq_len 128 (the
    single-call reference). The memory gates vary from token to token."""
    torch.manual_seed(0)
    short = build(titans_config(variant, 20)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in short.blocks:
            b.memory.to_gates.weight.normal_(std=0.1, generator=g)
    long = build(titans_config(variant, 128)).eval()
    long.load_state_dict(short.state_dict())
    return short, long


class Recorder(nn.Module):
    """memtrain's call contract around a model, recording every call: (input_ids, memory, output)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.calls: list = []

    def forward(self, input_ids, doc_ids=None, memory=None):
        out = self.model(input_ids, doc_ids, memory)
        self.calls.append((input_ids.clone(), memory, out))
        return out


def stream_schedule(prompt: int, new: int, max_context: int, call: int) -> list[tuple[int, int, bool]]:
    """The calls ``_generate_stream`` makes, as (start, end, carries_state): while more than
    ``max_context`` tokens are unread, a call of ``call`` tokens whose state is carried; then one call
    over the unread rest whose last logits pick the next token."""
    start, length, out = 0, prompt, []
    for _ in range(new):
        while length - start > max_context:
            out.append((start, start + call, True))
            start += call
        out.append((start, length, False))
        length += 1
    return out


def per_call_documents(start: int, end: int, call: int, batch: int = 2) -> torch.Tensor:
    """Document ids [batch, end] making each streamed call its own document: position p belongs to call
    ``p // call`` up to ``start``, where the last (unfinished) call begins."""
    p = torch.arange(end)
    return torch.minimum(p // call, torch.tensor(start // call)).expand(batch, end)


def stream_generate(variant: str):
    """Greedy streamed generation of 6 tokens for two prompts of 2 calls + 17 tokens (odd length):
    two carried calls, four steps on a growing unread part, then a third carried call that holds the
    first generated tokens, and two more steps."""
    short, long = titans_pair(variant)
    n, call = short.cfg.max_seq_len, stream_call_tokens(short)
    assert call == {"mac": 18, "lmm": 20}.get(variant, 15)
    length = 2 * call + 17
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (length,), generator=g).tolist() for _ in range(2)]
    rec = Recorder(short)
    out, cut = greedy_generate(rec, prompts, NEW_TITANS, NEVER, n, stream_tokens=call, batch_size=2)
    assert not any(cut) and all(len(o) == NEW_TITANS for o in out)
    full = torch.tensor([p + o for p, o in zip(prompts, out)])
    schedule = stream_schedule(length, NEW_TITANS, n, call)
    assert [c[:2] for c in schedule[-3:]] == [(2 * call, 3 * call), (3 * call, length + 4), (3 * call, length + 5)]
    assert len(rec.calls) == len(schedule)
    carried = None
    for (a, b, carries), (ids, memory, output) in zip(schedule, rec.calls):
        assert torch.equal(ids, full[:, a:b]) and memory is carried  # fresh memory first, then carried
        if carries:
            carried = output.memory
    return short, long, full, schedule, rec.calls, call


@pytest.mark.parametrize("variant", ["lmm", "mac", "mag", "mal"])
def test_titans_stream_decoding_across_call_boundaries(variant):
    """:func:`greedy_generate` streaming a Titans model (calls of ``stream_call_tokens``, memory state
    carried, boundaries inside memory chunks, generation crossing a boundary). Every logit of every
    call, the generated tokens' included, equals one call over the whole sequence so far in which each
    streamed call is a document (attention never crosses documents, positions restart at them, the
    memory is not reset: exactly the stream semantics, the MAG / MAL windows restarting per call);
    for LMM and MAC it also equals one plain call over the whole sequence (exact for them). The
    memory state carried out of each call equals :class:`RefMemory` run on the same written stream
    (the inputs the single call's memories were given: x~ = norm1(P || x), or MAC's attention outputs)
    -- weights, momentum, chunk-start weights, convolution cache. Guard: dropping the carried state
    changes the last token's logits far beyond the tolerance."""
    short, long, full, schedule, calls, call = stream_generate(variant)
    with torch.no_grad():
        plain = long(full).logits.double() if variant in ("lmm", "mac") else None
        for (a, b, carries), (ids, memory, out) in zip(schedule, calls):
            want = long(full[:, :b], per_call_documents(a, b, call)).logits[:, a:b].double()
            msg = lambda s, a=a, b=b: f"call [{a}, {b}): {s}"  # noqa: E731
            torch.testing.assert_close(out.logits.double(), want, **TOL, msg=msg)
            if plain is not None:
                torch.testing.assert_close(out.logits.double(), plain[:, a:b], **TOL, msg=msg)
        ids, memory, out = calls[-1]
        fresh = short(ids).logits
        assert (fresh - out.logits).abs().max() > 1e-3

        # The memory states carried across the boundaries, against the update equations.
        # (every variant writes through NeuralMemory.write: MAG / MAL / LMM via the memory's forward)
        streams: list[list[torch.Tensor]] = [[] for _ in long.blocks]

        def recording(i, write):
            def record(x, *args, **kwargs):
                streams[i].append(x.double())
                return write(x, *args, **kwargs)
            return record

        for i, b in enumerate(long.blocks):
            b.memory.write = recording(i, b.memory.write)
        end = max(b for a, b, carries in schedule if carries)
        long(full[:, :end], per_call_documents(end, end, call))
        for b in long.blocks:
            del b.memory.write
    refs = [RefMemory(b.memory, 2) for b in short.blocks]
    written = [torch.cat(s, 1) for s in streams]
    states = [out.memory for (a, b, carries), (_, _, out) in zip(schedule, calls) if carries]
    assert len(states) == 3
    for state in states:
        for ref, stream, s, block in zip(refs, written, state, short.blocks, strict=True):
            while ref.pos < s.pos:
                ref.write(stream[:, ref.pos])
            ref.assert_state_matches(s)
            assert (s.weights[0] - block.memory.init_weights[0]).abs().max() > 1e-2  # the memory learned


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps) * weight


def test_titans_lmm_stream_decoding_against_the_equations():
    """The streamed LMM's logits (every call of the generation above) against a float64 LMM written
    here: per block ``x = x + M(norm1(P || x))[N_p:]`` with :class:`RefMemory` (the persistent tokens
    written first, then the tokens one by one, ``y_t = M_t(q_t)``), ``x = x + SwiGLU(norm2(x))``
    (w1 gate, w2 up, w3 down), final norm and head. Norms are gain-only LayerNorms."""
    short, _, full, schedule, calls, _ = stream_generate("lmm")
    p = {k: v.detach().double() for k, v in short.state_dict().items()}
    eps = short.cfg.norm_eps
    x = p["embed.weight"][full]
    for i, block in enumerate(short.blocks):
        mem = RefMemory(block.memory, full.shape[0])
        pre = f"blocks.{i}."
        for row in _layer_norm(p[pre + "persistent"], p[pre + "norm1.weight"], eps):
            mem.write(row.expand(full.shape[0], -1))
        u = _layer_norm(x, p[pre + "norm1.weight"], eps)
        x = x + torch.stack([mem.write(u[:, t]) for t in range(u.shape[1])], 1)
        z = _layer_norm(x, p[pre + "norm2.weight"], eps)
        x = x + (_silu(z @ p[pre + "ffn.w1.weight"].T) * (z @ p[pre + "ffn.w2.weight"].T)) @ p[pre + "ffn.w3.weight"].T
    want = _layer_norm(x, p["norm.weight"], eps) @ p["lm_head.weight"].T
    for (a, b, _), (_, _, out) in zip(schedule, calls):
        torch.testing.assert_close(out.logits.double(), want[:, a:b], **TOL, msg=lambda s, a=a: f"call at {a}: {s}")
