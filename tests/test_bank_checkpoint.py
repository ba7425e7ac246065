"""The memory bank's DCP checkpoint (memtrain.parallel.bank_checkpoint through checkpoint.save_bank /
load_bank / read_bank_state) on CPU with gloo: a sharded bank saved on 2 ranks loads on 3 ranks, on 1
rank and into the replicated MemoryBank with every row, moment and the step bit-exact, and training
continues on the same trajectory; the owner map is saved; a replicated save loads into a sharded bank;
legacy torch.save files still load; layout mismatches and damaged folders raise CheckpointError."""

from __future__ import annotations

import functools
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memtrain.config import MemoryConfig, ModelConfig
from memtrain.errors import CheckpointError
from memtrain.model import build
from memtrain.parallel import checkpoint as ckpt
from memtrain.parallel.bank import MemoryBank
from memtrain.parallel.sharded_bank import ShardedMemoryBank

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=24)
SEED = 5
STEPS, MORE, G, T = 3, 2, 6, 12  # G sequences per step: an equal split over 1, 2 and 3 ranks
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def lr_at(step: int) -> float:
    return 1e-2 * (1 - 0.1 * step)


@functools.lru_cache(maxsize=None)
def make_model(k: int):
    torch.manual_seed(0)
    model = build(TINY, MemoryConfig(type="ffn", levels=[2, 3]), branching=k)
    for p in model.parameters():  # only the bank trains
        p.requires_grad_(False)
    return model


def global_batch(step: int, k: int):
    g = torch.Generator().manual_seed(100 * step + k)
    x = torch.randint(0, TINY.vocab_size, (G, T), generator=g)
    leaf = torch.randint(0, k * k, (G,), generator=g)
    return x, torch.stack([leaf // k, leaf], 1)


def lm_loss(model, x, memory):
    logits = model(x, memory=memory).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def train(bank, k: int, start: int, steps: int, world: int = 1, rank: int = 0):
    """``steps`` steps from ``start``: each rank takes its equal part of the global batch (the sharded
    bank averages over ranks, so every world size follows the same trajectory)."""
    model = make_model(k)
    for step in range(start, start + steps):
        x, ids = global_batch(step, k)
        part = slice(rank * G // world, (rank + 1) * G // world)
        lm_loss(model, x[part], bank.fetch(ids[part])).backward()
        bank.step(lr_at(step))
    return bank


def sharded(k: int, **kw) -> ShardedMemoryBank:
    bank = ShardedMemoryBank(make_model(k).memory_layout, seed=kw.pop("seed", SEED), **kw)
    bank.build_optimizer(lr_at(0), BETAS, EPS, WD)
    return bank


def replicated(k: int, optimizer: bool = True, seed: int = SEED, **kw) -> MemoryBank:
    bank = MemoryBank(make_model(k).memory_layout, seed=seed, **kw)
    if optimizer:
        bank.build_optimizer(lr_at(0), BETAS, EPS, WD)
    return bank


def owners(bank) -> dict[str, torch.Tensor]:
    return {str(l): torch.as_tensor(bank.owner(l, torch.arange(bank.layout.rows(l)))).to(torch.int32)
            for l in range(bank.layout.depth)}


def replicated_full(bank: MemoryBank) -> dict:
    """A MemoryBank as gather_full_state's keys (tables, moments, step)."""
    opt = bank.optimizer.state_dict()["state"] if bank.optimizer is not None else {}
    return {"tables": {str(l): t.detach().clone() for l, t in enumerate(bank.tables)},
            "exp_avg": {str(l): opt[l]["exp_avg"].clone() for l in range(len(bank.tables)) if l in opt},
            "exp_avg_sq": {str(l): opt[l]["exp_avg_sq"].clone() for l in range(len(bank.tables)) if l in opt},
            "step": int(opt[0]["step"]) if opt else 0}


def assert_same(got: dict, want: dict, moments: bool = True):
    """Bit-exact rows (and moments, step)."""
    for key in ("tables", "exp_avg", "exp_avg_sq") if moments else ("tables",):
        assert set(got[key]) == set(want[key])
        for level, t in want[key].items():
            assert torch.equal(got[key][level], t), (key, level)
    if moments:
        assert got["step"] == want["step"]


def assert_close_tables(got: dict, want: dict):
    for level, t in want.items():
        torch.testing.assert_close(got[level], t, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Worker processes (2 ranks save, 3 ranks load)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save(rank: int, root: Path, group) -> dict:
    """Ranks 0 and 1 of ``group`` (a 2-rank subgroup: the bank's own group, not the default one)."""
    import torch.distributed as dist

    world, out = 2, {}
    bank = train(sharded(3, group=group), 3, 0, STEPS, world, rank)  # round robin
    out["rr_full"] = bank.gather_full_state()
    ckpt.save_bank(bank, root / "rr", rank)
    dist.barrier(group=group)  # as checkpoint.save before COMPLETE.json
    torch.save(bank.state_dict(), root / "legacy" / f"memory_bank_rank{rank:05d}.pt")  # the old code path
    out["rr_cont"] = train(bank, 3, STEPS, MORE, world, rank).gather_full_state()
    aff = train(sharded(2, group=group, subtree_ranks=[[0], [1]]), 2, 0, STEPS, world, rank)  # affine, k = 2
    out["aff_full"], out["aff_owner"] = aff.gather_full_state(), owners(aff)
    ckpt.save_bank(aff, root / "aff", rank)
    dist.barrier(group=group)
    rep = sharded(3, seed=99, group=group)  # a replicated (MemoryBank) save loads into the sharded bank
    ckpt.load_bank(rep, root / "rep")
    out["rep_loaded"] = rep.gather_full_state()
    out["rep_loaded_cont"] = train(rep, 3, STEPS, MORE, world, rank).gather_full_state()
    return out


def _load(rank: int, root: Path) -> dict:
    """All 3 ranks, default group."""
    world, out = 3, {}
    bank = sharded(3, seed=99)
    ckpt.load_bank(bank, root / "rr")
    out["rr_loaded"] = bank.gather_full_state()
    out["rr_loaded_cont"] = train(bank, 3, STEPS, MORE, world, rank).gather_full_state()
    rr = sharded(2, seed=99)  # the affine save, round robin on 3 ranks (empty canonical blocks on rank 2)
    ckpt.load_bank(rr, root / "aff")
    out["aff_loaded"] = rr.gather_full_state()
    aff = sharded(2, seed=99, subtree_ranks=[[1], [2]])  # another affine map: rank 0 owns no row
    ckpt.load_bank(aff, root / "aff")
    out["aff_loaded_affine"] = aff.gather_full_state()
    return out


def _worker(rank: int, world: int, port: int, d: str):
    """One spawn of 3 processes (process start-up dominates the runtime): ranks 0-1 train and save on
    a 2-rank subgroup, then all 3 load."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        root = Path(d)
        pair = dist.new_group([0, 1])
        out = _save(rank, root, pair) if rank < 2 else {}
        dist.barrier()
        out.update(_load(rank, root))
        if rank == 0:
            torch.save(out, root / "out.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("bank_ckpt")
    for name in ("legacy", "rr", "aff", "rep"):
        (root / name).mkdir()
    rep = train(replicated(3), 3, 0, STEPS)  # the replicated bank, single process, same global batches
    ckpt.save_bank(rep, root / "rep", 0)
    rep_full = replicated_full(rep)
    rep_cont = replicated_full(train(rep, 3, STEPS, MORE))
    mp.spawn(_worker, args=(3, _free_port(), str(root)), nprocs=3, join=True)
    return {"root": root, "rep_full": rep_full, "rep_cont": rep_cont,
            **torch.load(root / "out.pt", weights_only=False)}


# --------------------------------------------------------------------------------------------------
# Tests


def test_on_disk_layout(runs):
    folder = runs["root"] / "rr" / "memory_bank"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "bank.json"]
    meta = json.loads((folder / "bank.json").read_text())
    assert meta["format"] == "memtrain.bank.dcp/v1" and meta["kind"] == "sharded" and meta["world_size"] == 2
    assert (meta["step"], meta["levels"], meta["branching"], meta["moments"]) == (STEPS, [2, 3], 3, True)
    state = ckpt.read_bank_state(runs["root"] / "rr")  # one process, no process group
    assert_same(state, runs["rr_full"])
    for level, owner in state["owner"].items():  # round robin at save time
        assert owner.dtype == torch.int32
        assert torch.equal(owner, torch.arange(len(owner), dtype=torch.int32) % 2)


def test_sharded_save_loads_on_three_ranks_and_continues(runs):
    assert_same(runs["rr_loaded"], runs["rr_full"])
    assert_close_tables(runs["rr_loaded_cont"]["tables"], runs["rr_cont"]["tables"])
    assert runs["rr_loaded_cont"]["step"] == STEPS + MORE
    # and the 2-rank sharded trajectory is the replicated torch AdamW one
    assert_close_tables(runs["rr_cont"]["tables"], runs["rep_cont"]["tables"])


def test_sharded_save_loads_on_one_rank_and_continues(runs):
    bank = sharded(3, seed=99)  # no process group at all
    ckpt.load_bank(bank, runs["root"] / "rr")
    assert_same(bank.gather_full_state(), runs["rr_full"])
    assert_close_tables(train(bank, 3, STEPS, MORE).gather_full_state()["tables"], runs["rr_cont"]["tables"])


def test_sharded_save_loads_into_memory_bank(runs):
    bank = replicated(3, seed=99)
    ckpt.load_bank(bank, runs["root"] / "rr")
    assert_same(replicated_full(bank), runs["rr_full"])
    cont = replicated_full(train(bank, 3, STEPS, MORE))
    assert_close_tables(cont["tables"], runs["rr_cont"]["tables"])
    assert cont["step"] == STEPS + MORE
    evaluation = replicated(3, optimizer=False, seed=99)  # rows only, as memtrain eval loads it
    ckpt.load_bank(evaluation, runs["root"] / "rr")
    assert_same(replicated_full(evaluation), runs["rr_full"], moments=False)


def test_affine_owner_map_is_saved_and_reshards(runs):
    state = ckpt.read_bank_state(runs["root"] / "aff")
    assert set(state["owner"]) == set(runs["aff_owner"]) == {"0", "1"}
    for level, owner in runs["aff_owner"].items():
        assert torch.equal(state["owner"][level], owner)
    assert not torch.equal(state["owner"]["1"], torch.arange(4, dtype=torch.int32) % 2)  # not round robin
    assert_same(state, runs["aff_full"])
    assert_same(runs["aff_loaded"], runs["aff_full"])
    assert_same(runs["aff_loaded_affine"], runs["aff_full"])


def test_replicated_save_loads_into_sharded_bank_on_two_ranks(runs):
    assert_same(runs["rep_loaded"], runs["rep_full"])
    assert_close_tables(runs["rep_loaded_cont"]["tables"], runs["rep_cont"]["tables"])
    assert_close_tables(runs["rep_cont"]["tables"], runs["rr_cont"]["tables"])
    state = ckpt.read_bank_state(runs["root"] / "rep")
    assert json.loads((runs["root"] / "rep" / "memory_bank" / "bank.json").read_text())["kind"] == "replicated"
    assert all(bool((o == -1).all()) for o in state["owner"].values())


def test_legacy_bank_files_still_load(runs, tmp_path):
    legacy = runs["root"] / "legacy"  # memory_bank_rank0000{0,1}.pt from the 2-rank run
    for bank in (sharded(3, seed=99), replicated(3, seed=99)):
        ckpt.load_bank(bank, legacy)
        got = bank.gather_full_state() if hasattr(bank, "owner") else replicated_full(bank)
        assert_same(got, runs["rr_full"])
    assert_same(ckpt.read_bank_state(legacy), runs["rr_full"])
    rep = train(replicated(3), 3, 0, STEPS)
    torch.save(rep.state_dict(), tmp_path / "memory_bank.pt")  # the old replicated form
    for bank in (sharded(3, seed=99), replicated(3, seed=99)):
        ckpt.load_bank(bank, tmp_path)
        got = bank.gather_full_state() if hasattr(bank, "owner") else replicated_full(bank)
        assert_same(got, replicated_full(rep))


def test_layout_mismatch_is_one_clear_error(runs):
    path = runs["root"] / "rr"
    other = build(TINY, MemoryConfig(type="ffn", levels=[2, 4]), branching=3).memory_layout
    with pytest.raises(CheckpointError, match=r"saved with levels \[2, 3\] but this run's bank has \[2, 4\]; "
                                              r"set memory.levels"):
        ckpt.load_bank(MemoryBank(other), path)
    with pytest.raises(CheckpointError, match=r"saved with branching 3 but this run's bank has 2"):
        ckpt.load_bank(sharded(2), path)
    small = ModelConfig(vocab_size=97, d_model=16, n_layers=3, n_heads=4, ffn_dim=24, max_seq_len=24)
    narrow = build(small, MemoryConfig(type="ffn", levels=[2, 3]), branching=3).memory_layout
    with pytest.raises(CheckpointError, match="saved with block sizes") as e:
        ckpt.load_bank(ShardedMemoryBank(narrow), path)
    assert "\n" not in str(e.value)


def _saved_copy(tmp_path: Path) -> Path:
    path = tmp_path / "global_step3"
    path.mkdir()
    ckpt.save_bank(train(replicated(3), 3, 0, 1), path, 0)
    return path


def test_missing_or_damaged_bank_folder(tmp_path):
    empty = tmp_path / "global_step1"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"has no memory bank \(memory_bank/"):
        ckpt.load_bank(replicated(3), empty)
    path = _saved_copy(tmp_path)
    folder = path / "memory_bank"
    hint = r"delete .*global_step3/COMPLETE.json to fall back to the previous checkpoint"
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"memory_bank is damaged or incomplete \(.*\); " + hint):
        ckpt.load_bank(replicated(3), path)
    with pytest.raises(CheckpointError, match=hint):
        ckpt.read_bank_state(path)
    (folder / "bank.json").unlink()  # the save did not finish
    with pytest.raises(CheckpointError, match=r"no bank.json: the save did not finish\); " + hint):
        ckpt.load_bank(sharded(3), path)
    shutil.rmtree(folder)
    folder.mkdir()  # an empty folder left by a killed run
    with pytest.raises(CheckpointError, match=hint):
        ckpt.load_bank(replicated(3), path)


def test_resave_same_step_replaces_the_folder_and_keeps_bf16_rows(tmp_path):
    path = _saved_copy(tmp_path)
    (path / "memory_bank" / "__7_0.distcp").write_bytes(b"stale")  # a leftover of a larger world
    bank = replicated(3, optimizer=False, dtype=torch.bfloat16)
    ckpt.save_bank(bank, path, 0)
    assert sorted(p.name for p in (path / "memory_bank").iterdir()) == [".metadata", "__0_0.distcp", "bank.json"]
    meta = json.loads((path / "memory_bank" / "bank.json").read_text())
    assert (meta["rows_dtype"], meta["moments"], meta["step"]) == ("torch.bfloat16", False, 0)
    target = sharded(3, seed=99)  # fp32 rows: converted on load, moments left as they were
    ckpt.load_bank(target, path)
    for level, t in enumerate(bank.tables):
        assert torch.equal(target.shards[level], t.detach().float())
        assert not target.exp_avg[level].any()
    ckpt.save_bank(bank, path, 1)  # a replicated bank is written by rank 0 only
    assert ckpt.read_bank_state(path)["tables"]["0"].dtype == torch.bfloat16
