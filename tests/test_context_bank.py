"""The inference-time context bank (crossattn-memory-banks paper, Section 2 "Future extension" and Section
7.1-7.3, eq. 22-24; memtrain.model.crossattn.context_bank) and `memtrain generate`: importance (eq. 24)
and merging under capacity pressure (eq. 23), online and full clustering, retrieval that reads only the
top-k clusters, the attention statistics and ages behind the importance, the encoder's reconstruction
(eq. 22), the model untouched without a context bank, and the command end to end on a tiny trained
checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from memtrain.config import CrossAttnConfig, MemoryConfig, ModelConfig, Recipe, RecipeError
from memtrain.launcher.generate import check_generate
from memtrain.model import build
from memtrain.model.crossattn.bank import LatentBank
from memtrain.model.crossattn.context_bank import (ContextBank, ContextEncoder, ContextRead, fit_context_encoder,
                                                   hidden_states)
from memtrain.model.crossattn.layer import MemoryCrossAttention

REPO = Path(__file__).resolve().parents[1]


def _model(dim=None, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=64)
    model = build(cfg, MemoryConfig(type="crossattn", crossattn=CrossAttnConfig(tokens=8, dim=dim)))
    for part in model.crossattn.parts.values():  # W_O starts at zero; a trained one is not
        torch.nn.init.normal_(part.attn.wo.weight, std=0.3)
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Importance (eq. 24) and merging (eq. 23)


def _hand_bank() -> ContextBank:
    """Six 2-d vectors with hand-set metadata; alpha=1, beta=10, gamma=2, capacity 4."""
    bank = ContextBank(2, capacity=4, alpha=1.0, beta=10.0, gamma=2.0, clusters=2)
    # ids 0-3 from run 1: importance 2+10*0.5+2/4 = 7.5, 1+10*0.1+2/2 = 3.0, 0+0+2/1 = 2.0, 3+10*0.1+2/5 = 4.4
    bank.add(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.05, 1.0], [-1.0, -0.2]]), source=1,
             metadata={"freq": [2, 1, 0, 3], "attn_sum": [1.0, 0.1, 0.0, 0.3], "age": [3, 1, 0, 4]})
    return bank


def test_crossattn_context_importance_follows_eq24():
    bank = _hand_bank()
    imp = bank.importance()
    assert imp.tolist() == pytest.approx([7.5, 3.0, 2.0, 4.4])
    assert torch.argsort(imp).tolist() == [2, 1, 3, 0]  # merged first ... last
    assert bank.avg_attn.tolist() == pytest.approx([0.5, 0.1, 0.0, 0.1])
    assert bank.recency.tolist() == pytest.approx([1 / 4, 1 / 2, 1.0, 1 / 5])
    # each weight moves importance by its own term only
    bank.alpha, bank.beta, bank.gamma = 0.0, 0.0, 1.0
    assert bank.importance().tolist() == pytest.approx([1 / 4, 1 / 2, 1.0, 1 / 5])
    bank.alpha, bank.gamma = 1.0, 0.0
    assert bank.importance().tolist() == pytest.approx([2, 1, 0, 3])


def test_crossattn_context_merges_lowest_importance_into_nearest_neighbour():
    bank = _hand_bank()
    assert bank.merges == [] and len(bank) == 4
    # Run 2 adds two vectors of low importance (2/6 = 0.333 and 2/3 = 0.667): two over capacity.
    merges = bank.add(torch.tensor([[1.0, 0.2], [-1.0, 0.1]]), source=2,
                      metadata={"age": [5, 2]})
    # The most cosine-similar pair overall is ids 1/2 (0.9988), but merging picks by importance: the
    # lowest (id 4) goes into its nearest neighbour (id 0, cosine 0.981), then id 5 into id 3 (0.956).
    assert [(m.victim, m.into) for m in merges] == [(4, 0), (5, 3)]
    assert merges[0].importance == pytest.approx(2 / 6) and merges[1].importance == pytest.approx(2 / 3)
    assert merges[0].similarity == pytest.approx(1.0 / math.hypot(1.0, 0.2), rel=1e-5)
    assert bank.ids.tolist() == [0, 1, 2, 3] and len(bank) == 4
    expect = torch.tensor([[(1.0 + 1.0) / 2, (0.0 + 0.2) / 2], [0.0, 1.0], [0.05, 1.0],
                           [(-1.0 - 1.0) / 2, (-0.2 + 0.1) / 2]])
    assert torch.allclose(bank.vectors, expect, atol=0, rtol=1e-6)  # eq. 23: plain averages
    # metadata: references summed, the younger age kept, mass and sources joined
    assert bank.freq.tolist() == [2, 1, 0, 3] and bank.reads.tolist() == [2, 1, 0, 3]
    assert bank.attn_sum.tolist() == pytest.approx([1.0, 0.1, 0.0, 0.3])
    assert bank.age.tolist() == [3, 1, 0, 2]
    assert bank.mass.tolist() == [2, 1, 1, 2]
    assert bank.sources == [frozenset({1, 2}), frozenset({1}), frozenset({1}), frozenset({1, 2})]
    assert bank.importance()[3] == pytest.approx(3 + 10 * 0.1 + 2 / 3)
    assert bank.summary()["merges"] == 2 and bank.n_clusters == 2


def test_crossattn_context_merged_vector_can_merge_again():
    bank = ContextBank(2, capacity=1, gamma=1.0, alpha=0.0, beta=0.0, clusters=1)
    merges = bank.add(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), metadata={"age": [0, 1, 2]})
    # id 2 (oldest) merges into id 0 or 1 (equal cosine: the earliest, id 0), then id 1 (age 1) into id 0
    assert [(m.victim, m.into) for m in merges] == [(2, 0), (1, 0)]
    assert torch.allclose(bank.vectors, torch.tensor([[((1 + 1) / 2 + 0) / 2, ((0 + 1) / 2 + 1) / 2]]))
    assert bank.mass.tolist() == [3] and bank.age.tolist() == [0]


# --------------------------------------------------------------------------------------------------
# Clusters and retrieval


def test_crossattn_context_online_clustering_and_reclustering():
    bank = ContextBank(2, capacity=100, cluster_size=4, seed=0)
    bank.add(torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    assert bank.n_clusters == 1 and bank.reclusters == 1
    bank.add(torch.tensor([[2.0, 3.0]]))  # k stays 1: the vector joins online, the centroid is the new mean
    assert bank.reclusters == 1 and bank.assign.tolist() == [0, 0, 0]
    assert torch.allclose(bank.centroids[0], torch.tensor([1.0, 1.0]))
    bank.add(torch.tensor([[10.0, 10.0], [11.0, 10.0]]))  # 5 vectors: k = ceil(5 / 4) = 2, a full k-means
    assert bank.reclusters == 2 and bank.n_clusters == 2
    assert bank.assign[:3].unique().numel() == 1 and bank.assign[3] == bank.assign[4] != bank.assign[0]
    for c in range(2):
        assert torch.allclose(bank.centroids[c], bank.vectors[bank.assign == c].mean(0))


def _identity_layer() -> tuple[MemoryCrossAttention, LatentBank]:
    layer = MemoryCrossAttention(d_model=4, bank_width=4, width=4, heads=1)
    with torch.no_grad():
        for lin in (layer.wq, layer.wk, layer.wv, layer.wo):
            lin.weight.copy_(torch.eye(4))
    learned = LatentBank(2, 4)
    with torch.no_grad():
        learned.weight.fill_(1.0)  # RMS 1: the context vectors are read at scale 1
    return layer, learned


def test_crossattn_context_retrieval_reads_only_the_top_k_clusters():
    layer, learned = _identity_layer()
    bank = ContextBank(4, capacity=16, clusters=2, top_k=1)
    a = torch.tensor([[3.0, 0.1, 0.0, 0.0], [3.0, -0.1, 0.0, 0.0], [3.0, 0.0, 0.1, 0.0]])
    b = torch.tensor([[0.0, 3.0, 0.0, 0.1], [0.1, 3.0, 0.0, 0.0], [0.0, 3.0, 0.0, -0.1]])
    bank.add(torch.cat([a, b]), source=1)
    assert bank.assign[:3].unique().numel() == 1 and bank.assign[3:].unique().numel() == 1
    assert bank.assign[0] != bank.assign[3]
    h = torch.tensor([[[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]])  # token 0 aligned with A, token 1 with B
    with torch.no_grad():
        alone = layer(h, learned)[0]
        reader = ContextRead(layer, bank)
        with_bank = layer(h, learned)[0]
    read = with_bank - alone
    probs_a = torch.softmax(a @ h[0, 0] / 2.0, dim=0)  # sqrt(head_dim) = 2
    probs_b = torch.softmax(b @ h[0, 1] / 2.0, dim=0)
    assert torch.allclose(read[0, 0], probs_a @ a, atol=1e-5)  # cluster A's members only
    assert torch.allclose(read[0, 1], probs_b @ b, atol=1e-5)
    # statistics: one read each, at the weight given by the token that selected its cluster
    assert bank.freq.tolist() == [1.0] * 6 and bank.reads.tolist() == [1.0] * 6
    assert torch.allclose(bank.avg_attn.float(), torch.cat([probs_a, probs_b]), atol=1e-6)
    # a query aligned with A alone: B's members are not attended at all
    with torch.no_grad():
        layer(h[:, :1], learned)
    assert bank.reads.tolist() == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    assert bank.freq.tolist() == [1.0] * 6  # the same run
    bank.end_run()
    with torch.no_grad():
        layer(h[:, :1], learned)
    assert bank.freq.tolist() == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    assert torch.allclose(bank.avg_attn[:3].float(), probs_a, atol=1e-6)  # the same weight every time
    reader.detach()
    with torch.no_grad():
        assert torch.equal(layer(h, learned)[0], alone)


def test_crossattn_context_top_k_two_reads_both_clusters():
    layer, learned = _identity_layer()
    bank = ContextBank(4, capacity=16, clusters=2, top_k=2)
    vectors = torch.tensor([[3.0, 0.0, 0.0, 0.0], [3.0, 0.1, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0], [0.0, 3.0, 0.1, 0.0]])
    bank.add(vectors)
    h = torch.tensor([[[2.0, 0.0, 0.0, 0.0]]])
    with torch.no_grad():
        alone = layer(h, learned)[0]
        with ContextRead(layer, bank):
            read = layer(h, learned)[0] - alone
    probs = torch.softmax(vectors @ h[0, 0] / 2.0, dim=0)
    assert torch.allclose(read[0, 0], probs @ vectors, atol=1e-5)
    assert bank.freq.tolist() == [1.0] * 4 and bank.reads.tolist() == [1.0] * 4


# --------------------------------------------------------------------------------------------------
# Statistics and age


def test_crossattn_context_attention_statistics_update_freq_and_avg_attn():
    bank = ContextBank(2, capacity=8)
    bank.add(torch.eye(2).repeat(2, 1))
    bank.record(torch.tensor([0, 2]), torch.tensor([0.5, 0.25]))
    bank.record(torch.tensor([0]), torch.tensor([0.3]))
    bank.record(torch.tensor([1]), torch.tensor([0.9]), counts=torch.tensor([3.0]))  # three reads at once
    # freq counts runs with an attended read, reads every attended read; avg_attn = attn_sum / reads
    assert bank.freq.tolist() == [1, 1, 1, 0] and bank.reads.tolist() == [2, 3, 1, 0]
    assert bank.avg_attn.tolist() == pytest.approx([0.4, 0.3, 0.25, 0.0])
    assert bank.attention_by_source() == {}  # no sources given
    bank.end_run()
    assert bank.run_attention.tolist() == [0, 0, 0, 0] and bank.freq.tolist() == [1, 1, 1, 0]
    bank.record(torch.tensor([0, 3]), torch.tensor([0.2, 0.6]))
    assert bank.freq.tolist() == [2, 1, 1, 1] and bank.reads.tolist() == [3, 3, 1, 1]
    assert bank.avg_attn.tolist() == pytest.approx([(0.5 + 0.3 + 0.2) / 3, 0.3, 0.25, 0.6])
    # importance (eq. 24, the defaults alpha 0.25, beta 1, gamma 1; every vector is one run old)
    assert bank.importance().tolist() == pytest.approx([0.25 * 2 + 1 / 3 + 1 / 2, 0.25 + 0.3 + 1 / 2,
                                                        0.25 + 0.25 + 1 / 2, 0.25 + 0.6 + 1 / 2])


def test_crossattn_context_age_increments_per_run():
    bank = ContextBank(2, capacity=8)
    bank.add(torch.ones(2, 2), source=1)
    assert bank.age.tolist() == [0, 0] and bank.runs == 0
    bank.end_run()
    bank.add(torch.ones(1, 2), source=2)
    assert bank.age.tolist() == [1, 1, 0]
    bank.end_run()
    bank.end_run()
    assert bank.age.tolist() == [3, 3, 2] and bank.runs == 3
    assert bank.recency.tolist() == pytest.approx([1 / 4, 1 / 4, 1 / 3])


# --------------------------------------------------------------------------------------------------
# The encoder (eq. 22)


def test_crossattn_context_encoder_reconstruction_loss_falls():
    model = _model()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        train = hidden_states(model, torch.randint(64, (24, 48), generator=gen))
        held_out = hidden_states(model, torch.randint(64, (8, 48), generator=gen))
    assert train.shape == (24, 48, 64)  # [E^(1); E^(L_max)]: 2 d
    enc = ContextEncoder(32, tokens_per_vector=8)
    enc.set_statistics(train)
    with torch.no_grad():
        before = float(enc.loss(held_out))
    losses = fit_context_encoder(enc, train, steps=200, seed=0)
    with torch.no_grad():
        after = float(enc.loss(held_out))
    assert sum(losses[-20:]) / 20 < 0.75 * sum(losses[:5]) / 5
    assert after < 0.75 * before, (before, after)
    z = enc.compress(held_out[0, :19])
    assert z.shape == (3, 32)  # ceil(19 / 8) latents of width d
    assert torch.allclose(z.pow(2).mean(-1), torch.ones(3), atol=1e-4)  # unit RMS
    # a partial last chunk: its padding is not scored
    x, valid = enc.chunks(held_out[:1, :19])
    assert x.shape == (1, 3, 8 * 64) and valid.sum() == 19


# --------------------------------------------------------------------------------------------------
# The model with and without a context bank


def test_crossattn_context_model_unchanged_without_bank_changed_with_one():
    model = _model()
    x = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(x).logits
    bank = ContextBank(32, capacity=16, cluster_size=4, top_k=1)
    reader = ContextRead(model, bank)
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)  # attached, but empty
    enc = ContextEncoder(32, 8)
    with torch.no_grad():
        states = hidden_states(model, x)
        bank.add(enc.compress(states[0]), source=1)
        with_bank = model(x).logits
        assert not torch.allclose(with_bank, before, atol=1e-4)
        assert bank.freq.sum() > 0  # the reads were recorded
        freq = bank.freq.clone()
        with reader.paused():
            assert torch.equal(model(x).logits, before)
        with reader.not_recording():
            assert torch.equal(model(x).logits, with_bank)
        assert torch.equal(bank.freq, freq)
    reader.detach()
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)
    # training forwards and gradients are those of the model alone once detached
    model.train()
    model(x).logits.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    fresh = _model()
    fresh.train()
    fresh(x).logits.sum().backward()
    for n, p in fresh.named_parameters():
        if p.grad is not None:
            assert torch.equal(grads[n], p.grad), n


def test_crossattn_context_model_apply_walks_modules():
    # DeepSpeed's engine set-up calls model.apply(fn) on every module; the memory's own apply(layer, x)
    # must leave that working.
    model = _model()
    seen = []
    model.apply(lambda m: seen.append(type(m).__name__))
    assert "MemoryCrossAttention" in seen and "CrossAttnMemory" in seen


def test_crossattn_context_rejects_what_cannot_work():
    with pytest.raises(RecipeError, match="context bank capacity must be >= 1"):
        ContextBank(4, capacity=0)
    with pytest.raises(RecipeError, match="context bank top_k must be >= 1"):
        ContextBank(4, capacity=4, top_k=0)
    torch.manual_seed(0)
    plain = build(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=64), None)
    with pytest.raises(RecipeError, match="needs a model with memory.type: crossattn"):
        ContextRead(plain, ContextBank(32, capacity=4))
    with pytest.raises(RecipeError, match="memory.crossattn.dim: the memory layers read 16-wide bank tokens"):
        ContextRead(_model(dim=16), ContextBank(32, capacity=4))
    recipe = Recipe()
    with pytest.raises(RecipeError, match="memory.type: the context bank is read by the memory cross-attention"):
        check_generate(recipe, ["hello"], "on", None, None, None, None, None, None)
    with pytest.raises(RecipeError, match="--bank-capacity set, but --context-bank is off"):
        check_generate(recipe, ["hello"], "off", None, 8, None, None, None, None)
    with pytest.raises(RecipeError, match="--prompt needs a non-empty text"):
        check_generate(recipe, ["  "], "off", None, None, None, None, None, None)
    with pytest.raises(RecipeError, match="--max-new-tokens must be >= 1, got 0"):
        check_generate(recipe, ["hello"], "off", 0, None, None, None, None, None)


# --------------------------------------------------------------------------------------------------
# `memtrain generate` end to end


TINY = {
    "run": {"name": "tiny-ctx", "seed": 7},
    "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 64,
              "tie_embeddings": False},
    "memory": {"type": "crossattn", "crossattn": {"tokens": 16}},
    "data": {"sources": ["builtin"], "seq_len": 64, "val_fraction": 0.02,
             "tokenizer": {"vocab_size": 320, "model_type": "bpe"}},
    "train": {"max_steps": 8, "global_batch_tokens": 512, "micro_batch_size": 4,
              "optimizer": {"lr": 3.0e-3}, "schedule": {"kind": "cosine", "warmup": "2 steps", "min_lr": 3.0e-4},
              "eval": {"every_steps": 8, "batches": 1}},
    "checkpoint": {"every_steps": 8, "keep_last": 1},
    "logging": {"every_steps": 4},
}

def test_crossattn_context_answer_is_scored_as_the_prompt_continues(tmp_path):
    """--answer's tokens are those ``prompt + answer`` encodes to, after the prompt's. Encoded alone and
    appended (until 2026-11-30), " 4721" began with a second word-start piece: the model was scored on
    ``is▁▁4721``, text that is not there."""
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.tokenizer import SentencePieceTokenizer
    from memtrain.eval.common import PromptEncoder
    from memtrain.launcher.generate import answer_logprob, answer_tokens

    tok = SentencePieceTokenizer.train(iter(builtin_documents(0)[::20]), tmp_path / "t.model", 300, "bpe", seed=3)
    enc = PromptEncoder(tok)
    prompt, answer = "What is the pass key? The pass key is", " 4721"
    ids = enc.encode(prompt)
    tokens, start = answer_tokens(enc, prompt, ids, answer)
    assert tokens == tok.encode(prompt + answer) and tokens[:start] == ids
    pieces = [tok.sp.id_to_piece(t) for t in tokens[start:]]
    assert "".join(pieces).replace("\u2581", " ") == answer  # one word-start piece, as in the text
    alone = [tok.sp.id_to_piece(t) for t in tok.encode(answer)]
    assert "".join(alone).replace("\u2581", " ") == "  4721"  # what appending the answer alone scored

    # the mean log-probability of tokens[start:] given tokens[:start], from one forward
    class Fixed(torch.nn.Module):
        def forward(self, x):
            g = torch.Generator().manual_seed(int(x.sum()))
            logits = torch.randn(*x.shape, 300, generator=g)
            return type("Out", (), {"logits": logits})()

    model = Fixed()
    got = answer_logprob(model, tokens, start, 10_000, torch.device("cpu"))
    logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    want = sum(float(logp[t - 1, tokens[t]]) for t in range(start, len(tokens))) / (len(tokens) - start)
    assert got == pytest.approx(want, abs=1e-6)
    with pytest.raises(RecipeError, match="leaves no room for the prompt"):
        answer_logprob(model, tokens, start, len(tokens) - start, torch.device("cpu"))

    # an answer the tokenizer folds into the prompt's tokens entirely: one line naming both
    class Merging:  # "ab" is one token
        def encode(self, text):
            return [{"ab": 9, "a": 1, "b": 2}[p] for p in re.findall("ab|a|b", text)]

    with pytest.raises(RecipeError, match="adds no token after the prompt"):
        answer_tokens(PromptEncoder(Merging()), "a", [1], "b")


FACT = "The pass key is 4721. Remember it. 4721 is the pass key."
QUESTION = "What is the pass key? The pass key is"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _memtrain(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "memtrain", *args], cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=900)
    if check:
        assert out.returncode == 0, f"{args}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny decoder with cross-attention memory layers, trained 8 steps on the built-in corpus."""
    root = tmp_path_factory.mktemp("crossattn_context")
    recipe = json.loads(json.dumps(TINY))
    recipe["data"]["dir"] = str(root / "data")
    recipe["run"]["dir"] = str(root / "run")
    (root / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    _memtrain(root, "prepare", "tiny.yaml")
    _memtrain(root, "train", "tiny.yaml")
    assert (root / "run" / "checkpoints" / "global_step8" / "COMPLETE.json").is_file()
    return root


@pytest.mark.slow
def test_crossattn_context_generate_end_to_end(trained):
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--prompt", "A country has a capital.",
                    "--prompt", QUESTION, "--answer", " 4721", "--max-new-tokens", "4", "--bank-capacity", "6",
                    "--encoder-steps", "60", "--encoder", "enc.pt", "--out", "report.json")
    text = out.stdout
    assert "context encoder: fitted on" in text and "context encoder: saved to enc.pt" in text
    assert text.count("  generated: ") == 3
    assert "[3/3] prompt 'What is the pass key? The pass key is'" in text
    # prompt 1 met an empty bank; the later prompts read it
    assert "context bank read: nothing (empty)" in text
    assert re.search(r"\[3/3\][\s\S]*context bank read: prompt 1 [\d.]+%, prompt 2 [\d.]+%", text), text
    # the bank's state after every prompt, with merges once the capacity of 6 is exceeded
    states = re.findall(r"context bank: \+(\d+) vector\(s\) from (\d+) tokens \(8 per vector\); (\d+)/6 vectors in "
                        r"(\d+) cluster\(s\) \[[\d, ]+\]; (\d+) merge\(s\) this prompt", text)
    assert len(states) == 3, text
    added = [int(s[0]) for s in states]
    assert added == [math.ceil(int(s[1]) / 8) for s in states]
    held = [int(s[2]) for s in states]
    merged = [int(s[4]) for s in states]
    assert held[-1] == min(6, sum(added)) and sum(merged) == sum(added) - held[-1] > 0
    assert "merged #" in text
    report = json.loads((trained / "report.json").read_text())
    q = report["prompts"][2]
    on, off = q["answer_logprob"]["on"], q["answer_logprob"]["off"]
    assert math.isfinite(on) and math.isfinite(off) and on != off  # the bank changes what the model computes
    assert f"mean log-prob per token {on:.4f} with the context bank, {off:.4f} without" in text
    # the answer's tokens as the question's text continues, not " 4721" encoded alone (one word-start piece more)
    from memtrain.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(trained / "data" / "tokenizer.model")
    n = len(tok.encode(QUESTION + " 4721")) - len(tok.encode(QUESTION))
    assert f"answer ' 4721' ({n} tokens)" in text and q["answer_tokens"] == n == len(tok.encode(" 4721")) - 1
    first = report["prompts"][0]["answer_logprob"]
    assert first["on"] == first["off"]  # an empty bank changes nothing
    assert set(q["read_by_prompt"]) == {"1", "2"} and sum(q["read_by_prompt"].values()) == pytest.approx(1.0)
    assert report["encoder"]["loss_last"] < report["encoder"]["loss_first"]

    # the saved encoder is loaded the second time, and the same prompts give the same numbers
    again = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--prompt", "A country has a capital.",
                      "--prompt", QUESTION, "--answer", " 4721", "--max-new-tokens", "4", "--bank-capacity", "6",
                      "--encoder", "enc.pt", "--out", "report2.json")
    assert "context encoder: loaded enc.pt" in again.stdout
    assert json.loads((trained / "report2.json").read_text())["prompts"][2]["answer_logprob"] == {"on": on, "off": off}

    # without the bank: the same greedy text as the bank-off numbers, and no bank lines
    off_run = _memtrain(trained, "generate", "tiny.yaml", "checkpoint=run", "--prompt", QUESTION, "--answer", " 4721",
                        "--max-new-tokens", "4", "--context-bank", "off")
    assert "context bank off" in off_run.stdout and "context bank:" not in off_run.stdout
    assert f"mean log-prob per token {off:.4f} (no context bank)" in off_run.stdout


@pytest.mark.slow
def test_crossattn_context_generate_user_errors_exit_2(trained):
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--bank-capacity", "0", check=False)
    assert out.returncode == 2 and "--bank-capacity must be >= 1, got 0" in out.stderr
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--context-bank", "off", "--encoder", "x.pt",
                    check=False)
    assert out.returncode == 2 and "--encoder set, but --context-bank is off" in out.stderr
    (trained / "bad.pt").write_bytes(b"not a file torch reads")
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--encoder", "bad.pt", check=False)
    assert out.returncode == 2 and "--encoder bad.pt is not a context encoder file" in out.stderr
    assert "pass another --encoder path" in out.stderr and "delete" not in out.stderr  # it may be any file of theirs
    # an --encoder path that cannot be written: refused before the fit (before: a traceback after it, and a
    # leftover .tmp file)
    (trained / "encdir").mkdir()
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--encoder", "encdir", check=False)
    assert out.returncode == 2 and out.stderr.strip() == ("memtrain: --encoder encdir is a folder; give the path of "
                                                          "the file to write, e.g. encdir/encoder.pt")
    out = _memtrain(trained, "generate", "tiny.yaml", "--prompt", FACT, "--encoder", "bad.pt/enc.pt", check=False)
    assert out.returncode == 2 and out.stderr.strip().endswith(f"--encoder bad.pt/enc.pt: {trained / 'bad.pt'} is a "
                                                               "file, not a folder; choose another --encoder")
    assert "fitting" not in out.stdout + out.stderr and not list(trained.glob("*.tmp"))
    # another tokenizer in the prepared folder: before, it loaded and the model's ids came out as other text
    shutil.copytree(trained / "data", trained / "swapped")
    other = trained / "swapped" / "tokenizer.model"
    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: the same size, so only the checksum can tell
    other.write_bytes(bytes(data))
    out = _memtrain(trained, "generate", "tiny.yaml", "data.dir=swapped", "--prompt", FACT, check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("memtrain: swapped/tokenizer.model: xxh64 checksum ")
    assert "`memtrain prepare RECIPE --force`" in out.stderr and "generated:" not in out.stdout

    # the user's own tokenizer (meta.json names it by absolute path; its bytes are not checked) replaced by another
    # one of the same size: its fingerprint tells (before, generate loaded it and wrote other text without a word)
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.tokenizer import SentencePieceTokenizer

    shutil.copytree(trained / "data", trained / "own")
    own = trained / "user.model"
    meta = json.loads((trained / "own" / "meta.json").read_text())
    SentencePieceTokenizer.train(iter(builtin_documents(0)[::5]), own, meta["vocab_size"], "bpe", seed=3,
                                 byte_fallback=False)
    (trained / "own" / "meta.json").write_text(json.dumps({**meta, "tokenizer": str(own)}))
    out = _memtrain(trained, "generate", "tiny.yaml", "data.dir=own", "--prompt", FACT, check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"memtrain: tokenizer '{own}' is not the one own was prepared with: it has the "
                                 "data's vocabulary size and end-of-text id but other pieces"), out.stderr
    assert "`memtrain prepare RECIPE --force`" in out.stderr and "generated:" not in out.stdout
