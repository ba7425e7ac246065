"""MemoryLlama (``memory.type: memory_llama``) in memtrain's recipes and training loop, on CPU with a
tiny random Llama and a tiny byte-level BPE tokenizer built offline into the same folder (a stand-in
for models/Llama-3.2-1B): recipe validation, the model wrapper (frozen base, peft LoRA, memory
blocks, meta-device counts), the optimizer's memory / LoRA groups and their schedules, the per-sample
memory reset at validation, `memtrain recipe show`, and `memtrain train` end to end (loss goes down,
memory_module/* gate scalars, base weights unchanged, exact stop-and-resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import peft  # noqa: F401 - a hard dependency (LoRA): a broken install fails here, it is not skipped
import pytest
import torch
import transformers  # noqa: F401
import yaml

from memtrain.config import MemoryConfig, RecipeError, load_recipe, recipe_from_dict
from memtrain.model import build, count_parameters
from memtrain.model.hf import MemoryLlamaLM
from memtrain.model.titans.memory_llama import memory_blocks, set_memory_mode

from tiny_hf import make_tiny_llama  # tests/tiny_hf.py

REPO = Path(__file__).resolve().parents[1]
SEQ = 32
MEMORY_LR, LORA_LR = 1.0e-2, 5.0e-3


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1"})
    return env


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_recipe(root: Path) -> dict:
    return {
        "run": {"name": "memoryllama-tiny", "seed": 3},
        "model": {"type": "hf", "pretrained": str(root / "tiny-llama"), "max_seq_len": 64},
        "memory": {"type": "memory_llama", "memory_llama": {
            "position": "alma", "heads": 2, "chunk_size": 8, "lora": {"r": 4, "alpha": 8},
            "memory_lr": MEMORY_LR, "lora_lr": LORA_LR}},
        "data": {"dir": str(root / "data"), "sources": [str(root / "docs.jsonl")], "seq_len": SEQ,
                 "val_fraction": 0.05, "tokenizer": {"path": str(root / "tiny-llama")}},
        "train": {"max_steps": 8, "global_batch_tokens": 4 * SEQ, "micro_batch_size": 2, "grad_clip": 1.0,
                  "schedule": {"kind": "cosine", "warmup": "2 steps"}, "eval": {"every_steps": 4, "batches": 2}},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        "logging": {"every_steps": 1},
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The tiny model folder, a small jsonl corpus, the recipe (tiny.yaml) and its prepared data."""
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("memoryllama")
    make_tiny_llama(root / "tiny-llama", documents=500, layers=3)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::10]))
    (root / "tiny.yaml").write_text(yaml.safe_dump(tiny_recipe(root)))
    prepare(load_recipe(root / "tiny.yaml"))
    return root


def recipe(root: Path, *overrides: str):
    return load_recipe(root / "tiny.yaml", list(overrides))


def tiny_model(root: Path, *overrides: str, seed: int = 0) -> MemoryLlamaLM:
    r = recipe(root, *overrides)
    torch.manual_seed(seed)
    return build(r.model, r.memory, r.data.clustering.branching)


# -------------------------------------------------------------------------------------------------
# Recipe validation


BASE = {"model": {"type": "hf", "pretrained": "models/Llama-3.2-1B"}, "memory": {"type": "memory_llama"}}


def _with(**sections) -> dict:
    data = json.loads(json.dumps(BASE))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def test_memory_llama_defaults_fill_in_and_other_recipes_are_unchanged():
    r = recipe_from_dict(BASE)
    ml = r.memory.memory_llama
    assert ml.position == "alma" and ml.layers is None and ml.gate_bias_init == -6.0 and ml.residual == "input"
    assert ml.lora.enabled and (ml.lora.r, ml.lora.alpha, ml.lora.dropout) == (16, 32.0, 0.05) and not ml.lora.freeze
    assert set(ml.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (ml.memory_lr, ml.lora_lr, ml.weight_decay, ml.max_lr) == (1e-3, 1e-4, 0.1, 0.01)
    assert not r.memory.enabled and r.memory.is_memory_llama  # no memory bank
    assert "memory_llama:" in r.to_yaml()
    assert recipe_from_dict(yaml.safe_load(r.to_yaml())).memory.memory_llama == ml  # round trip
    # Other recipes keep memory.memory_llama null (their resume checks compare the memory section).
    assert recipe_from_dict({}).to_dict()["memory"]["memory_llama"] is None
    assert MemoryConfig(type="ffn").enabled and not MemoryConfig(type="memory_llama").enabled


@pytest.mark.parametrize("data, key, match", [
    ({"model": {"type": "decoder", "pretrained": None}}, "memory.type", "model.type: hf"),
    ({"parallel": {"zero_stage": 3}}, "parallel.zero_stage", "ZeRO-3 partitions the frozen base"),
    ({"memory": {"type": "memory_llama", "levels": [4]}}, "memory.levels", "hierarchical-memory setting"),
    ({"memory": {"type": "memory_llama", "freeze_anchor": True}}, "memory.freeze_anchor", "hierarchical"),
    ({"memory": {"type": "memory_llama", "generic_prob": 0.1}}, "memory.generic_prob", "hierarchical"),
    ({"memory": {"type": "memory_llama", "optimizer": {"lr": 1e-3}}}, "memory.optimizer", "hierarchical"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"memory_lr": 0}}}, "memory.memory_llama.memory_lr",
     "must be positive"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"lora_lr": -1e-4}}}, "memory.memory_llama.lora_lr",
     "must be positive"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"init_lr": 0.02}}}, "memory.memory_llama.init_lr",
     "below"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"layers": []}}}, "memory.memory_llama.layers", "empty"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"layers": [1, 1]}}}, "memory.memory_llama.layers",
     "distinct"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"position": "mal"}}}, "memory.memory_llama.position",
     "must be one of"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"min_lr_ratio": 2}}}, "memory.memory_llama.min_lr_ratio",
     r"\[0, 1\]"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"lora": {"enabled": False, "freeze": True}}}},
     "memory.memory_llama.lora.freeze", "enabled is false"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"lora": {"dropout": 1.0}}}},
     "memory.memory_llama.lora.dropout", r"\[0, 1\)"),
    ({"memory": {"type": "memory_llama", "memory_llama": {"lora": {"rank": 8}}}}, "memory.memory_llama.lora.rank",
     "unknown key"),
    ({"memory": {"type": "ffn", "levels": [4], "memory_llama": {"position": "elma"}},
      "data": {"clustering": {"enabled": True, "depth": 1}}}, "memory.memory_llama", "only used with"),
])
def test_validation_names_the_key(data, key, match):
    with pytest.raises(RecipeError, match=match) as err:
        recipe_from_dict(_with(**data))
    assert err.value.key == key


def test_hierarchical_validation_is_unchanged():
    with pytest.raises(RecipeError, match="^recipe error: memory.type") as err:  # post-hoc memories: FFN only
        recipe_from_dict({"model": {"type": "hf", "pretrained": "x/y"}, "memory": {"type": "lora", "levels": [1]}})
    assert err.value.key == "memory.type"
    ok = recipe_from_dict({"memory": {"type": "ffn", "levels": [4]}, "parallel": {"zero_stage": 3},
                           "data": {"clustering": {"enabled": True, "depth": 1}}})
    assert ok.memory.enabled and ok.memory.memory_llama is None


def test_paper_recipes_load():
    for position, layers in (("alma", None), ("elma", None)):
        r = load_recipe(REPO / f"recipes/memoryllama-{position}-llama3.2-1b.yaml")
        ml = r.memory.memory_llama
        assert r.model.type == "hf" and r.model.pretrained == "models/Llama-3.2-1B"
        assert r.data.tokenizer.path == "models/Llama-3.2-1B" and r.data.seq_len == 2048
        assert ml.position == position and ml.layers == layers and ml.gate_bias_init == -6.0
        assert ml.lora.enabled and ml.lora.r == 16 and ml.lora.alpha == 32 and ml.lora.dropout == 0.05
        assert r.sequences_per_step == 16 and r.max_steps * 16 == 50_000 and r.parallel.zero_stage <= 2
        assert r.train.schedule.kind == "cosine" and r.train.grad_clip > 0 and ml.lora_lr < ml.memory_lr


# -------------------------------------------------------------------------------------------------
# The model


def test_build_freezes_the_base_and_groups_memory_and_lora(root):
    model = tiny_model(root)
    assert isinstance(model, MemoryLlamaLM) and model.vocab_size == 384
    blocks = memory_blocks(model.hf_model)
    assert [b.layer_idx for b in blocks] == [1, 2]  # alma: the last two of 3 blocks
    assert all(b.mode == "auto" for b in blocks)
    assert all(not p.requires_grad for p in model.anchor_parameters())
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in model.memory_parameters()}
    assert model.lora_parameters() and all("lora_" in n for n, p in model.hf_model.named_parameters()
                                           if p.requires_grad and ".memory_block." not in n)
    n = count_parameters(model)
    assert n == sum(p.numel() for p in model.anchor_parameters()) + sum(p.numel() for p in model.memory_parameters())

    # elma + frozen LoRA: only the memory trains; no LoRA: no adapters at all
    frozen = tiny_model(root, "memory.memory_llama.position=elma", "memory.memory_llama.lora.freeze=true")
    assert [b.layer_idx for b in memory_blocks(frozen.hf_model)] == [0, 1]
    assert frozen.lora_parameters() and not any(p.requires_grad for p in frozen.lora_parameters())
    none = tiny_model(root, "memory.memory_llama.lora.enabled=false", "memory.memory_llama.layers=[0, 2]")
    assert not none.lora_parameters() and [b.layer_idx for b in memory_blocks(none.hf_model)] == [0, 2]
    with pytest.raises(RecipeError, match="^recipe error: memory.memory_llama.layers") as err:
        tiny_model(root, "memory.memory_llama.layers=[3]")
    assert err.value.key == "memory.memory_llama.layers"
    # LoRA on modules the model does not have: one recipe error (before, peft's traceback)
    with pytest.raises(RecipeError, match=r"^recipe error: memory.memory_llama.lora.target_modules: \['foo_proj'\] "
                                          r"do not fit LlamaForCausalLM: ") as err:
        tiny_model(root, "memory.memory_llama.lora.target_modules=[foo_proj]")
    assert "\n" not in str(err.value)


def test_meta_device_counts_parameters(root):
    real = tiny_model(root)
    r = recipe(root)
    with torch.device("meta"):
        meta = build(r.model, r.memory, r.data.clustering.branching)
    assert all(p.is_meta for p in meta.parameters())  # peft runs on the meta device: LoRA is counted
    assert count_parameters(meta) == count_parameters(real)
    assert meta.describe() == real.describe()
    lines = real.describe()
    mem = sum(p.numel() for p in real.memory_block_parameters())
    assert f"decoder layers [1, 2]: {mem:,} parameters" in lines[0]
    assert "LoRA r=4" in lines[1] and "trainable" in lines[1]


def test_optimizer_groups_follow_their_own_schedules(root):
    from memtrain.parallel.engine import build_optimizer, build_scheduler, lr_at, peak_lr

    r = recipe(root)
    model = tiny_model(root)
    opt = build_optimizer(model, r)
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"memory", "memory_no_decay", "lora"}
    assert groups["memory"]["role"] == groups["memory_no_decay"]["role"] == "memory"
    assert groups["lora"]["role"] == "lora"
    assert groups["memory"]["lr"] == MEMORY_LR and groups["lora"]["lr"] == LORA_LR
    assert groups["memory"]["weight_decay"] == groups["lora"]["weight_decay"] == 0.1
    assert groups["memory_no_decay"]["weight_decay"] == 0.0
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    assert peak_lr(r, "memory") == (MEMORY_LR, MEMORY_LR * 0.1) and peak_lr(r, "lora") == (LORA_LR, LORA_LR * 0.1)
    sched = build_scheduler(opt, r)
    for step in range(r.max_steps):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr_at(r, g["role"])(step), rel=1e-12), (step, g["name"])
        opt.step()
        sched.step()
    assert lr_at(r, "memory")(r.max_steps - 1) / MEMORY_LR == pytest.approx(lr_at(r, "lora")(r.max_steps - 1) / LORA_LR)
    # frozen LoRA: the memory groups only
    frozen = tiny_model(root, "memory.memory_llama.lora.freeze=true")
    assert {g["role"] for g in build_optimizer(frozen, recipe(root, "memory.memory_llama.lora.freeze=true"))
            .param_groups} == {"memory"}


def test_activation_checkpointing_gives_the_same_gradients(root):
    """parallel.activation_checkpointing through the peft model: Hugging Face's non-reentrant
    checkpointing recomputes the memory blocks (their hooks run inside the layer) with equal gradients."""
    from memtrain.launcher.train import lm_loss

    model = tiny_model(root, "memory.memory_llama.lora.dropout=0.0")
    with torch.no_grad():
        for b in memory_blocks(model.hf_model):
            b.w_g.bias.fill_(-1.0)
    x = torch.randint(0, 384, (2, SEQ + 1), generator=torch.Generator().manual_seed(6))

    def grads() -> dict:
        model.zero_grad()
        lm_loss(model(x[:, :-1]).logits, x[:, 1:]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = grads()
    model.set_activation_checkpointing(True)
    assert model.hf_model.is_gradient_checkpointing
    checkpointed = grads()
    assert set(plain) == set(checkpointed) and any("lora_B" in n for n in plain)
    for n, g in plain.items():
        torch.testing.assert_close(checkpointed[n], g, rtol=1e-4, atol=1e-7)
    model.set_activation_checkpointing(False)
    assert not model.hf_model.is_gradient_checkpointing


class _Engine:
    """What train.evaluate needs from a DeepSpeed engine."""

    def __init__(self, module):
        self.module = module

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_validation_resets_the_memory_for_every_sample(root):
    """train.evaluate's loss over batches of 2 equals the mean of every sample's loss computed alone (every
    token scored, so token weighting is the per-sample mean),
    in any order and after training forwards: no memory crosses samples, batches or calls. The same
    check fails in "stream" mode (memory carried across forwards), so it can see a leak."""
    from memtrain.launcher.train import evaluate, lm_loss

    model = tiny_model(root)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # make the memory matter: open the gates, non-zero W_h
        for b in memory_blocks(model.hf_model):
            b.w_h.weight.copy_(0.3 * torch.randn(b.w_h.weight.shape, generator=g))
            b.w_g.bias.fill_(0.0)
    x = torch.randint(0, 384, (4, SEQ + 1), generator=g)
    batches = [{"input_ids": x[i:i + 2, :-1], "labels": x[i:i + 2, 1:],
                "doc_ids": torch.zeros(2, SEQ, dtype=torch.long)} for i in (0, 2)]
    engine = _Engine(model)

    model.train()
    lm_loss(model(x[:2, :-1]).logits, x[:2, 1:]).backward()  # a training step's forward first
    val = evaluate(engine, batches, torch.device("cpu"))
    assert all(b.state is None for b in memory_blocks(model.hf_model))  # back in train mode: nothing kept
    assert model.training

    model.eval()
    with torch.no_grad():
        alone = [float(lm_loss(model(x[i:i + 1, :-1]).logits, x[i:i + 1, 1:])) for i in (3, 1, 2, 0)]
    assert all(b.state is not None for b in memory_blocks(model.hf_model))  # eval keeps the last state ...
    model.train()
    assert all(b.state is None for b in memory_blocks(model.hf_model))  # ... until the mode changes
    assert val == pytest.approx(sum(alone) / 4, rel=1e-5)
    assert evaluate(engine, batches[::-1], torch.device("cpu")) == pytest.approx(val, rel=1e-6)

    set_memory_mode(model.hf_model, "stream")  # negative control: a memory carried across batches
    assert abs(evaluate(engine, batches, torch.device("cpu")) - val) > 1e-4
    set_memory_mode(model.hf_model, "auto")


def test_recipe_show(root, capsys):
    from memtrain.launcher.cli import main

    assert main(["recipe", "show", str(root / "tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "type: memory_llama" in out and "position: alma" in out and "lora_lr: 0.005" in out
    assert '"gradient_clipping": 1.0' in out and "model parameters:" in out
    assert main(["recipe", "show", str(root / "tiny.yaml"), "parallel.zero_stage=3"]) == 2
    assert "parallel.zero_stage" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# memtrain train end to end


def train(root: Path, run: str, *overrides: str, prelude: str = "") -> subprocess.CompletedProcess:
    args = ["train", str(root / "tiny.yaml"), f"run.dir={root / 'runs' / run}", *overrides]
    if prelude:  # run the CLI in-process after some set-up (simulates a preemption signal)
        code = prelude + f"\nfrom memtrain.launcher.cli import main\nraise SystemExit(main({args!r}))"
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "memtrain", *args]
    out = subprocess.run(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def metrics(root: Path, run: str) -> list[dict]:
    """The run's metrics.jsonl rows; each step once, in order (no rows left from an interrupted run)."""
    rows = [json.loads(line) for line in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"{run}: duplicated or out-of-order steps in metrics.jsonl: {steps}"
    return rows


def module_state(root: Path, run: str, step: int) -> dict:
    path = root / "runs" / run / "checkpoints" / f"global_step{step}" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=True)["module"]


@pytest.fixture(scope="module")
def reference(root):
    """An uninterrupted 8-step run (subprocess: DeepSpeed, one process)."""
    out = train(root, "ref")
    assert "memory_llama: alma memory blocks in decoder layers [1, 2]" in out.stdout
    assert "1 rank(s) via single on cpu (fp32)" in out.stdout
    return metrics(root, "ref")


@pytest.mark.slow
def test_training_run(root, reference):
    r = recipe(root)
    rows = {m["step"]: m for m in reference}
    assert sorted(rows) == list(range(1, 9))
    assert rows[8]["loss/train"] < rows[1]["loss/train"] - 0.3
    assert rows[8]["loss/val"] < rows[4]["loss/val"]
    from memtrain.parallel.engine import lr_at

    for step, m in rows.items():  # each group on its own cosine with warmup
        assert m["optim/memory_lr"] == pytest.approx(lr_at(r, "memory")(step - 1))
        assert m["optim/lora_lr"] == pytest.approx(lr_at(r, "lora")(step - 1))
        assert m["optim/lr"] == m["optim/memory_lr"]
    assert rows[2]["optim/memory_lr"] == pytest.approx(MEMORY_LR) and rows[2]["optim/lora_lr"] == pytest.approx(LORA_LR)
    last = rows[8]
    for scope in ("layer1", "layer2", "all"):
        for stat in ("gate_mean", "gate_std", "gate_min", "gate_max", "contribution", "contribution_per_token",
                     "w_h_norm", "gate_bias"):
            assert f"memory_module/{scope}/{stat}" in last, (scope, stat)
    gates = [last[f"memory_module/all/{k}"] for k in ("gate_min", "gate_mean", "gate_max")]
    assert 0 < gates[0] <= gates[1] <= gates[2] < 1
    assert last["memory_module/all/w_h_norm"] > 0  # W_h left its zero initialisation
    assert rows[1]["memory_module/all/gate_mean"] == pytest.approx(1 / (1 + 2.718281828459045 ** 6), rel=0.1)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "runs" / "ref" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"memory_module/all/gate_mean", "memory_module/layer1/w_h_norm", "optim/lora_lr", "loss/val"} <= tags

    # The base weights are those of the model folder; memory blocks and LoRA moved.
    from safetensors.torch import load_file

    original = load_file(str(root / "tiny-llama" / "model.safetensors"))
    start, end = module_state(root, "ref", 4), module_state(root, "ref", 8)
    base = {k: v for k, v in end.items() if ".memory_block." not in k and "lora_" not in k}
    names = {k.removeprefix("hf_model.base_model.model.").replace(".base_layer.", "."): k for k in base}
    assert set(names) == set(original)
    for name, key in names.items():
        assert torch.equal(end[key], original[name]), name
    moved = [k for k in end if (".memory_block." in k or "lora_B" in k) and not torch.equal(end[k], start[k])]
    assert any("lora_B" in k for k in moved) and any(".memory_block.w_h." in k for k in moved)


@pytest.mark.slow
def test_stop_and_resume_reproduces_the_uninterrupted_losses(root, reference):
    stop_after_3 = textwrap.dedent("""
        import os, signal
        import memtrain.launcher.train as t
        real = t.format_line
        def line(step, *args, **kwargs):  # SIGTERM (a preemption) during step 3
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(step, *args, **kwargs)
        t.format_line = line
    """)
    out = train(root, "resume", prelude=stop_after_3)
    assert "stopped by signal at step 3" in out.stdout
    out = train(root, "resume")
    assert "resuming from" in out.stdout and "global_step3 (step 3" in out.stdout
    resumed = {m["step"]: m for m in metrics(root, "resume")}
    assert sorted(resumed) == list(range(1, 9))
    for m in reference:
        assert resumed[m["step"]]["loss/train"] == pytest.approx(m["loss/train"], rel=0, abs=1e-6), m["step"]
        for k in ("memory_module/all/gate_mean", "memory_module/all/w_h_norm", "loss/val"):
            if k in m:
                assert resumed[m["step"]][k] == pytest.approx(m[k], rel=1e-5, abs=1e-9), (m["step"], k)
    ref, res = module_state(root, "ref", 8), module_state(root, "resume", 8)
    for k in ref:
        torch.testing.assert_close(res[k], ref[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_zero2_matches_zero0(root, reference):
    """ZeRO stage 2 (partitioned optimizer state and gradients of the memory and LoRA groups, the frozen
    base untouched) follows the same trajectory: the per-group learning rates survive DeepSpeed's
    wrapping of the optimizer."""
    train(root, "zero2", "parallel.zero_stage=2")
    for m, z in zip(reference, metrics(root, "zero2"), strict=True):
        assert z["loss/train"] == pytest.approx(m["loss/train"], rel=0, abs=1e-4), m["step"]
        assert z["optim/lora_lr"] == m["optim/lora_lr"]
