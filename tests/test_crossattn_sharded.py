"""The sharded cross-attention bank (memtrain.parallel.chapter_bank): chapters are rows of a row-sharded
bank, fetched inside the forward from their owners on 2 gloo ranks. Against one process with the
replicated LatentBank stepped by torch.optim.AdamW: the same losses (so the same chapters were read),
the same gradients, the same bank and moments after one and several clipped steps, for per-layer banks
with token routing, a shared bank with sequence routing and an unrouted bank. The counted bytes equal
the byte model exactly and follow the routed chapters, not the bank size; evaluation fetches are not
counted; bad ids fail on every rank. End to end through the trainer: sharded and replicated banks give
the same losses on 2 ranks, and a sharded checkpoint resumes on 1 rank as the run continued."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from memtrain.config import recipe_from_dict
from memtrain.errors import LaunchError
from memtrain.model import build
from memtrain.model.crossattn import LatentBank
from memtrain.parallel.chapter_bank import (ShardedChapterBank, latent_bank_state, predict_chapter_bytes,
                                            zero3_chapter_bytes)

BASE = {"model": {"vocab_size": 61, "d_model": 16, "n_layers": 2, "n_heads": 2, "ffn_dim": 32, "max_seq_len": 16,
                  "attention": "sdpa", "tie_embeddings": False},
        "data": {"seq_len": 16, "tokenizer": {"vocab_size": 61}}}
CONFIGS = {  # 48 tokens in 12 chapters of 4 (unrouted: 24 tokens)
    "perlayer_token": {"tokens": 48, "chapters": 12, "top_k": 2, "routing": "token"},
    "shared_sequence": {"tokens": 48, "chapters": 12, "top_k": 3, "routing": "sequence", "shared": True},
    "unrouted": {"tokens": 24, "chapters": 6, "top_k": 0},
}
WORLD, STEPS, ACCUM, MB, T = 2, 3, 2, 2, 12
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.1, 0.05  # clipping bites on some steps


def lr_at(step: int) -> float:
    return 2e-2 * (1 - 0.2 * step)


def clip_coef(norm: float) -> float:
    return min(1.0, CLIP / (norm + 1e-6))


def make_model(crossattn: dict):
    """The model with non-zero W_O (memory reads matter) and only the banks trainable."""
    r = recipe_from_dict({**BASE, "memory": {"type": "crossattn", "crossattn": crossattn}})
    torch.manual_seed(0)
    model = build(r.model, r.memory)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for part in model.crossattn.parts.values():
            part.attn.wo.weight.copy_(0.5 * torch.randn(part.attn.wo.weight.shape, generator=g))
    for p in model.parameters():
        p.requires_grad_(False)
    for b in model.crossattn.banks:
        b.weight.requires_grad_(True)
    return model


def micro_batch(step: int, rank: int, micro: int) -> torch.Tensor:
    return torch.randint(0, 61, (MB, T), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------
# Worker processes (2 gloo ranks)


def _train_sharded(name: str, rank: int) -> dict:
    model = make_model(CONFIGS[name])
    bank = ShardedChapterBank.replace_banks(model.crossattn)
    bank.build_optimizer(lr_at(0), BETAS, EPS, WD)
    out = {"losses": [], "grads": [], "norms": [], "bytes": [], "traces": [], "zero3": []}
    for step in range(STEPS):
        bank.trace = []
        for micro in range(ACCUM):
            loss = lm_loss(model, micro_batch(step, rank, micro)) / ACCUM
            out["losses"].append(float(loss.detach()))
            loss.backward()
        bank.reduce_gradients()
        # This rank's reduced gradients: (global chapter ids, rows) per bank.
        out["grads"].append({l: (bank.owned[l][g[0]], g[1].clone()) for l, g in enumerate(bank.grads) if g is not None})
        out["norms"].append(bank.grad_norm())
        bank.scale_gradients(clip_coef(out["norms"][-1]))
        bank.step(lr_at(step))
        out["bytes"].append(bank.comm_bytes())
        out["traces"].append(bank.trace)
        out["zero3"].append(bank.zero3_reference_bytes())
    full = bank.gather_full_state()
    out.update(tables=full["tables"], exp_avg=full["exp_avg"], exp_avg_sq=full["exp_avg_sq"], step=full["step"])
    # Evaluation forwards fetch too (every rank, every memory layer) but are not counted.
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = model(micro_batch(99, rank, 0)).logits
    out["eval_bytes"] = list(bank._bytes)
    out["stats"] = bank.stats()
    model.train()
    return out


def _byte_scaling(rank: int) -> dict:
    """One training fetch of chapters [0, U) of a bank of C chapters, per (C, U): bytes of the step."""
    out = {}
    for C in (8, 32):
        for U in (2, 6):
            bank = ShardedChapterBank(1, C * 4, 8, C, seed=3)
            bank.build_optimizer(1e-2, BETAS, EPS, WD)
            bank.views[0].chapters(torch.arange(U) + rank).sum().backward()
            bank.reduce_gradients()
            bank.step(1e-2)
            out[(C, U)] = (bank.comm_bytes()["sent"], bank.zero3_reference_bytes())
    return out


def _bad_ids(rank: int) -> str | None:
    bank = ShardedChapterBank(1, 16, 4, 4, seed=3)
    try:
        bank.views[0].chapters(torch.tensor([0, 7 if rank == 1 else 1]))
    except ValueError as e:
        return str(e)
    return None


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {name: _train_sharded(name, rank) for name in CONFIGS}
        result["scaling"] = _byte_scaling(rank)
        result["bad"] = _bad_ids(rank)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _spawn(out_dir: str) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(WORLD, _free_port(), out_dir), nprocs=WORLD, join=True)
    return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return _spawn(str(tmp_path_factory.mktemp("crossattn_sharded")))


# --------------------------------------------------------------------------------------------------
# The replicated reference: one process, every rank's micro-batches, torch.optim.AdamW on LatentBank


def reference(name: str) -> dict:
    model = make_model(CONFIGS[name])
    weights = [b.weight for b in model.crossattn.banks]
    opt = torch.optim.AdamW(weights, lr=lr_at(0), betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    out = {"losses": [[] for _ in range(WORLD)], "grads": [], "norms": []}
    for step in range(STEPS):
        for rank in range(WORLD):
            for micro in range(ACCUM):
                loss = lm_loss(model, micro_batch(step, rank, micro)) / ACCUM
                out["losses"][rank].append(float(loss.detach()))
                (loss / WORLD).backward()  # the mean over ranks, as reduce_gradients divides by W
        out["grads"].append([w.grad.clone() for w in weights])
        out["norms"].append(float(torch.nn.utils.get_total_norm([w.grad for w in weights])))
        for w in weights:
            w.grad.mul_(clip_coef(out["norms"][-1]))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        out["eval_logits"] = [model(micro_batch(99, rank, 0)).logits for rank in range(WORLD)]
    out["weights"] = [w.detach() for w in weights]
    out["moments"] = [(opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]) for w in weights]
    return out


# --------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("name", list(CONFIGS))
def test_crossattn_sharded_bank_trains_like_the_replicated_bank_with_adamw(runs, name):
    ref = reference(name)
    coefs = [clip_coef(n) for n in ref["norms"]]
    assert min(coefs) < 1, "clipping should bite on some step"
    n_banks = len(ref["weights"])
    C = CONFIGS[name]["chapters"]
    for rank, res in enumerate(runs):
        got = res[name]
        # Values: the same losses on every micro-batch, so every routed chapter was served as stored.
        assert got["losses"] == pytest.approx([x for s in range(STEPS) for x in
                                               ref["losses"][rank][s * ACCUM:(s + 1) * ACCUM]], rel=1e-6)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-6, atol=1e-9)
        assert got["step"] == STEPS
        for l in range(n_banks):
            table = ref["weights"][l].reshape(C, -1)
            torch.testing.assert_close(got["tables"][str(l)], table, rtol=0, atol=1e-6)
            torch.testing.assert_close(got["exp_avg"][str(l)], ref["moments"][l][0].reshape(C, -1), rtol=0, atol=1e-7)
            torch.testing.assert_close(got["exp_avg_sq"][str(l)], ref["moments"][l][1].reshape(C, -1), rtol=1e-5,
                                       atol=1e-10)
        torch.testing.assert_close(got["eval_logits"], ref["eval_logits"][rank], rtol=1e-5, atol=1e-5)
        assert got["eval_bytes"] == [0, 0]  # evaluation forwards are not counted
    # Gradients: the owners' reduced rows together are the replicated bank's gradient (zero elsewhere).
    for step in range(STEPS):
        for l in range(n_banks):
            full = torch.zeros_like(ref["grads"][step][l].reshape(C, -1))
            for res in runs:
                ids, rows = res[name]["grads"][step].get(l, (torch.empty(0, dtype=torch.long), None))
                if len(ids):
                    full[ids] = rows
            torch.testing.assert_close(full, ref["grads"][step][l].reshape(C, -1), rtol=1e-5, atol=1e-7)
    # Every chapter moved (weight decay and momentum reach chapters nobody fetched in a step).
    init = make_model(CONFIGS[name]).crossattn.banks[0].weight.reshape(C, -1)
    assert bool((runs[0][name]["tables"]["0"] != init).all(dim=1).all())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_crossattn_sharded_bytes_equal_the_byte_model(runs, name):
    model = make_model(CONFIGS[name])
    n_banks, row_numel = len(model.crossattn.banks), model.crossattn.banks[0].chapter_tokens * 16
    P = sum(b.parameter_count for b in model.crossattn.banks)
    for step in range(STEPS):
        traces = [res[name]["traces"][step] for res in runs]
        assert len(traces[0]) == ACCUM * len(model.crossattn.parts)  # one fetch per memory layer and forward
        predicted = predict_chapter_bytes(n_banks, row_numel, traces)
        for res, want in zip(runs, predicted):
            got = res[name]["bytes"][step]
            assert (got["sent"], got["received"]) == (want["sent"], want["received"])
            assert res[name]["zero3"][step] == zero3_chapter_bytes(P, WORLD, ACCUM) == 3 * ACCUM * P * 4 // 2
    stats = runs[0][name]["stats"]
    assert stats["comm/bank_bytes_sent"] == runs[0][name]["bytes"][-1]["sent"]
    assert stats["comm/bank_zero3_bytes"] == runs[0][name]["zero3"][-1]
    assert 0 < stats["memory_module/bank_chapters_fetched_frac"] <= 1


def test_crossattn_sharded_bytes_follow_routed_chapters_not_bank_size(runs):
    s = runs[0]["scaling"]
    assert s[(8, 2)][0] == s[(32, 2)][0] < s[(8, 6)][0] == s[(32, 6)][0]  # same chapters, 4x the bank: same bytes
    assert s[(32, 2)][1] == 4 * s[(8, 2)][1]  # ZeRO-3 grows with the bank
    assert s[(32, 6)][0] < s[(32, 6)][1]


def test_crossattn_sharded_bad_ids_fail_on_every_rank(runs):
    assert "must lie in [0, 4)" in runs[1]["bad"]
    assert "another data-parallel rank" in runs[0]["bad"]


def test_crossattn_sharded_single_process_reads_like_the_latent_bank():
    """A world of one: rows, chapters, all and their gradients as LatentBank's; the model's forward with
    the views equals the replicated one; a low-rank bank is refused."""
    torch.manual_seed(0)
    ref = LatentBank(24, 8, chapters=6)
    bank = ShardedChapterBank(1, 24, 8, 6, sources=[ref.weight.detach()])
    view = bank.views[0]
    idx = torch.tensor([[5, 1], [23, 5]])
    ids = torch.tensor([4, 0, 4])
    for a, b in ((view.rows(idx), ref.rows(idx)), (view.chapters(ids), ref.chapters(ids)), (view.all(), ref.all())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (view.rows(idx).sum() + 2 * view.chapters(ids).sum()).backward()
    (ref.rows(idx).sum() + 2 * ref.chapters(ids).sum()).backward()
    bank.reduce_gradients()
    rows, grads = bank.grads[0]
    torch.testing.assert_close(torch.zeros(6, 32).index_copy(0, rows, grads), ref.weight.grad.reshape(6, 32))
    assert view.chapters(ids, torch.float64).dtype == torch.float64 and view.parameter_count == 24 * 8
    model = make_model(CONFIGS["shared_sequence"])
    sharded = copy.deepcopy(model)
    ShardedChapterBank.replace_banks(sharded.crossattn)
    assert not any("banks" in k for k in sharded.state_dict())  # nothing of the bank in the module's state
    x = micro_batch(0, 0, 0)
    torch.testing.assert_close(sharded(x).logits, model(x).logits, rtol=0, atol=0)
    r = recipe_from_dict({**BASE, "memory": {"type": "crossattn", "crossattn": {"tokens": 8, "bank_rank": 2}}})
    with pytest.raises(LaunchError, match="low-rank or int8"):
        ShardedChapterBank.replace_banks(build(r.model, r.memory).crossattn)


# --------------------------------------------------------------------------------------------------
# End to end through the trainer (torchrun, DeepSpeed on CPU)

SEQ = 32


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Prepared data and a tiny cross-attention recipe: 2 layers of d 32, one bank per layer of 64 tokens
    in 16 chapters, top-2 per token."""
    from memtrain.config import load_recipe
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("crossattn_e2e")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::60]))
    recipe = {
        "run": {"name": "xattn", "seed": 7},
        "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": SEQ},
        "memory": {"type": "crossattn", "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 1e-3},
                   # No load-balancing loss: Switch's loss of a micro-batch depends on which sequences share it,
                   # so with it the objective changes with the world size (2 ranks x 2 micro-batches vs 1 x 4).
                   "crossattn": {"tokens": 64, "chapters": 16, "top_k": 2, "routing": "token", "bank_lr": 1e-2,
                                 "balance_loss": 0.0}},
        "data": {"dir": str(root / "data"), "sources": [str(src)], "seq_len": SEQ, "val_fraction": 0.05,
                 "tokenizer": {"vocab_size": 300, "model_type": "bpe"}},
        "train": {"max_steps": 4, "global_batch_tokens": 8 * SEQ, "micro_batch_size": 2, "grad_clip": 0.5,
                  "optimizer": {"lr": 3e-3}, "schedule": {"kind": "cosine", "warmup": 1, "min_lr": 3e-4},
                  "eval": {"every_steps": 2, "batches": 2}},
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "logging": {"every_steps": 1},
    }
    (root / "xattn.yaml").write_text(yaml.safe_dump(recipe))
    prepare(load_recipe(root / "xattn.yaml"))
    return root


def train(root: Path, run: str, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    args = ["train", str(root / "xattn.yaml"), f"run.dir={root / 'runs' / run}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "memtrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), "-m", "memtrain", *args]
    out = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def metrics(root: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_crossattn_sharded_bank_trains_like_replicated_and_resumes_on_one_rank(root):
    """memory.crossattn.bank sharded on 2 ranks: the losses (train and validation) of the replicated bank;
    bytes logged; the bank checkpointed as a DCP folder keyed by chapter, none of it in DeepSpeed's
    files; resumed on 1 rank from step 2, the last steps equal the uninterrupted run; the checkpoint's
    banks load into the replicated model."""
    train(root, "rep2", nproc=2)
    out = train(root, "sh2", "memory.crossattn.bank=sharded", nproc=2)
    assert "sharded cross-attention bank: 2 bank(s) x 16 chapters" in out.stdout
    rep, sh = metrics(root, "rep2"), metrics(root, "sh2")
    assert [r["step"] for r in sh] == [1, 2, 3, 4]
    for a, b in zip(rep, sh):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5, abs=1e-6)
        if "loss/val" in a:
            assert b["loss/val"] == pytest.approx(a["loss/val"], rel=1e-5, abs=1e-6)
    last = sh[-1]
    assert 0 < last["comm/bank_bytes_sent"] < last["comm/bank_zero3_bytes"]
    assert 0 < last["memory_module/bank_chapters_fetched_frac"] <= 1 and last["memory_module/bank_param_norm"] > 0
    ckpt = root / "runs" / "sh2" / "checkpoints" / "global_step4"
    assert sorted(p.name for p in (ckpt / "memory_bank").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]
    module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not any("banks" in k for k in module)
    # The banks back into the replicated model (evaluation: `memtrain eval`'s loader, strict on every key).
    from memtrain.eval.evaluate import load_model
    from memtrain.parallel.checkpoint_folder import resolve

    r = recipe_from_dict(yaml.safe_load((root / "xattn.yaml").read_text()))
    r.memory.crossattn.bank = "sharded"
    model, _ = load_model(r, resolve(ckpt), torch.device("cpu"))
    for key, table in latent_bank_state(ckpt, width=32).items():
        assert torch.equal(model.state_dict()[key], table), key
    # and into a new run's model through model.init_from (before: "missing ['crossattn.banks.0.weight']", as the
    # module state holds no bank, though resuming with another memory.crossattn.bank points there)
    from memtrain.model import build
    from memtrain.parallel.checkpoint import load_anchor

    fresh = build(r.model, r.memory)
    load_anchor(fresh, ckpt)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    # Interrupted after step 2, resumed on one rank (the bank resharded from 2 ranks to 1).
    shutil.copytree(root / "runs" / "sh2", root / "runs" / "sh2-to-1")
    shutil.rmtree(root / "runs" / "sh2-to-1" / "checkpoints" / "global_step4")
    out = train(root, "sh2-to-1", "memory.crossattn.bank=sharded")
    assert "resuming from" in out.stdout
    resumed = [r for r in metrics(root, "sh2-to-1") if r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(sh[2:], resumed):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5, abs=1e-6)
    for key, table in latent_bank_state(ckpt, width=32).items():
        resumed_table = latent_bank_state(root / "runs" / "sh2-to-1" / "checkpoints" / "global_step4", width=32)[key]
        torch.testing.assert_close(resumed_table, table, rtol=1e-4, atol=1e-6)
