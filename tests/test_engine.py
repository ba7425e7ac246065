"""DeepSpeed config generation, parameter groups and the learning-rate schedule."""

import math

import pytest
import torch

from memtrain.config import RecipeError, recipe_from_dict
from memtrain.errors import LaunchError
from memtrain.parallel.engine import build_optimizer, build_scheduler, deepspeed_config, lr_at, param_groups, precision


def _recipe(*overrides):
    return recipe_from_dict({}, ["data.seq_len=64", "model.max_seq_len=64", "train.global_batch_tokens=2048",
                                 "train.micro_batch_size=4", *overrides])


def test_deepspeed_config_batch_arithmetic_and_monitors_off():
    r = _recipe("parallel.zero_stage=2", "train.grad_clip=0.5")
    cfg = deepspeed_config(r, world_size=2, precision_name="bf16")
    assert cfg["train_batch_size"] == 32 and cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 4  # 32 = 4 per micro-batch x 2 ranks x 4
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] and cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert not cfg["tensorboard"]["enabled"] and not cfg["csv_monitor"]["enabled"] and not cfg["wandb"]["enabled"]


def test_world_size_that_does_not_divide_the_batch_names_the_key():
    with pytest.raises(RecipeError, match="^recipe error: train.global_batch_tokens") as err:
        deepspeed_config(_recipe(), world_size=3)
    assert err.value.key == "train.global_batch_tokens"


def test_precision_defaults():
    r = _recipe()
    assert precision(r, torch.device("cpu")) == "fp32"
    assert precision(r, torch.device("cuda", 0)) == "bf16"
    with pytest.raises(LaunchError, match="parallel.precision is bf16 but this run is on CPU"):
        precision(_recipe("parallel.precision=bf16"), torch.device("cpu"))


def test_cosine_schedule_with_warmup_and_floor():
    r = _recipe("train.max_steps=100", "train.schedule.warmup=10 steps", "train.optimizer.lr=1e-3",
                "train.schedule.min_lr=1e-5")
    lr = lr_at(r)
    assert lr(0) == pytest.approx(1e-4) and lr(9) == pytest.approx(1e-3)
    assert lr(10) == pytest.approx(1e-3)
    assert lr(55) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(100) == pytest.approx(1e-5) and lr(500) == pytest.approx(1e-5)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 120))
    # The LambdaLR DeepSpeed steps follows the same curve.
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, r)
    sched = build_scheduler(opt, r)
    seen = []
    for _ in range(30):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr(s) for s in range(30)])


def test_constant_schedule_and_tokens_warmup():
    r = _recipe("train.max_steps=100", "train.schedule.kind=constant", "train.schedule.warmup=4096 tokens")
    lr = lr_at(r)
    assert lr(0) == pytest.approx(r.train.optimizer.lr / 2) and lr(1) == lr(99) == r.train.optimizer.lr


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4, bias=False), torch.nn.Linear(4, 4, bias=False))
    decay, no_decay = param_groups(model, 0.1)
    assert len(decay["params"]) == 2 and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 1 and no_decay["weight_decay"] == 0.0
    opt = build_optimizer(model, _recipe("train.optimizer.betas=[0.9, 0.95]"))
    assert opt.defaults["betas"] == (0.9, 0.95)


_SHM = r"""
import os, sys
import torch, torch.distributed as dist
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel import engine as eng
import deepspeed.comm.comm as dscomm

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
recipe = recipe_from_dict({}, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=32",
                               "model.vocab_size=64", "data.tokenizer.vocab_size=64", "model.max_seq_len=16",
                               "data.seq_len=16", "train.global_batch_tokens=32", "train.micro_batch_size=2"])
engine, *_ = eng.initialize(build(recipe.model), recipe, 1, "fp32")
print("shm_comm_op", dscomm.cdb.shm_comm_op)
"""


def test_deepspeed_starts_without_building_its_inference_shm_op(tmp_path):
    """On CPU, DeepSpeed's comm backend JIT-compiles ``deepspeed_shm_comm`` (26 s here) for its inference
    engine's all-reduce unless memtrain marks it unavailable: with an empty ``TORCH_EXTENSIONS_DIR``,
    ``initialize`` leaves it empty and the backend holds no shm op."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ext = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    run = subprocess.run([sys.executable, "-c", _SHM, str(port)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "shm_comm_op None" in run.stdout, run.stdout[-2000:]
    assert not ext.exists() or not any(ext.iterdir()), sorted(p.name for p in ext.rglob("*"))
