"""The row-sharded memory bank (memtrain.parallel.sharded_bank) on CPU with gloo, 2 and 3 processes:
training equals one process with the replicated MemoryBank stepped by torch.optim.AdamW (dense mode)
or torch.optim.SparseAdam (lazy mode); deferred mode equals dense (rows left stale for many steps,
caught up on read, write and save, through a state round trip); bf16 storage equals fp32 math rounded
to bf16 every step and halves the fetched row bytes; CPU offload equals the resident bank; every rank's
initial rows are MemoryBank's, drawn in row chunks; counted bank bytes follow the fetched rows, not the
bank size; bad ids fail on every rank; state round-trips across world sizes."""

from __future__ import annotations

import functools
import socket

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import MemoryConfig, ModelConfig
from memtrain.model import build
from memtrain.model.anchor import anchor_dims
from memtrain.model.hierarchical.layout import MemoryLayout, _trunc_normal
from memtrain.parallel.bank import MemoryBank
from memtrain.parallel.sharded_bank import ShardedMemoryBank

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=24)
K, SEED = 3, 5
STEPS, ACCUM, MB, T = 4, 2, 2, 12
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
# The clip threshold per step: it bites on steps 1 and 3, not on 0 and 2. The bank's norms are 0.22-0.38 here
# (torch 2.11 and 2.14, whose model initialisations differ); one threshold of 0.3 inside that range clipped
# some steps under 2.14 and none at world 3 under 2.11, so the thresholds sit about 3x beyond it on either side.
CLIP = (1.0, 0.1, 1.0, 0.1)


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


def clip_coef(norm: float, step: int) -> float:
    return min(1.0, CLIP[step] / (norm + 1e-6))


# Synthetic runs (no model): a quadratic loss on the fetched rows, whose gradient depends on the values
# served (a stale row would show), and skewed ids over 27 leaves (high leaves are rarely fetched, so
# their rows stay stale for many steps in deferred mode). Level 2 has no table (r = 0).
SYN = MemoryConfig(type="ffn", levels=[2, 0, 1])
SYN_STEPS, SYN_SAVE, SYN_CLIP = 12, 5, 10.0  # clipping bites on some steps


def syn_layout() -> MemoryLayout:
    return MemoryLayout.build(SYN, anchor_dims(TINY), K)


def syn_lr(step: int) -> float:
    return 1e-2 / (1 + 0.3 * step)  # a different lr every step


def syn_clip(norm: float) -> float:
    return min(1.0, SYN_CLIP / (norm + 1e-6))


def syn_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + micro)
    leaf = (torch.rand(MB, generator=g) ** 3 * K ** 3).long()
    generic = torch.rand(MB, generator=g) < 0.2
    if (step, rank, micro) == (2, 1, 0):
        generic[:] = True
    return torch.stack([leaf // K ** 2, leaf // K, leaf], 1), generic


def syn_targets(layout: MemoryLayout) -> list:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(layout.block_size(l), generator=g) * 0.1 if layout.levels[l] else None
            for l in range(layout.depth)]


def syn_loss(memory, targets):
    terms = [((rows.float() - t) ** 2).sum() for rows, t in zip(memory.levels, targets) if rows is not None]
    return sum(terms) / ACCUM if terms else None


def _stalest(bank) -> int:
    return bank._step - min(int(t.min()) for t in bank.last_step if t is not None and t.numel())


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
        bank.scale_gradients(clip_coef(norms[-1], step))
        bank.step(lr_at(step))
    return bank, norms


def _byte_run(levels, branching, leaves, rank, dtype=torch.float32):
    """One step fetching ``leaves`` (same on every rank, shifted by rank) -> (this rank's bytes, zero3)."""
    lay = MemoryLayout.build(MemoryConfig(type="ffn", levels=list(levels)), anchor_dims(TINY), branching)
    bank = ShardedMemoryBank(lay, seed=SEED, dtype=dtype)
    bank.build_optimizer(1e-2, BETAS, EPS, WD)
    leaf = torch.tensor(leaves) + rank
    ids = torch.stack([leaf // K, leaf], 1)  # level-1 ids in [0, 3), level-2 in [0, 9) for leaves < 8
    mem = bank.fetch(ids)
    fetch_bytes = list(bank._bytes)
    sum(r.float().sum() for r in mem.levels if r is not None).backward()
    bank.reduce_gradients()
    bank.step(1e-2)
    stats = bank.stats()
    return {"bytes": bank.comm_bytes(), "zero3": bank.zero3_reference_bytes(), "fetch": fetch_bytes,
            "dtype": mem.levels[0].dtype, "stats": {k: v for k, v in stats.items() if k.startswith("comm/")}}


def _train_syn(rank: int, mode: str, dtype=torch.float32, offload: bool = False, round_trip: bool = False):
    """The synthetic run on this rank; ``round_trip``: state_dict() after step SYN_SAVE, loaded into a
    fresh bank (other seed) that continues. Returns the gathered bank and what the tests check."""
    lay, targets = syn_layout(), syn_targets(syn_layout())
    wd = 0.0 if mode == "lazy" else WD

    def make(seed):
        b = ShardedMemoryBank(lay, seed=seed, mode=mode, dtype=dtype, compute_dtype=torch.float32, offload=offload)
        b.build_optimizer(syn_lr(0), BETAS, EPS, wd)
        return b

    bank = make(SEED)
    norms, stalest, saved_last = [], 0, None
    for step in range(SYN_STEPS):
        for micro in range(ACCUM):
            ids, generic = syn_batch(step, rank, micro)
            loss = syn_loss(bank.fetch(ids, generic), targets)
            if loss is not None:
                loss.backward()
        bank.reduce_gradients()
        norms.append(bank.grad_norm())
        bank.scale_gradients(syn_clip(norms[-1]))
        bank.step(syn_lr(step))
        stalest = max(stalest, _stalest(bank))
        if round_trip and step == SYN_SAVE:
            state = bank.state_dict()
            saved_last = {k: v["last_step"] for k, v in state["levels_state"].items()}
            bank = make(SEED + 1)
            bank.load_state_dict(state)
    stats = bank.stats()  # norms of the up-to-date bank
    full = bank.gather_full_state()
    return {"tables": full["tables"], "exp_avg": full["exp_avg"], "exp_avg_sq": full["exp_avg_sq"],
            "norms": norms, "stalest": stalest, "saved_last": saved_last, "lrs_left": len(bank._lrs),
            "param_norms": {k: v for k, v in stats.items() if "param_norm" in k},
            "last_step": {k: v["last_step"] for k, v in full["levels_state"].items()},
            "store": [str(t.device) for t in bank.parameters() + bank.exp_avg if t is not None]}


INIT_LAYOUTS = [MemoryConfig(type="ffn", levels=[2, 0, 1], placement="early", placement_layers=2),
                MemoryConfig(type="lora", lora_target="ffn", levels=[1, 2]),
                MemoryConfig(type="lora", lora_target="qk", levels=[3])]


def _init_rows() -> list[dict]:
    """This rank's initial rows, drawn 2 rows at a time, for each INIT_LAYOUTS entry and storage dtype."""
    out = []
    for cfg in INIT_LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            bank = ShardedMemoryBank(MemoryLayout.build(cfg, anchor_dims(TINY), K), seed=SEED, dtype=dtype,
                                     init_chunk_rows=2)
            out.append({l: (bank.owned[l], bank.shards[l]) for l in range(bank.layout.depth)
                        if bank.shards[l] is not None})
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, extras: bool):
    import torch.distributed as dist

    torch.set_num_threads(1)
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = make_model()
        result = {}
        bank, norms = _train_sharded(model, "dense", rank)
        full = bank.gather_full_state()
        result["dense"] = {"tables": full["tables"], "exp_avg": full["exp_avg"], "norms": norms,
                           "state": full, "step": full["step"], "stats": bank.stats()}
        result["init"] = _init_rows()
        result["syn"] = {"dense": _train_syn(rank, "dense"), "deferred": _train_syn(rank, "deferred", round_trip=True)}
        if extras:
            for mode in ("lazy", "dense", "deferred"):
                result["syn"][f"{mode}_offload"] = _train_syn(rank, mode, offload=True, round_trip=mode == "deferred")
            result["syn"]["lazy"] = _train_syn(rank, "lazy")
            bank, norms = _train_sharded(model, "lazy", rank)
            result["lazy"] = {"tables": bank.gather_full_state()["tables"], "norms": norms}
            result["bytes"] = {
                "few_small": _byte_run((2, 3), K, [0, 4], rank),
                "few_big": _byte_run((2, 3), 2 * K, [0, 4], rank),  # 2x level-1 rows, 4x level-2 rows
                "many_small": _byte_run((2, 3), K, [0, 1, 3, 4, 6, 7], rank),
                "few_small_bf16": _byte_run((2, 3), K, [0, 4], rank, torch.bfloat16),
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
        bank.scale_gradients(clip_coef(norms[-1], step))
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
        bank.scale_gradients(clip_coef(norms[-1], step))
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
    coefs = [clip_coef(norm, step) for step, norm in enumerate(ref_norms)]
    assert [c < 1 for c in coefs] == [False, True, False, True], coefs
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
    assert {k: v for k, v in s_bank.items() if not k.startswith("comm/")} == pytest.approx(
        {k: v for k, v in s_ref.items() if not k.startswith("comm/")})
    assert s_ref["comm/bank_bytes_sent"] == s_ref["comm/bank_bytes_received"] == 0.0  # a world of one


def test_bf16_model_row_gradients_are_summed_over_sequences_in_fp32():
    """Under a bf16 model the rows reach the model in bf16, but a row several sequences share gets their
    gradients summed in fp32, as the replicated bank (fp32 rows, the model's cast after the expansion) sums
    them: the two banks' gradients agree to fp32 rounding. The cast came before the expansion until
    2026-11-30, which summed in bf16 (1.7e-3 relative off on the shared level, exact on the other)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, ffn_dim=96, max_seq_len=64)
    model = build(cfg, MemoryConfig(type="ffn", levels=[4, 2]), 4).to(torch.bfloat16)
    x = torch.randint(0, 97, (16, 32), generator=torch.Generator().manual_seed(1))
    leaf = torch.arange(16)
    ids = torch.stack([leaf // 4, leaf], 1)  # level 1: four sequences per row; level 2: one
    ref = MemoryBank(model.memory_layout, seed=SEED)
    bank = ShardedMemoryBank(model.memory_layout, seed=SEED, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        for table, shard in zip(ref.tables, bank.shards):
            table.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
            shard.copy_(table)
    model(x, memory=ref.fetch(ids)).logits.float().square().mean().backward()
    fetched = bank.fetch(ids)
    assert all(level.dtype == torch.bfloat16 for level in fetched.levels)
    model.zero_grad()
    model(x, memory=fetched).logits.float().square().mean().backward()
    bank.reduce_gradients()
    for level, table in enumerate(ref.tables):
        rows, grad = bank.grads[level]
        dense = torch.zeros_like(table.grad)
        dense[rows] = grad
        assert float((dense - table.grad).norm() / table.grad.norm()) < 1e-5, level


# --------------------------------------------------------------------------------------------------
# Deferred mode, bf16 storage, CPU offload, chunked initialisation


def reference_syn(world: int):
    """The synthetic run on one process: MemoryBank + torch.optim.AdamW on the global batch."""
    lay = syn_layout()
    targets = syn_targets(lay)
    bank = MemoryBank(lay, seed=SEED)
    bank.build_optimizer(syn_lr(0), BETAS, EPS, WD)
    norms = []
    for step in range(SYN_STEPS):
        for rank in range(world):
            for micro in range(ACCUM):
                loss = syn_loss(bank.fetch(*syn_batch(step, rank, micro)), targets)
                if loss is not None:
                    (loss / world).backward()
        for t in bank.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        norms.append(bank.grad_norm())
        bank.scale_gradients(syn_clip(norms[-1]))
        bank.step(syn_lr(step))
    return bank, norms


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_deferred_equals_dense_with_stale_rows_and_a_state_round_trip(runs, world):
    """Deferred mode (rows replayed only when read, written or saved) gives dense AdamW's bank: rows
    left stale for the whole run, weight decay, a new lr every step, clipping, a state_dict() /
    load_state_dict() round trip mid-run. Dense itself matches MemoryBank + torch AdamW."""
    ref, ref_norms = reference_syn(world)
    assert min(map(syn_clip, ref_norms)) < 1 == max(map(syn_clip, ref_norms))
    for res in runs(world):
        dense, deferred = res["syn"]["dense"], res["syn"]["deferred"]
        assert deferred["stalest"] == SYN_STEPS - SYN_SAVE - 1  # some rows untouched since the reload
        assert dense["stalest"] == 0
        for name in ("tables", "exp_avg", "exp_avg_sq"):
            diff = _max_diff(deferred[name], dense[name])
            assert diff <= 1e-7, (name, diff)
        assert deferred["norms"] == pytest.approx(dense["norms"], rel=1e-7, abs=0)
        assert deferred["param_norms"] == pytest.approx(dense["param_norms"], rel=1e-7, abs=0)
        assert all(bool((v == SYN_SAVE + 1).all()) for v in deferred["saved_last"].values())  # saved current
        assert all(bool((v == SYN_STEPS).all()) for v in deferred["last_step"].values())
        assert deferred["lrs_left"] == 0
        for level, table in enumerate(ref.tables):
            if table is not None:
                torch.testing.assert_close(deferred["tables"][str(level)], table.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(deferred["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert deferred["param_norms"] == pytest.approx(
            {k: v for k, v in ref.stats().items() if "param_norm" in k}, rel=1e-5)


def test_offload_equals_the_resident_bank_in_every_mode(runs):
    for res in runs(2):
        syn = res["syn"]
        for mode in ("dense", "deferred", "lazy"):
            on, off = syn[f"{mode}_offload"], syn[mode]
            assert set(on["store"]) == {"cpu"}
            for name in ("tables", "exp_avg", "exp_avg_sq"):
                assert all(torch.equal(on[name][k], off[name][k]) for k in off[name]), (mode, name)
            assert on["norms"] == off["norms"]
        assert _max_diff(syn["lazy"]["tables"], syn["dense"]["tables"]) > 1e-4  # the modes differ


@pytest.mark.parametrize("world", [2, 3])
def test_initial_rows_are_memory_banks_drawn_in_chunks(runs, world):
    """Every rank draws MemoryBank's values, bitwise (fp32 and bf16 storage, ffn and LoRA layouts with
    several layers and parts), 2 rows at a time, keeping its own rows."""
    results = runs(world)
    for i, (cfg, dtype) in enumerate((c, d) for c in INIT_LAYOUTS for d in (torch.float32, torch.bfloat16)):
        ref = MemoryBank(MemoryLayout.build(cfg, anchor_dims(TINY), K), seed=SEED, dtype=dtype)
        for level, table in enumerate(ref.tables):
            if table is None:
                continue
            ids = torch.cat([res["init"][i][level][0] for res in results])
            assert torch.equal(ids.sort().values, torch.arange(table.shape[0]))
            for res in results:
                owned, rows = res["init"][i][level]
                assert rows.dtype == dtype and torch.equal(rows, table.detach()[owned]), (cfg, dtype, level)
        assert any(bool(t.abs().sum() > 0) for t in ref.parameters())


def test_chunked_draws_consume_the_generator_like_one_draw():
    """What chunked initialisation relies on: on a CPU generator, torch.rand and the truncated normal of
    shape [a + b, ...] equal the [a, ...] draw followed by the [b, ...] draw (and leave the generator
    in the same state); init_rows with row_ids gives the full table's rows."""
    for shape in [(7, 3, 5), (29, 2, 33), (64, 1, 96), (5, 16, 1)]:
        for a in {0, 1, 3, shape[0] // 2, shape[0] - 1}:
            for draw in (lambda s, g: torch.rand(s, generator=g),
                         lambda s, g: _trunc_normal(s, 0.02, torch.float32, "cpu", g)):
                g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
                whole = draw(shape, g1)
                parts = torch.cat([draw((a, *shape[1:]), g2), draw((shape[0] - a, *shape[1:]), g2)])
                assert torch.equal(whole, parts) and torch.equal(g1.get_state(), g2.get_state()), (shape, a)
    lay = MemoryLayout.build(INIT_LAYOUTS[1], anchor_dims(TINY), K)
    full = torch.empty(lay.rows(1), lay.block_size(1))
    lay.init_rows(full, 1, torch.Generator().manual_seed(4))
    ids = torch.tensor([0, 2, 3, 7, 8])
    some = torch.empty(len(ids), lay.block_size(1))
    lay.init_rows(some, 1, torch.Generator().manual_seed(4), row_ids=ids, n_rows=lay.rows(1), chunk_rows=3)
    assert torch.equal(some, full[ids])


def _train_world_one(bank, steps: int, clip: bool = True):
    """The synthetic run's rank-0 batches on a world of one."""
    targets = syn_targets(bank.layout)
    for step in range(steps):
        for micro in range(ACCUM):
            loss = syn_loss(bank.fetch(*syn_batch(step, 0, micro)), targets)
            if loss is not None:
                loss.backward()
        bank.reduce_gradients()
        if clip:
            bank.scale_gradients(syn_clip(bank.grad_norm()))
        bank.step(syn_lr(step))


@pytest.mark.parametrize("mode", ["dense", "deferred"])
def test_bf16_bank_is_fp32_math_rounded_to_bf16_every_step(mode):
    """bf16 rows, fp32 moments: each step is torch AdamW in fp32 on the upcast rows, then rounded to
    bf16 (reference: MemoryBank's fp32 tables started from the bf16 initial rows, rounded after every
    step). World of one, no clipping (MemoryBank's norm is computed differently), so bitwise."""
    lay = syn_layout()
    bank = ShardedMemoryBank(lay, seed=SEED, mode=mode, dtype=torch.bfloat16, compute_dtype=torch.float32)
    bank.build_optimizer(syn_lr(0), BETAS, EPS, WD)
    ref = MemoryBank(lay, seed=SEED)
    init = MemoryBank(lay, seed=SEED, dtype=torch.bfloat16)
    with torch.no_grad():
        for t, b in zip(ref.parameters(), init.parameters()):
            t.copy_(b.float())
    ref.build_optimizer(syn_lr(0), BETAS, EPS, WD)
    targets = syn_targets(lay)
    for step in range(SYN_STEPS):
        for micro in range(ACCUM):
            for b in (bank, ref):
                loss = syn_loss(b.fetch(*syn_batch(step, 0, micro)), targets)
                if loss is not None:
                    loss.backward()
        for t in ref.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        bank.step(syn_lr(step))
        ref.step(syn_lr(step))
        with torch.no_grad():
            for t in ref.parameters():
                t.copy_(t.bfloat16().float())
    bank.catch_up()
    for level, table in enumerate(ref.tables):
        if table is not None:
            assert bank.shards[level].dtype == torch.bfloat16 and bank.exp_avg[level].dtype == torch.float32
            assert torch.equal(bank.shards[level].float(), table.detach()), float(
                (bank.shards[level].float() - table.detach()).abs().max())
            assert torch.equal(bank.exp_avg_sq[level], ref.optimizer.state[table]["exp_avg_sq"])
    fp32 = ShardedMemoryBank(lay, seed=SEED, mode=mode)  # rounding matters: fp32 storage ends elsewhere
    fp32.build_optimizer(syn_lr(0), BETAS, EPS, WD)
    _train_world_one(fp32, SYN_STEPS, clip=False)
    assert not torch.equal(fp32.shards[0].bfloat16(), bank.shards[0])
    mem = bank.fetch(torch.tensor([[0, 1, 2]]))  # compute_dtype fp32
    assert mem.levels[0].dtype == torch.float32
    assert ShardedMemoryBank(lay, dtype=torch.bfloat16).fetch(torch.tensor([[0, 1, 2]])).levels[0].dtype == \
        torch.bfloat16


def test_bf16_fetch_moves_half_the_row_bytes(runs):
    """The same ids as few_small: rows cross in bf16 (half the bytes), ids, split sizes and the fp32
    gradients unchanged."""
    s1 = 4 * make_model().memory_layout.block_size(0)
    for res in runs(2):
        fp32, bf16 = res["bytes"]["few_small"], res["bytes"]["few_small_bf16"]
        assert fp32["fetch"] == [2 * 8 + 8 + s1] * 2 and bf16["fetch"] == [2 * 8 + 8 + s1 // 2] * 2
        assert bf16["dtype"] == torch.bfloat16
        assert bf16["bytes"]["sent"] == fp32["bytes"]["sent"] - s1 // 2
        assert bf16["zero3"] == fp32["zero3"] * 8 // 12  # (2 e + 4) P bytes per micro-batch and (W-1)/W


def test_catch_up_state_dict_and_dtypes():
    """catch_up() brings every stale row current (then equal to a dense bank); state_dict() carries
    last_step and loads across storage dtypes; only float32 and bfloat16 storage is accepted."""
    lay = syn_layout()
    banks = {}
    for mode in ("dense", "deferred"):
        banks[mode] = ShardedMemoryBank(lay, seed=SEED, mode=mode)
        banks[mode].build_optimizer(syn_lr(0), BETAS, EPS, WD)
        _train_world_one(banks[mode], 6)
    deferred, dense = banks["deferred"], banks["dense"]
    assert _stalest(deferred) >= 3 and len(deferred._lrs) >= 3
    assert not torch.equal(deferred.shards[2], dense.shards[2])  # stale rows not yet replayed
    deferred.catch_up()
    assert all(bool((t == 6).all()) for t in deferred.last_step if t is not None) and deferred._lrs == []
    for a, b in zip(deferred.parameters(), dense.parameters()):
        assert float((a - b).abs().max()) <= 1e-7
    state = deferred.state_dict()
    assert set(state["levels_state"]) == {"0", "2"} and state["levels_state"]["2"]["last_step"].tolist() == [6] * 27
    bf16 = ShardedMemoryBank(lay, seed=1, mode="deferred", dtype=torch.bfloat16)
    bf16.build_optimizer(syn_lr(0), BETAS, EPS, WD)
    bf16.load_state_dict(state)  # fp32 -> bf16: rows rounded, moments fp32
    assert bf16._step == 6 and torch.equal(bf16.shards[0], deferred.shards[0].bfloat16())
    assert torch.equal(bf16.exp_avg[0], deferred.exp_avg[0])
    back = ShardedMemoryBank(lay, seed=1, offload=True)
    back.load_state_dict(bf16.state_dict())  # bf16 -> fp32
    assert back.shards[0].dtype == torch.float32 and torch.equal(back.shards[0], bf16.shards[0].float())
    stale = {**state, "levels_state": {k: {**v, "last_step": v["last_step"] - 1} for k, v in
                                       state["levels_state"].items()}}
    with pytest.raises(ValueError, match="not caught up"):
        back.load_state_dict(stale)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        ShardedMemoryBank(lay, dtype=torch.float16)
    with pytest.raises(ValueError, match="mode must be one of"):
        ShardedMemoryBank(lay, mode="sparse")
    bank = ShardedMemoryBank(lay, dtype=torch.bfloat16)
    bank.world = 4
    assert bank.zero3_reference_bytes(micro_batches=2) == 2 * 3 * lay.bank_parameters * (2 * 2 + 4) // 4
