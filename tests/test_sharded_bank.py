"""The row-sharded memory bank (memtrain.parallel.sharded_bank) on CPU with gloo, 2 and 3 processes:
training equals one process with the replicated MemoryBank stepped by torch.optim.AdamW (dense mode)
or torch.optim.SparseAdam (lazy mode); counted bank bytes follow the fetched rows, not the bank size;
bad ids fail on every rank; state round-trips across world sizes."""

from __future__ import annotations

import functools
import socket

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import MemoryConfig, ModelConfig
from memtrain.model import build
from memtrain.model.anchor import anchor_dims
from memtrain.model.hierarchical import MemoryLayout
from memtrain.parallel.bank import MemoryBank
from memtrain.parallel.sharded_bank import ShardedMemoryBank

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=24)
K, SEED = 3, 5
STEPS, ACCUM, MB, T = 4, 2, 2, 12
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.1, 0.3  # clipping bites on some steps, not all


def lr_at(step: int) -> float:
    return 1e-2 * (1 - 0.1 * step)


def make_model():
    torch.manual_seed(0)
    model = build(TINY, MemoryConfig(type="ffn", levels=[2, 3]), branching=K)
    for p in model.parameters():  # only the bank trains: the comparison is the bank's
        p.requires_grad_(False)
    return model


def micro_batch(step: int, rank: int, micro: int):
    """Tokens, [MB, 2] cluster ids (level-1 = leaf // K) and the generic mask of one micro-batch."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, TINY.vocab_size, (MB, T), generator=g)
    leaf = torch.randint(0, K * K, (MB,), generator=g)
    generic = torch.rand(MB, generator=g) < 0.25
    if (step, rank, micro) == (1, 1, 0):
        generic[:] = True  # a rank whose micro-batch is all generic still serves the others
    return x, torch.stack([leaf // K, leaf], 1), generic


def lm_loss(model, x, memory):
    logits = model(x, memory=memory).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def clip_coef(norm: float) -> float:
    return min(1.0, CLIP / (norm + 1e-6))


# --------------------------------------------------------------------------------------------------
# Worker processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_sharded(model, mode: str, rank: int):
    bank = ShardedMemoryBank(model.memory_layout, seed=SEED, mode=mode)
    bank.build_optimizer(lr_at(0), BETAS, EPS, WD if mode == "dense" else 0.0)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, ids, generic = micro_batch(step, rank, micro)
            loss = lm_loss(model, x, bank.fetch(ids, generic)) / ACCUM
            if loss.requires_grad:  # an all-generic micro-batch reaches no bank row (the model is frozen)
                loss.backward()
        bank.reduce_gradients()
        norms.append(bank.grad_norm())
        bank.scale_gradients(clip_coef(norms[-1]))
        bank.step(lr_at(step))
    return bank, norms


def _byte_run(levels, branching, leaves, rank):
    """One step fetching ``leaves`` (same on every rank, shifted by rank) -> (this rank's bytes, zero3)."""
    lay = MemoryLayout.build(MemoryConfig(type="ffn", levels=list(levels)), anchor_dims(TINY), branching)
    bank = ShardedMemoryBank(lay, seed=SEED)
    bank.build_optimizer(1e-2, BETAS, EPS, WD)
    leaf = torch.tensor(leaves) + rank
    ids = torch.stack([leaf // K, leaf], 1)  # level-1 ids in [0, 3), level-2 in [0, 9) for leaves < 8
    mem = bank.fetch(ids)
    sum(r.sum() for r in mem.levels if r is not None).backward()
    bank.reduce_gradients()
    bank.step(1e-2)
    stats = bank.stats()
    return {"bytes": bank.comm_bytes(), "zero3": bank.zero3_reference_bytes(),
            "stats": {k: v for k, v in stats.items() if k.startswith("comm/")}}


def _worker(rank: int, world: int, port: int, out_dir: str, extras: bool):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = make_model()
        result = {}
        bank, norms = _train_sharded(model, "dense", rank)
        full = bank.gather_full_state()
        result["dense"] = {"tables": full["tables"], "exp_avg": full["exp_avg"], "norms": norms,
                           "state": full, "step": full["step"], "stats": bank.stats()}
        if extras:
            bank, norms = _train_sharded(model, "lazy", rank)
            result["lazy"] = {"tables": bank.gather_full_state()["tables"], "norms": norms}
            result["bytes"] = {
                "few_small": _byte_run((2, 3), K, [0, 4], rank),
                "few_big": _byte_run((2, 3), 2 * K, [0, 4], rank),  # 2x level-1 rows, 4x level-2 rows
                "many_small": _byte_run((2, 3), K, [0, 1, 3, 4, 6, 7], rank),
            }
            bad = torch.tensor([[0, 9 if rank == 1 else 0]])
            try:
                bank.fetch(bad)
                result["bad"] = None
            except ValueError as e:
                result["bad"] = str(e)
            result["after_bad"] = bank.fetch(torch.tensor([[rank, rank]]), count=False).levels[1].shape
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _spawn(world: int, out_dir: str, extras: bool) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), out_dir, extras), nprocs=world, join=True)
    return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def get(world: int) -> list[dict]:
        d = tmp_path_factory.getbasetemp() / f"sharded_w{world}"
        d.mkdir(exist_ok=True)
        return _spawn(world, str(d), world == 2)
    return get


# --------------------------------------------------------------------------------------------------
# Single-process references on the concatenated global batch


def _global_batch(step: int, world: int):
    parts = [micro_batch(step, r, m) for r in range(world) for m in range(ACCUM)]
    return tuple(torch.cat(p) for p in zip(*parts))


def reference_dense(world: int):
    model = make_model()
    bank = MemoryBank(model.memory_layout, seed=SEED)
    bank.build_optimizer(lr_at(0), BETAS, EPS, WD)
    norms = []
    for step in range(STEPS):
        x, ids, generic = _global_batch(step, world)
        lm_loss(model, x, bank.fetch(ids, generic)).backward()  # mean over the global batch
        for t in bank.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        norms.append(bank.grad_norm())
        bank.scale_gradients(clip_coef(norms[-1]))
        bank.step(lr_at(step))
    return bank, norms


def reference_sparse_adam(world: int):
    """Lazy semantics: torch.optim.SparseAdam on a dense replica, the gradient restricted to the rows
    fetched in the step (as an nn.Embedding(sparse=True) would produce)."""
    model = make_model()
    bank = MemoryBank(model.memory_layout, seed=SEED)
    opt = torch.optim.SparseAdam(bank.parameters(), lr=lr_at(0), betas=BETAS, eps=EPS)
    norms = []
    for step in range(STEPS):
        x, ids, generic = _global_batch(step, world)
        lm_loss(model, x, bank.fetch(ids, generic)).backward()
        norms.append(bank.grad_norm())
        bank.scale_gradients(clip_coef(norms[-1]))
        for level, t in enumerate(bank.tables):
            rows = torch.unique(ids[~generic, level])
            t.grad = torch.sparse_coo_tensor(rows[None], t.grad[rows], t.shape, check_invariants=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return bank, norms


# --------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_dense_training_equals_replicated_adamw(runs, world):
    results = runs(world)
    ref, ref_norms = reference_dense(world)
    assert min(map(clip_coef, ref_norms)) < 1 == max(map(clip_coef, ref_norms))
    for res in results:  # every rank gathers the same full bank
        got = res["dense"]
        for level, table in enumerate(ref.tables):
            torch.testing.assert_close(got["tables"][str(level)], table.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
        assert got["step"] == STEPS
        assert got["stats"] == pytest.approx({**ref.stats(reset=False), "comm/bank_bytes_sent": got["stats"][
            "comm/bank_bytes_sent"], "comm/bank_bytes_received": got["stats"]["comm/bank_bytes_received"],
            "comm/bank_zero3_bytes": 3 * ACCUM * (world - 1) * ref.layout.bank_parameters * 4 // world}, rel=1e-5)
    # the bank moved, and rows fetched by no sequence in a step moved too (decay and momentum)
    init = MemoryBank(ref.layout, seed=SEED)
    for level in range(2):
        assert not torch.allclose(results[0]["dense"]["tables"][str(level)], init.tables[level].detach())


def test_sharded_state_reshards_to_another_world_size(runs):
    """gather_full_state() of 3 ranks loads into a 1-rank bank; its own state_dict round-trips."""
    full = runs(3)[0]["dense"]["state"]
    model = make_model()
    bank = ShardedMemoryBank(model.memory_layout, seed=99)
    bank.build_optimizer(1e-2, BETAS, EPS, WD)
    bank.load_state_dict(full)
    for level in range(2):
        assert torch.equal(bank.shards[level], full["tables"][str(level)])
        assert torch.equal(bank.exp_avg[level], full["exp_avg"][str(level)])
    assert bank._step == STEPS
    other = ShardedMemoryBank(model.memory_layout, seed=7)
    other.build_optimizer(1e-2, BETAS, EPS, WD)
    other.load_state_dict(bank.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(bank.parameters(), other.parameters()))
    wrong = ShardedMemoryBank(MemoryLayout.build(MemoryConfig(type="ffn", levels=[2, 4]), anchor_dims(TINY), K))
    with pytest.raises(ValueError, match="levels"):
        wrong.load_state_dict(full)
    replicated = MemoryBank(model.memory_layout, seed=99)  # evaluation loads the gathered rows
    replicated.load_state_dict(full)
    assert all(torch.equal(t.detach(), full["tables"][str(l)]) for l, t in enumerate(replicated.tables))


def test_loads_a_memory_bank_state_and_continues_identically():
    """A MemoryBank checkpoint (rows, torch AdamW moments, step) loads into the sharded bank; one more
    step on both gives the same rows."""
    model = make_model()
    ref = MemoryBank(model.memory_layout, seed=SEED)
    ref.build_optimizer(1e-2, BETAS, EPS, WD)
    x, ids, _ = micro_batch(0, 0, 0)
    for _ in range(2):
        lm_loss(model, x, ref.fetch(ids)).backward()
        ref.step(1e-2)
    bank = ShardedMemoryBank(model.memory_layout, seed=99)
    bank.build_optimizer(1e-2, BETAS, EPS, WD)
    bank.load_state_dict(ref.state_dict())
    assert bank._step == 2
    lm_loss(model, x, ref.fetch(ids)).backward()
    ref.step(1e-2)
    lm_loss(model, x, bank.fetch(ids)).backward()
    bank.step(1e-2)
    for a, b in zip(ref.parameters(), bank.parameters()):
        torch.testing.assert_close(b, a.detach(), rtol=0, atol=1e-6)


def test_lazy_mode_equals_sparse_adam(runs):
    results = runs(2)
    ref, ref_norms = reference_sparse_adam(2)
    for res in results:
        for level, table in enumerate(ref.tables):
            torch.testing.assert_close(res["lazy"]["tables"][str(level)], table.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(res["lazy"]["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    # lazy differs from dense: untouched rows do not decay
    assert not torch.allclose(results[0]["lazy"]["tables"]["1"], results[0]["dense"]["tables"]["1"])


def test_bank_bytes_follow_fetched_rows_not_bank_size(runs):
    for res in runs(2):
        b = res["bytes"]
        few, big, many = b["few_small"], b["few_big"], b["many_small"]
        # leaves {0, 4} + rank: each rank needs one level-1 row the other owns (level-2 rows stay home):
        # 4 split-size messages, 1 request id + 1 row out, and 1 gradient (id + row) back, each way.
        s1 = 4 * make_model().memory_layout.block_size(0)
        assert few["bytes"] == {"sent": 4 * 8 + 8 + s1 + 8 + s1, "received": 4 * 8 + 8 + s1 + 8 + s1,
                                "micro_batches": 1}
        assert big["bytes"] == few["bytes"]  # same fetch pattern, 4x the level-2 rows: same traffic
        assert many["bytes"]["sent"] > few["bytes"]["sent"]
        assert many["bytes"]["received"] > few["bytes"]["received"]
        assert big["zero3"] > few["zero3"] == many["zero3"] > few["bytes"]["sent"]
        assert few["stats"] == {"comm/bank_bytes_sent": few["bytes"]["sent"],
                                "comm/bank_bytes_received": few["bytes"]["received"],
                                "comm/bank_zero3_bytes": few["zero3"]}


def test_exact_byte_count_and_zero3_formula():
    """World of one: nothing crosses the wire. The ZeRO-3 reference is 3 m (W-1)/W P 4 bytes."""
    model = make_model()
    bank = ShardedMemoryBank(model.memory_layout, seed=SEED)
    bank.build_optimizer(1e-2, BETAS, EPS, WD)
    bank.fetch(torch.tensor([[0, 1]]))
    bank.step(1e-2)
    assert bank.comm_bytes() == {"sent": 0, "received": 0, "micro_batches": 1}
    assert bank.zero3_reference_bytes() == 0
    bank.world = 4  # the formula alone
    P = model.memory_layout.bank_parameters
    assert bank.zero3_reference_bytes(micro_batches=2) == 3 * 2 * 3 * P * 4 // 4


def test_bad_ids_are_rejected_on_every_rank(runs):
    results = runs(2)
    assert "another data-parallel rank" in results[0]["bad"]
    assert results[1]["bad"] == "level-2 cluster ids must lie in [0, 9); got [9, 9]"
    assert all(tuple(r["after_bad"]) == (1, 3 * 3 * TINY.d_model * 3) for r in results)  # still in step


def test_bad_ids_single_process():
    bank = ShardedMemoryBank(make_model().memory_layout, seed=SEED)
    with pytest.raises(ValueError, match=r"level-2 cluster ids must lie in \[0, 9\)"):
        bank.fetch(torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match=r"level-1 cluster ids must lie in \[0, 3\)"):
        bank.fetch(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="one id per level"):
        bank.fetch(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no weight decay"):
        ShardedMemoryBank(bank.layout, mode="lazy").build_optimizer(1e-2, BETAS, EPS, 0.1)


def test_single_process_matches_memory_bank():
    """World of one: same initial rows, same fetched values and gradients, same stats as MemoryBank."""
    model = make_model()
    ref = MemoryBank(model.memory_layout, seed=SEED)
    bank = ShardedMemoryBank(model.memory_layout, seed=SEED)
    for a, b in zip(ref.parameters(), bank.parameters()):
        assert torch.equal(a.detach(), b)
    x, ids, _ = micro_batch(0, 0, 0)
    generic = torch.tensor([False, True])
    with torch.no_grad():
        a, b = ref.fetch(ids, generic), bank.fetch(ids, generic)
        assert all(torch.equal(u, v) for u, v in zip(a.levels, b.levels))
    s_ref, s_bank = ref.stats(), bank.stats()
    assert {k: v for k, v in s_bank.items() if not k.startswith("comm/")} == pytest.approx(s_ref)
