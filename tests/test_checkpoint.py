"""Checkpoint bookkeeping: completion markers, partial folders, pruning, permanence, RNG state and compatibility
(saving, checksums and reading locks end to end: tests/test_checkpoint_integrity.py)."""

import json
import random

import numpy as np
import pytest
import torch

from memtrain.config import recipe_from_dict
from memtrain.errors import CheckpointError
from memtrain.parallel import checkpoint as ckpt
from memtrain.parallel import checkpoint_folder


def _fake(run_dir, step, complete=True, permanent=False, world_size=1):
    path = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(step)
    path.mkdir(parents=True)
    if complete:
        (path / ckpt.MARKER).write_text(json.dumps({"step": step, "permanent": permanent, "world_size": world_size}))
    return path


def test_latest_ignores_incomplete_tags_and_partial_folders(tmp_path):
    _fake(tmp_path, 10)
    _fake(tmp_path, 20)
    _fake(tmp_path, 30, complete=False)  # killed mid-save (by a version that wrote in place)
    partial = ckpt.checkpoint_root(tmp_path) / ckpt.partial_tag_for(40)  # killed mid-save, even after its marker
    partial.mkdir()
    (partial / ckpt.MARKER).write_text(json.dumps({"step": 40, "permanent": False, "world_size": 1}))
    (ckpt.checkpoint_root(tmp_path) / "latest").write_text("global_step30")  # the pointer is never read back
    assert ckpt.latest_checkpoint(tmp_path).step == 20
    complete, incomplete = ckpt.list_checkpoints(tmp_path)
    assert [c.step for c in complete] == [10, 20] and [p.name for p in incomplete] == ["global_step30"]
    assert ckpt.leftovers(tmp_path) == [partial]
    with pytest.raises(CheckpointError, match="is neither a complete checkpoint folder"):
        ckpt.resolve(partial)


def _real_marker(run_dir, step):
    """A checkpoint folder with one file and the marker a save writes (with its checksum table)."""
    path = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(step)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(bytes(range(256)) * 4)
    checkpoint_folder.mark_complete(path, step, False, 1, checkpoint_folder.hash_files(path, ["weights.bin"]))
    return path


def test_a_damaged_marker_stops_resume_and_evaluation_and_is_never_pruned(tmp_path):
    """A COMPLETE.json that exists but cannot be parsed (cut to 100 bytes, as a full disk or a bad copy leaves
    it) used to count as no marker: the run resumed from the older checkpoint, logged "no COMPLETE.json", and
    the next save's retention deleted the damaged folder. It is a damaged checkpoint: the newest one stops the
    resume and evaluation's discovery with one line naming the marker and the fallback; none is pruned."""
    from memtrain.eval.evaluate import find_checkpoint

    _fake(tmp_path, 10)
    bad = _real_marker(tmp_path, 20)
    marker = bad / ckpt.MARKER
    marker.write_bytes(marker.read_bytes()[:100])
    want = (rf"^checkpoint {bad} is damaged: COMPLETE.json cannot be parsed \(.*\); delete {marker} to resume "
            rf"from {bad.parent / 'global_step10'}$")
    with pytest.raises(CheckpointError, match=want):
        ckpt.latest_checkpoint(tmp_path)
    for path in (tmp_path, bad):  # eval / generate / model.init_from, given the run.dir or the folder
        with pytest.raises(CheckpointError, match=want):
            ckpt.resolve(path)
    with pytest.raises(CheckpointError, match=want):
        find_checkpoint(recipe_from_dict({"run": {"dir": str(tmp_path)}}))
    complete, incomplete = ckpt.list_checkpoints(tmp_path)
    assert [c.step for c in complete] == [10] and incomplete == []  # not "incomplete"
    assert [(d.step, d.path) for d in ckpt.damaged_checkpoints(tmp_path)] == [(20, bad)]
    assert ckpt.latest_checkpoint(tmp_path, strict=False).step == 10  # error messages' "last good checkpoint"
    _fake(tmp_path, 30)  # a newer complete one (the damaged one is older now) ...
    ckpt.prune(tmp_path, keep_last=1)  # ... and retention: the damaged folder stays, untouched
    assert marker.is_file() and (bad / "weights.bin").is_file() and ckpt.latest_checkpoint(tmp_path).step == 30
    marker.unlink()  # the fix the message names: then it is incomplete, and retention takes it
    assert ckpt.list_checkpoints(tmp_path)[1] == [bad] and ckpt.damaged_checkpoints(tmp_path) == []
    ckpt.prune(tmp_path, keep_last=1)
    assert not bad.exists()


@pytest.mark.parametrize("content, problem", [
    (b"[1, 2]", "COMPLETE.json is not a JSON object"),
    (b'{"step": 20, "permanent": false}', "COMPLETE.json lacks world_size"),
    (b'{"step": 12, "permanent": false, "world_size": 1}', "COMPLETE.json records step 12 in the folder of step 20"),
    (b'{"step": 20, "permanent": false, "world_size": "2"}', "COMPLETE.json records world_size '2'"),
    (b'{"step": 20, "permanent": false, "world_size": 1, "files": []}', "COMPLETE.json records files as list"),
    (b"\xff\xfe\x00garbage", "COMPLETE.json cannot be parsed ('utf-8' codec can't decode"),
    (b"", "COMPLETE.json cannot be parsed (Expecting value"),
])
def test_markers_without_their_fields_are_damaged(tmp_path, content, problem):
    _fake(tmp_path, 10)
    bad = _fake(tmp_path, 20)
    (bad / ckpt.MARKER).write_bytes(content)
    (found,) = ckpt.damaged_checkpoints(tmp_path)
    assert found.path == bad and found.problem.startswith(problem)
    with pytest.raises(CheckpointError, match=f"^checkpoint {bad} is damaged: "):
        ckpt.latest_checkpoint(tmp_path)


def test_the_fallback_past_damaged_markers_names_every_marker_to_delete(tmp_path):
    _fake(tmp_path, 10)
    for step in (20, 30):
        (_fake(tmp_path, step) / ckpt.MARKER).write_text("{")
    root = ckpt.checkpoint_root(tmp_path)
    with pytest.raises(CheckpointError, match=rf"global_step30 is damaged: .*; delete {root / 'global_step30'}/"
                                              rf"COMPLETE.json and {root / 'global_step20'}/COMPLETE.json to "
                                              rf"resume from {root / 'global_step10'}$"):
        ckpt.latest_checkpoint(tmp_path)
    ckpt.prune(tmp_path, keep_last=1)
    assert [d.step for d in ckpt.damaged_checkpoints(tmp_path)] == [20, 30]
    (root / "global_step10" / ckpt.MARKER).write_text("{")  # no complete checkpoint left to fall back to
    with pytest.raises(CheckpointError, match=r"global_step30 is damaged: .*; the run has no complete checkpoint "
                                              r"older than .*global_step30: start a new run.dir$"):
        ckpt.latest_checkpoint(tmp_path)


def test_prune_keeps_last_n_and_permanent(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _fake(tmp_path, step, permanent=step == 20)
    _fake(tmp_path, 25, complete=False)  # older than the newest complete one: garbage
    _fake(tmp_path, 60, complete=False)  # newer: a marker deleted to fall back past it; replaced when step 60 saves
    (ckpt.checkpoint_root(tmp_path) / ckpt.partial_tag_for(70)).mkdir()  # a killed save's temporary folder
    ckpt.prune(tmp_path, keep_last=2)
    complete, incomplete = ckpt.list_checkpoints(tmp_path)
    assert [c.step for c in complete] == [20, 40, 50]
    assert [p.name for p in incomplete] == ["global_step60"]
    assert ckpt.leftovers(tmp_path) == []


def test_publish_replaces_an_incomplete_folder_and_latest_is_atomic(tmp_path):
    old = _fake(tmp_path, 10, complete=False)
    (old / "stale.pt").write_bytes(b"old")
    partial = ckpt.checkpoint_root(tmp_path) / ckpt.partial_tag_for(10)
    partial.mkdir()
    (partial / "new.pt").write_bytes(b"new")
    checkpoint_folder.mark_complete(partial, 10, False, 1, checkpoint_folder.hash_files(partial, ["new.pt"]))
    checkpoint_folder.publish(partial, old)
    ckpt.write_latest(tmp_path, old.name)
    assert sorted(p.name for p in old.iterdir()) == [ckpt.MARKER, "new.pt"]
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == ["global_step10", "latest"]
    assert (ckpt.checkpoint_root(tmp_path) / "latest").read_text() == "global_step10"
    ckpt.verify(ckpt.latest_checkpoint(tmp_path))


def test_rng_state_roundtrip_loads_with_weights_only(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = ckpt.rng_state()
    torch.save(state, tmp_path / "s.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    ckpt.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


def test_incompatible_checkpoint_names_the_key(tmp_path):
    saved = recipe_from_dict({"model": {"d_model": 256}, "parallel": {"zero_stage": 2}})
    info = ckpt.CheckpointInfo(tmp_path / "global_step5", 5, False, world_size=2)
    state = {"recipe": saved.to_dict()}
    with pytest.raises(CheckpointError, match=r"model.d_model=256 but the recipe has 512"):
        ckpt.check_compatible(info, state, recipe_from_dict({}), world_size=2)
    same = {"model": {"d_model": 256}, "parallel": {"zero_stage": 2}}
    with pytest.raises(CheckpointError, match="parallel.zero_stage=2 but the recipe has 0"):
        ckpt.check_compatible(info, state, recipe_from_dict({"model": {"d_model": 256}}), world_size=2)
    for world, stage, universal in ((2, 2, False), (4, 2, True), (1, 2, True), (2, 1, True), (2, 3, True)):
        recipe = recipe_from_dict({**same, "parallel": {"zero_stage": stage}})
        ckpt.check_compatible(info, state, recipe, world_size=world)  # another size or stage: converted
        assert ckpt.needs_universal(info, state, recipe, world) is universal, (world, stage)
    zero0 = {"recipe": recipe_from_dict({"model": {"d_model": 256}}).to_dict()}
    assert not ckpt.needs_universal(info, zero0, recipe_from_dict({"model": {"d_model": 256}}), 4)


def test_durations_in_tokens_refuse_another_batch_on_resume(tmp_path):
    """A duration in tokens counts in steps of the recipe's batch from step 0: resumed at another global batch, the
    run would stop early (81,920 tokens at 4,096 per step resumed at 8,192 from step 10 said "run already complete at
    step 10" after 40,960 tokens). Refused, naming the keys; durations in steps, or the same batch, resume."""
    info = ckpt.CheckpointInfo(tmp_path / "global_step10", 10, False, world_size=1)
    base = {"data": {"seq_len": 128}, "train": {"global_batch_tokens": 4096, "max_steps": "40960 tokens"}}
    state = {"recipe": recipe_from_dict(base).to_dict()}
    doubled = recipe_from_dict(base, ["train.global_batch_tokens=8192", "train.max_steps=81920 tokens",
                                      "train.schedule.warmup=1024 tokens"])
    assert ckpt.token_durations(doubled) == ["train.max_steps", "train.schedule.warmup"]
    with pytest.raises(CheckpointError) as err:
        ckpt.check_token_durations(info, state, doubled)
    assert str(err.value) == (
        f"checkpoint {info.path} was written at 4,096 tokens per step (train.global_batch_tokens) but the recipe has "
        "8,192, and train.max_steps, train.schedule.warmup are given in tokens, which count in steps of the recipe's "
        "batch from step 0; restore train.global_batch_tokens: 4096, or give train.max_steps, train.schedule.warmup "
        "in steps")
    ckpt.check_token_durations(info, state, recipe_from_dict(base, ["train.max_steps=81920 tokens"]))  # same batch
    ckpt.check_token_durations(info, state, recipe_from_dict(base, ["train.global_batch_tokens=8192",
                                                                    "train.max_steps=20"]))  # in steps
    # the same tokens per step in other numbers (half the sequence length, twice the sequences)
    ckpt.check_token_durations(info, state, recipe_from_dict(base, ["data.seq_len=64", "model.max_seq_len=64",
                                                                    "train.max_steps=81920 tokens"]))


def test_compatibility_ignores_training_only_keys_and_keys_newer_than_the_checkpoint(tmp_path):
    """A checkpoint from before a recipe key existed resumes while the key keeps its default; the
    memory optimizer, clipping, generic probability, freezing and model.init_from may change."""
    info = ckpt.CheckpointInfo(tmp_path / "global_step5", 5, False, world_size=1)
    mem = {"data": {"clustering": {"enabled": True, "depth": 2}}, "memory": {"type": "ffn", "levels": [2, 1]}}
    saved = recipe_from_dict(mem).to_dict()
    del saved["model"]["init_from"], saved["memory"]["placement_layers"]  # as written by an older version
    state = {"recipe": saved}
    ckpt.check_compatible(info, state, recipe_from_dict(mem), world_size=1)
    changed = recipe_from_dict({**mem, "model": {"init_from": "runs/a"},
                                "memory": {**mem["memory"], "freeze_anchor": True, "generic_prob": 0.0,
                                           "grad_clip": "separate", "optimizer": {"lr": 1e-3}}})
    ckpt.check_compatible(info, state, changed, world_size=1)
    with pytest.raises(CheckpointError, match="memory.placement_layers"):
        ckpt.check_compatible(info, state, recipe_from_dict({**mem, "memory": {**mem["memory"],
                                                                               "placement_layers": 3}}), 1)
    with pytest.raises(CheckpointError, match="memory.levels"):
        ckpt.check_compatible(info, state, recipe_from_dict({**mem, "memory": {"type": "ffn", "levels": [2, 2]}}), 1)


def test_crossattn_compatibility_key_by_key_in_the_nested_section(tmp_path):
    """memory.crossattn is compared key by key: a checkpoint written before memory.crossattn.kernel existed
    resumes (the key at its default), the section's training-only keys (kernel, bank and LoRA learning rates,
    staged freezing from a step, balancing weight) may change, and a shape key names itself; freeze_bank and
    bank placement may not."""
    info = ckpt.CheckpointInfo(tmp_path / "global_step5", 5, False, world_size=1)
    xattn = {"memory": {"type": "crossattn", "crossattn": {"tokens": 8, "chapters": 2, "top_k": 1}}}
    saved = recipe_from_dict(xattn).to_dict()
    del saved["memory"]["crossattn"]["kernel"]  # as written before the key existed
    state = {"recipe": saved}
    ckpt.check_compatible(info, state, recipe_from_dict(xattn), world_size=1)
    training_only = {"kernel": "torch", "bank_lr": 1e-4, "lora_lr": 1e-3, "freeze_bank_at": 3, "balance_loss": 0.1}
    changed = {"memory": {"type": "crossattn", "crossattn": {**xattn["memory"]["crossattn"], **training_only}}}
    ckpt.check_compatible(info, state, recipe_from_dict(changed), world_size=1)
    # Not resumable, with what to do instead. Before, both passed this check and the load failed with "the
    # folder is damaged ... start a new run.dir" (a frozen bank has no optimizer group; a sharded bank's rows
    # are saved apart from the model).
    for key, value, hint in (("freeze_bank", True, "memory.crossattn.freeze_bank_at; to start frozen from this "
                              "checkpoint's weights: model.init_from in the new run.dir)"),
                             ("bank", "sharded", "model.init_from in the new run.dir starts from this checkpoint's "
                              "weights)")):
        other = {"memory": {"type": "crossattn", "crossattn": {**xattn["memory"]["crossattn"], key: value}}}
        with pytest.raises(CheckpointError) as err:
            ckpt.check_compatible(info, state, recipe_from_dict(other), world_size=1)
        assert f"was written with memory.crossattn.{key}=" in str(err.value) and str(err.value).endswith(hint)
    with pytest.raises(CheckpointError, match=r"memory.crossattn.tokens=8 but the recipe has 16"):
        ckpt.check_compatible(info, state, recipe_from_dict(
            {"memory": {"type": "crossattn", "crossattn": {"tokens": 16, "chapters": 2, "top_k": 1}}}), 1)


def test_universal_load_repairs_group_settings_and_step_counters():
    """DeepSpeed's ZeRO-3 universal load copies the first group's hyperparameters into every group and
    assigns one step tensor to every group's AdamW state (torch increments it in place, so each step
    would count once per group). After memtrain's repair each group has its own settings, the
    scheduler's lr, and its own counter with the same value."""
    from types import SimpleNamespace

    shared = torch.tensor(4.0)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    base = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}])
    for p in params:
        base.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    for g in base.param_groups:  # what DeepSpeed's ZeRO-3 universal load leaves: the first group's settings
        g.update(weight_decay=0.1, lr=0.5)
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=base),
                             lr_scheduler=SimpleNamespace(get_last_lr=lambda: [0.25, 0.125]))
    ckpt._repair_universal_load(engine, [{"weight_decay": 0.1}, {"weight_decay": 0.0}])
    assert [(g["weight_decay"], g["lr"]) for g in base.param_groups] == [(0.1, 0.25), (0.0, 0.125)]
    steps = [base.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and [float(s) for s in steps] == [4.0, 4.0]
    for p in params:
        p.grad = torch.ones_like(p)
    base.step()
    assert [float(base.state[p]["step"]) for p in params] == [5.0, 5.0]


_RESUMED_LR = r"""
import json, sys
import torch
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel import checkpoint as ckpt, dist, engine as eng

env = dist.discover({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1]})
dist.init(env, torch.device("cpu"), "gloo")
out = {}
for stage in (0, 1):
    base = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=32", "model.vocab_size=64",
            "data.tokenizer.vocab_size=64", "model.max_seq_len=16", "data.seq_len=16", "train.global_batch_tokens=32",
            "train.micro_batch_size=2", "train.max_steps=10", "train.schedule.warmup=2",
            "train.optimizer.weight_decay=0.1", f"parallel.zero_stage={stage}", f"run.dir={sys.argv[2]}/run{stage}"]

    def start(lr):
        recipe = recipe_from_dict({}, base + [f"train.optimizer.lr={lr}"])
        torch.manual_seed(0)
        return recipe, eng.initialize(build(recipe.model), recipe, 1, "fp32")[0]

    def steps(engine, n):
        for _ in range(n):
            engine.backward(engine(torch.randint(0, 64, (2, 16))).logits.float().mean())
            engine.step()

    def lrs(engine):
        return [g["lr"] for g in getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups]

    recipe, engine = start(1e-3)
    steps(engine, 3)
    ckpt.save(engine, recipe, step=3, trainer_state={"step": 3}, rank=0, world_size=1)
    saved = lrs(engine)
    for lr in (1e-3, 1e-4):
        recipe, engine = start(lr)
        ckpt.load(engine, ckpt.latest_checkpoint(recipe.run_dir), 0)
        loaded = lrs(engine)
        steps(engine, 1)
        out[f"{stage} {lr}"] = {"saved": saved, "loaded": loaded, "stepped": lrs(engine),
                                "want": [eng.lr_at(recipe)(3), eng.lr_at(recipe)(4)]}
print(json.dumps(out))
"""


def test_a_learning_rate_changed_on_resume_is_the_one_applied(tmp_path):
    """Resumed with another train.optimizer.lr (the divergence advice: lower it, resume from the last good
    checkpoint), the optimizer follows the recipe's schedule at the restored step, as optim/lr logs it. Before,
    DeepSpeed restored LambdaLR's base_lrs and the groups' lr from the checkpoint: 1e-3 lowered to 1e-4 applied
    8.5e-4 while 9.6e-5 was logged. An unchanged rate resumes where the checkpoint was. ZeRO 0 and 1."""
    import os
    import subprocess
    import sys

    from memtrain.parallel.dist import free_port

    done = subprocess.run([sys.executable, "-c", _RESUMED_LR, str(free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for stage in (0, 1):
        same, lower = out[f"{stage} 0.001"], out[f"{stage} 0.0001"]
        assert same["loaded"] == same["saved"]  # the checkpoint's rate, as before
        for run in (same, lower):
            assert len(set(run["loaded"])) == 1 and len(run["loaded"]) >= 2, run  # every group (decay, no decay)
            assert run["loaded"][0] == pytest.approx(run["want"][0], rel=1e-12)
            assert run["stepped"][0] == pytest.approx(run["want"][1], rel=1e-12)
        assert lower["loaded"][0] == pytest.approx(same["loaded"][0] / 10, rel=1e-12)


def test_a_checkpoint_resumes_only_in_the_precision_it_trained_in(tmp_path):
    """DeepSpeed's optimizer state of a bf16 run does not load into an fp32 one (its bf16 optimizers keep fp32
    masters and name their ZeRO files bf16_zero_pp_rank_*), and the other way round: a checkpoint resumed in
    another precision (parallel.precision auto is bf16 on a GPU, fp32 on a CPU) is one line naming both and the
    ways on, where the load reported a missing file and called the checkpoint damaged. The precision is recorded
    in trainer_state.json since 2026-11-30; older ZeRO 1-3 checkpoints are told by their optimizer files' names."""
    info = checkpoint_folder.CheckpointInfo(tmp_path / "global_step4", 4, False, 1)
    info.path.mkdir()
    with pytest.raises(CheckpointError, match=r"was trained in bf16 but this run is fp32; resume it on a GPU "
                                              r"\(parallel.precision bf16 or auto\), or start a new run.dir with "
                                              r"model.init_from=.*global_step4 to go on from its weights"):
        ckpt.check_precision(info, {"precision": "bf16"}, "fp32")
    with pytest.raises(CheckpointError, match="was trained in fp32 but this run is bf16; resume it with "
                                              "parallel.precision fp32"):
        ckpt.check_precision(info, {"precision": "fp32"}, "bf16")
    ckpt.check_precision(info, {"precision": "fp32"}, "fp32")
    ckpt.check_precision(info, {}, "bf16")  # nothing tells (an older ZeRO 0 checkpoint): no check
    (info.path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()
    assert ckpt.saved_precision(info, {}) == "bf16"
    with pytest.raises(CheckpointError, match="was trained in bf16 but this run is fp32"):
        ckpt.check_precision(info, {}, "fp32")
    (info.path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(
        info.path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert ckpt.saved_precision(info, {}) == "fp32"
