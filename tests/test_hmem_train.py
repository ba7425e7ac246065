"""Training with hierarchical memories end to end on CPU: exact resume (anchor, bank and its optimizer),
2 ranks equal 1, a frozen anchor initialised from another run's checkpoint stays frozen, monitoring
scalars, joint clipping, and `memtrain recipe show`'s memory sizes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from memtrain.config import RecipeError, load_recipe, recipe_from_dict
from memtrain.data.builtin import builtin_documents
from memtrain.data.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
K, P, SEQ = 2, 2, 32


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Prepared cluster-prefixed data and a memory recipe (FFN memories (4, 2), k=2, p=2)."""
    root = tmp_path_factory.mktemp("hmem")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::60]))
    recipe = {
        "run": {"name": "hmem", "seed": 11},
        "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64, "max_seq_len": SEQ},
        "memory": {"type": "ffn", "levels": [4, 2], "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 1e-3}},
        "data": {"dir": str(root / "data"), "sources": [str(src)], "seq_len": SEQ, "val_fraction": 0.05,
                 "tokenizer": {"vocab_size": 300, "model_type": "bpe"},
                 "clustering": {"enabled": True, "branching": K, "depth": P, "kmeans_samples": 256,
                                "embedding_batch_size": 64}},
        "train": {"max_steps": 6, "global_batch_tokens": 8 * SEQ, "micro_batch_size": 2, "grad_clip": 0.5,
                  "optimizer": {"lr": 3e-3}, "schedule": {"kind": "cosine", "warmup": 1, "min_lr": 3e-4},
                  "eval": {"every_steps": 3, "batches": 2}},
        "checkpoint": {"every_steps": 3, "keep_last": 3},
        "logging": {"every_steps": 1},
    }
    (root / "mem.yaml").write_text(yaml.safe_dump(recipe))
    prepare(load_recipe(root / "mem.yaml"))
    return root


def train(root: Path, run: str, *overrides: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    args = ["train", str(root / "mem.yaml"), f"run.dir={root / 'runs' / run}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "memtrain", *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(port), "-m", "memtrain", *args]
    out = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=900)
    if check:
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def metrics(root: Path, run: str) -> list[dict]:
    """The run's metrics.jsonl rows; each step once, in order (no rows left from an interrupted run)."""
    rows = [json.loads(line) for line in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"{run}: duplicated or out-of-order steps in metrics.jsonl: {steps}"
    return rows


def bank_tables(root: Path, run: str, step: int) -> dict:
    from memtrain.parallel.checkpoint import read_bank_state

    return read_bank_state(root / "runs" / run / "checkpoints" / f"global_step{step}")["tables"]


def module_state(root: Path, run: str, step: int) -> dict:
    path = root / "runs" / run / "checkpoints" / f"global_step{step}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=True)["module"]


def test_memory_run_resumes_exactly_and_logs_memory_scalars(root):
    train(root, "full")
    full = metrics(root, "full")
    assert [r["step"] for r in full] == list(range(1, 7))
    last = full[-1]
    for key in ("memory_module/rows_touched_frac/level1", "memory_module/rows_touched_frac/level2",
                "memory_module/rows_touched_frac/all", "memory_module/generic_rate", "memory_module/param_norm/level1",
                "memory_module/param_norm/level2", "memory_module/grad_norm", "loss/val_generic", "optim/memory_lr"):
        assert key in last, key
    assert 0 < last["memory_module/rows_touched_frac/level2"] <= 1
    assert last["loss/val"] != last["loss/val_generic"]
    # Interrupted after step 3 (the step-6 checkpoint removed, so the run resumes at 3): same trajectory,
    # same bank at the end (rows, and through them the restored AdamW moments and generic draws).
    train(root, "resumed", "train.max_steps=6")
    final = root / "runs" / "resumed" / "checkpoints" / "global_step6"
    shutil.rmtree(final)
    out = train(root, "resumed")
    assert "resuming from" in out.stdout
    assert [r["loss/train"] for r in metrics(root, "resumed")][-3:] == [r["loss/train"] for r in full][-3:]
    for level, table in bank_tables(root, "full", 6).items():
        assert torch.equal(table, bank_tables(root, "resumed", 6)[level])


def test_two_ranks_with_a_replicated_bank_equal_one(root):
    """Same global batch on 2 ranks (bank gradients averaged by all-reduce) and on 1: same losses and the
    same bank, with the generic memory drawn (per sample, so the same way on any world size)."""
    train(root, "one")
    train(root, "two", nproc=2)
    one, two = metrics(root, "one"), metrics(root, "two")
    tables = bank_tables(root, "one", 6)
    ring = 2 * (2 - 1) * sum(t.numel() * 4 for t in tables.values()) // 2  # the fp32 gradients' all-reduce
    for a, b in zip(one, two):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
        assert b["memory_module/rows_touched_frac/all"] == a["memory_module/rows_touched_frac/all"]
        # the replicated bank's traffic is counted (the sharded bank's was; this one's was not, until 2026-11-30)
        assert (a["comm/bank_bytes_sent"], b["comm/bank_bytes_sent"], b["comm/bank_bytes_received"]) == (0, ring, ring)
    for level, table in bank_tables(root, "one", 6).items():
        torch.testing.assert_close(bank_tables(root, "two", 6)[level], table, rtol=1e-4, atol=1e-6)


def test_frozen_anchor_from_a_pretrained_checkpoint(root):
    """Row A3: the anchor comes from another run's checkpoint (model.init_from) and stays frozen; the
    bank and the generic memory train."""
    train(root, "anchor", "memory.type=none", "memory.levels=[]")
    out = train(root, "frozen", f"model.init_from={root / 'runs' / 'anchor'}", "memory.freeze_anchor=true")
    assert "anchor initialised from" in out.stdout
    anchor = module_state(root, "anchor", 6)
    frozen = module_state(root, "frozen", 6)
    for name, value in anchor.items():
        assert torch.equal(frozen[name], value), name
    generic = [k for k in frozen if k.startswith("generic_memory.")]
    assert generic
    start = module_state(root, "frozen", 3)
    assert any(not torch.equal(start[k], frozen[k]) for k in generic)
    for level, table in bank_tables(root, "frozen", 6).items():
        assert not torch.equal(table, bank_tables(root, "frozen", 3)[level])
    bad = train(root, "bad", f"model.init_from={root / 'nowhere'}", check=False)
    assert bad.returncode == 2
    assert "nowhere" in bad.stderr and "Traceback" not in bad.stderr
    assert not (root / "runs" / "bad" / "checkpoints").exists()


def test_joint_clipping_scales_anchor_and_bank_by_their_global_norm():
    from types import SimpleNamespace

    from memtrain.launcher.train import clip_memory

    class Bank:
        def __init__(self, g):
            self.g = g

        def grad_norm(self):
            return float(self.g.norm())

        def scale_gradients(self, c):
            self.g.mul_(c)

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 0.0])
    bank = Bank(torch.tensor([0.0, 4.0]))
    recipe = recipe_from_dict({"data": {"clustering": {"enabled": True, "depth": 1}},
                               "memory": {"type": "ffn", "levels": [1]}, "train": {"grad_clip": 1.0}})
    norms = clip_memory(SimpleNamespace(module=torch.nn.ParameterList([p])), bank, recipe, joint=True)
    assert norms == {"total": 5.0, "bank": 4.0}
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 0.0]) / (5 + 1e-6))
    torch.testing.assert_close(bank.g, torch.tensor([0.0, 4.0]) / (5 + 1e-6))


def test_recipe_show_prints_the_paper_memory_sizes():
    out = subprocess.run([sys.executable, "-m", "memtrain", "recipe", "show", "recipes/hmem-160m-a3-frozen.yaml"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fetched memory parameters: 18063360" in out.stdout
    assert "memory bank parameters: 4624220160" in out.stdout


def _bank_state(root: Path, run: str, step: int) -> dict:
    from memtrain.parallel.checkpoint import read_bank_state

    return read_bank_state(root / "runs" / run / "checkpoints" / f"global_step{step}")


def test_sharded_bank_equals_replicated_and_resumes_on_another_world_size(root):
    """memory.bank sharded (rows on their owners, all-to-all fetch, owner AdamW) trains exactly like the
    replicated bank on 2 ranks; its per-rank shard files resume the run on 1 rank, as a sharded or as a
    replicated bank, continuing the same trajectory."""
    import shutil

    no_generic = "memory.generic_prob=0.0"
    train(root, "rep2", no_generic, nproc=2)
    train(root, "sh2", no_generic, "memory.bank=sharded", nproc=2)
    rep, sh = metrics(root, "rep2"), metrics(root, "sh2")
    for a, b in zip(rep, sh):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
    assert "comm/bank_bytes_sent" in sh[-1] and sh[-1]["comm/bank_zero3_bytes"] > 0
    shards = sorted(p.name for p in (root / "runs" / "sh2" / "checkpoints" / "global_step6").glob("memory_bank*"))
    assert shards == ["memory_bank"]  # a torch.distributed.checkpoint folder keyed by global row
    assert sorted(p.name for p in (root / "runs" / "sh2" / "checkpoints" / "global_step6" / "memory_bank").iterdir()
                  if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    for level, table in bank_tables(root, "rep2", 6).items():
        torch.testing.assert_close(_bank_state(root, "sh2", 6)["tables"][level], table, rtol=1e-4, atol=1e-6)
    for kind in ("sharded", "replicated"):
        run = f"sh2-to-1-{kind}"
        shutil.copytree(root / "runs" / "sh2", root / "runs" / run)
        shutil.rmtree(root / "runs" / run / "checkpoints" / "global_step6")
        out = train(root, run, no_generic, f"memory.bank={kind}")
        assert "resuming from" in out.stdout
        resumed = metrics(root, run)[-3:]
        for a, b in zip(sh[-3:], resumed):
            assert b["step"] == a["step"]
            assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
        for level, table in _bank_state(root, "sh2", 6)["tables"].items():
            torch.testing.assert_close(_bank_state(root, run, 6)["tables"][level], table, rtol=1e-4, atol=1e-6)


def test_sharded_bank_settings_need_the_sharded_bank():
    base = {"data": {"clustering": {"enabled": True, "depth": 1}}, "memory": {"type": "ffn", "levels": [1]}}
    with pytest.raises(RecipeError, match="memory.bank: sharded"):
        recipe_from_dict({**base, "memory": {**base["memory"], "bank_optimizer": "lazy"}})
    with pytest.raises(RecipeError, match="weight_decay"):
        recipe_from_dict({**base, "memory": {**base["memory"], "bank": "sharded", "bank_optimizer": "lazy"}})
    assert recipe_from_dict({**base, "memory": {**base["memory"], "bank": "sharded", "bank_optimizer": "lazy",
                                                  "optimizer": {"weight_decay": 0.0}}})
    for key, value in (("bank_optimizer", "deferred"), ("bank_dtype", "bf16"), ("bank_offload", True)):
        with pytest.raises(RecipeError, match=f"memory.{key}.*memory.bank: sharded"):
            recipe_from_dict({**base, "memory": {**base["memory"], key: value}})
        assert recipe_from_dict({**base, "memory": {**base["memory"], "bank": "sharded", key: value}})


def test_affine_sharded_bank_keeps_rows_on_the_ranks_that_read_them(root):
    """data.placement affine + memory.bank sharded: each rank reads one level-1 subtree (k = 2, 2 ranks)
    and owns that subtree's rows at every level, so no row or gradient crosses ranks (only the split
    sizes of the all-to-alls: 8 bytes per peer per exchange); training equals the replicated bank."""
    common = ("memory.generic_prob=0.0", "data.placement=affine")
    train(root, "aff-rep", *common, nproc=2)
    train(root, "aff-sh", *common, "memory.bank=sharded", nproc=2)
    rep, sh = metrics(root, "aff-rep"), metrics(root, "aff-sh")
    for a, b in zip(rep, sh):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
    accum = 8 // (2 * 2)  # sequences per step / (micro-batch 2 x 2 ranks)
    levels = 2
    # per step and level: one split exchange per fetch (accum fetches) and one in reduce_gradients
    split_only = levels * (accum + 1) * 8
    for row in sh:
        assert row["comm/bank_bytes_sent"] == split_only, row["comm/bank_bytes_sent"]
    for level, table in bank_tables(root, "aff-rep", 6).items():
        torch.testing.assert_close(_bank_state(root, "aff-sh", 6)["tables"][level], table, rtol=1e-4, atol=1e-6)
    # the round-robin map on the same data sends rows across ranks
    train(root, "aff-rr", *common[:1], "memory.bank=sharded", nproc=2)
    assert max(r["comm/bank_bytes_sent"] for r in metrics(root, "aff-rr")) > 10 * split_only


def test_joint_clipping_under_zero2_and_zero3_equals_zero0(root):
    """memory.grad_clip joint under ZeRO 2 and 3: DeepSpeed clips the anchor by the norm over anchor and
    bank together (JointNorm wraps its ZeRO optimizer's norm) and the loop scales the bank by the same
    factor; the runs equal the ZeRO-0 run, where the loop clips both itself (clipping bites on every
    step here: clip 0.05). The generic memory (a submodule's parameters, gathered by ZeRO-3 around its
    forward) trains in all of them: p = 1/(k+1) per sequence, drawn per sample."""
    common = ("memory.grad_clip=joint", "train.grad_clip=0.05")
    train(root, "joint0", *common, "parallel.zero_stage=0", nproc=2)
    z0 = metrics(root, "joint0")
    for stage in (2, 3):
        train(root, f"joint{stage}", *common, f"parallel.zero_stage={stage}", nproc=2)
        zs = metrics(root, f"joint{stage}")
        assert len(z0) == len(zs) == 6
        for a, b in zip(z0, zs):
            assert a["optim/grad_norm"] > 0.05 * 2  # clipped on every step
            assert b["optim/grad_norm"] == pytest.approx(a["optim/grad_norm"], rel=1e-5)
            assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
        for level, table in bank_tables(root, "joint0", 6).items():
            torch.testing.assert_close(bank_tables(root, f"joint{stage}", 6)[level], table, rtol=1e-4, atol=1e-6)
    # separate clipping (each by its own norm) is a different trajectory
    train(root, "sep2", "memory.grad_clip=separate", "train.grad_clip=0.05", "parallel.zero_stage=2", nproc=2)
    assert metrics(root, "sep2")[-1]["loss/train"] != pytest.approx(z0[-1]["loss/train"], rel=1e-6)


def _trained(root: Path, run: str, *overrides: str, nproc: int = 1) -> list[dict]:
    """Metrics of ``run``, training it first unless an earlier test did."""
    if not (root / "runs" / run / "metrics.jsonl").is_file():
        train(root, run, *overrides, nproc=nproc)
    return metrics(root, run)


def test_deferred_offloaded_and_bf16_banks_train_from_recipes(root):
    """memory.bank_optimizer deferred + memory.bank_offload on 2 ranks trains exactly like the dense
    sharded bank (losses and the saved bank, which the checkpoint brings up to date); bf16 rows train,
    are saved as bf16, and stay within bf16 rounding of the fp32 run."""
    no_generic = "memory.generic_prob=0.0"
    dense = _trained(root, "sh2", no_generic, "memory.bank=sharded", nproc=2)
    out = train(root, "sh2-deferred", no_generic, "memory.bank=sharded", "memory.bank_optimizer=deferred",
                "memory.bank_offload=true", nproc=2)
    assert "sharded, fp32 rows, offloaded to CPU bank (deferred AdamW)" in out.stdout
    deferred = metrics(root, "sh2-deferred")
    for a, b in zip(dense, deferred):
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-6)
    for level, table in bank_tables(root, "sh2", 6).items():
        torch.testing.assert_close(bank_tables(root, "sh2-deferred", 6)[level], table, rtol=0, atol=1e-7)
    train(root, "sh2-bf16", no_generic, "memory.bank=sharded", "memory.bank_dtype=bf16", nproc=2)
    half = metrics(root, "sh2-bf16")
    assert all(abs(b["loss/train"] - a["loss/train"]) < 2e-2 for a, b in zip(dense, half))
    # AdamW moves a weight by at most ~lr per step whatever its gradient, so an element whose normalised
    # update has a different sign in bf16 than in fp32 (a gradient near zero) can end 2 x sum(lr) apart:
    # that is the bound for every element; nearly all stay within bf16 rounding.
    bound = 2 * sum(r["optim/memory_lr"] for r in dense)
    for level, table in bank_tables(root, "sh2-bf16", 6).items():
        assert table.dtype == torch.bfloat16
        want = bank_tables(root, "sh2", 6)[level]
        diff = (table.float() - want).abs()
        assert float(diff.max()) <= bound + 1e-2 * float(want.abs().max()), (float(diff.max()), bound)
        close = diff <= 2e-3 + 2e-2 * want.abs()
        assert float(close.float().mean()) >= 0.99, float(close.float().mean())


def test_sharded_bank_and_zero2_anchor_resume_on_three_ranks_and_on_one(root):
    """Save on 2 ranks (sharded bank in its DCP folder, ZeRO-2 anchor), resume on 3 ranks and on 1: the
    bank reshards by global row, the anchor's optimizer state goes through DeepSpeed's universal
    checkpoint, and both continue the uninterrupted run (12 sequences per step: 2x2x3, 3x2x2, 1x2x6)."""
    common = ("memory.bank=sharded", "parallel.zero_stage=2", f"train.global_batch_tokens={12 * SEQ}")
    train(root, "rs2", *common, nproc=2)
    want = metrics(root, "rs2")
    for nproc, extra in ((3, ()), (1, ("memory.bank=replicated",))):
        run = f"rs2-to-{nproc}"
        shutil.copytree(root / "runs" / "rs2", root / "runs" / run)
        shutil.rmtree(root / "runs" / run / "checkpoints" / "global_step6")
        out = train(root, run, *common, *extra, nproc=nproc)
        assert "converting it to a universal checkpoint" in out.stdout and "resuming from" in out.stdout
        got = metrics(root, run)[-3:]
        for a, b in zip(want[-3:], got):
            assert b["step"] == a["step"]
            assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
        for level, table in bank_tables(root, "rs2", 6).items():
            torch.testing.assert_close(bank_tables(root, run, 6)[level], table, rtol=1e-4, atol=1e-6)
