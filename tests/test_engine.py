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
from memtrain.parallel.dist import import_group_capturers
import_group_capturers()  # before the group starts, so that destroy_process_group frees it
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


def test_groups_are_cut_after_each_parameter_off_the_alignment():
    """split_for_alignment cuts a group after every parameter whose size is not a multiple of 8 elements,
    keeping the group's settings and the parameters' order; groups without one come back as they were."""
    from memtrain.parallel.engine import split_for_alignment

    a, b, c, d, e = (torch.nn.Parameter(torch.zeros(n)) for n in (16, 9, 24, 3, 8))
    groups = [{"params": [a, b, c, d, e], "weight_decay": 0.0, "role": "anchor"},
              {"params": [a, c], "weight_decay": 0.1, "role": "memory"}]
    out = split_for_alignment(groups)
    assert [[id(p) for p in g["params"]] for g in out] == [[id(a), id(b)], [id(c), id(d)], [id(e)], [id(a), id(c)]]
    assert [(g["weight_decay"], g["role"]) for g in out] == [(0.0, "anchor")] * 3 + [(0.1, "memory")]
    tail = split_for_alignment([{"params": [a, b], "role": "anchor"}])  # no empty group after a last odd one
    assert len(tail) == 1 and tail[0]["params"] == [a, b]
    assert split_for_alignment([{"params": [a, c, e], "role": "anchor"}]) == [{"params": [a, c, e], "role": "anchor"}]


def _run_one_rank(script: str) -> dict:
    """``script`` in a fresh Python as rank 0 of a one-process gloo group (its argv[1]: a free port); the JSON it
    prints after ``RESULT ``."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULT ", 1)[1])


_ALIGN = r"""
import json, os, sys
import torch, torch.distributed as dist
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel import engine as eng

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from memtrain.parallel.dist import import_group_capturers
import_group_capturers()  # before the group starts, so that destroy_process_group frees it
dist.init_process_group("gloo", rank=0, world_size=1)
result = {}
for stage, prec in ((1, "bf16"), (2, "fp32")):
    # 2 blocks with a 3-head memory: each gate bias has 9 elements and shifts everything after it
    recipe = recipe_from_dict({}, ["model.type=titans", "model.titans.variant=mag", "model.d_model=48",
                                   "model.n_layers=2", "model.n_heads=2", "model.titans.memory_heads=3",
                                   "model.ffn_dim=64", "model.vocab_size=64", "data.tokenizer.vocab_size=64",
                                   "model.max_seq_len=16", "data.seq_len=16", "train.global_batch_tokens=32",
                                   "train.micro_batch_size=2", f"parallel.zero_stage={stage}"])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for align in (True, False):
        torch.manual_seed(0)
        engine, *_ = eng.initialize(build(recipe.model), recipe, 1, prec, align=align)
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", torch.bfloat16, enabled=prec == "bf16"):
                logits = engine(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        result[f"{stage}-{prec}-{align}"] = {
            "optimizer": type(engine.optimizer).__name__, "groups": len(eng.base_optimizer(engine).param_groups),
            "misaligned": eng.misaligned_parameters(engine.module), "losses": losses}
print("RESULT", json.dumps(result))
"""


@pytest.mark.slow
def test_parameters_start_aligned_in_deepspeeds_flat_buffers(tmp_path):
    """DeepSpeed's ZeRO-1 bf16 (BF16_Optimizer) and ZeRO-2 optimizers make every parameter a view into one flat
    buffer per group. With the groups cut (the default), no parameter of a Titans model whose memory gate bias
    has 9 elements starts off a 16-byte boundary; uncut, the parameters after the first bias do (what made
    compiled Titans blocks fault with 'misaligned address' on the GPU). Training is the same either way."""
    result = _run_one_rank(_ALIGN)
    for key in ("1-bf16", "2-fp32"):
        cut, uncut = result[f"{key}-True"], result[f"{key}-False"]
        assert cut["misaligned"] == [], (key, cut["misaligned"])
        names = [name for name, _ in uncut["misaligned"]]
        assert "blocks.0.norm2.weight" in names and "blocks.1.memory.to_gates.bias" in names, (key, names)
        assert cut["groups"] == uncut["groups"] + 2  # the no-decay group cut after each block's gate bias
        assert cut["losses"] == pytest.approx(uncut["losses"], rel=1e-6), key  # equal here, bitwise
    assert result["1-bf16-True"]["optimizer"] == "BF16_Optimizer"
    assert result["2-fp32-True"]["optimizer"] == "DeepSpeedZeroOptimizer"


_BF16_JOINT = r"""
import json, math, os, sys
import torch, torch.distributed as dist
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel import engine as eng

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from memtrain.parallel.dist import import_group_capturers
import_group_capturers()
dist.init_process_group("gloo", rank=0, world_size=1)
CLIP = 0.05


def run(clip, bank_norm=None, skip_first=False, steps=3):
    recipe = recipe_from_dict({}, ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64",
                                   "model.vocab_size=64", "data.tokenizer.vocab_size=64", "model.max_seq_len=16",
                                   "data.seq_len=16", "train.global_batch_tokens=32", "train.micro_batch_size=2",
                                   "parallel.zero_stage=1", f"train.grad_clip={clip}",
                                   # eps far above sqrt(v): AdamW's first update in proportion to the gradient
                                   "train.optimizer.eps=10.0", "train.optimizer.weight_decay=0.0"])
    torch.manual_seed(0)
    engine, *_ = eng.initialize(build(recipe.model), recipe, 1, "bf16")
    masters = [p for g in eng.base_optimizer(engine).param_groups for p in g["params"]]
    start = [p.detach().double().clone() for p in masters]
    joint = eng.JointNorm(engine, CLIP) if bank_norm is not None else None
    out = {"optimizer": type(engine.optimizer).__name__, "norms": [], "coefficients": []}
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", torch.bfloat16):
            logits = engine(ids).logits
        engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()))
        if joint is not None:
            joint.bank_norm = bank_norm
        if skip_first and step == 0:
            with eng.skipped_step(engine):
                engine.step()
            continue
        engine.step()
        out["norms"].append(float(engine.get_global_grad_norm()))
        if joint is not None:
            out["coefficients"].append(joint.coefficient())
            out["totals"] = out.get("totals", []) + [joint.total]
    out["weights"] = [(p.detach().double() - s).abs().sum().item() for p, s in zip(masters, start)]  # fp32 masters
    return out


# the anchor alone at a clip of CLIP (its norms A), then jointly with a bank norm: the norm DeepSpeed clips by
# is sqrt(A^2 + BANK^2) and the anchor moves as it would alone at a clip of CLIP * A / sqrt(A^2 + BANK^2)
alone = run(CLIP, steps=1)
first = alone["norms"][0]
BANK = 2 * first
joint = run(CLIP, BANK, steps=1)
scaled = run(CLIP * first / math.sqrt(first ** 2 + BANK ** 2), steps=1)
skipped = run(CLIP, BANK, skip_first=True)
print("RESULT", json.dumps({"alone": alone, "joint": joint, "scaled": scaled, "skipped": skipped, "bank": BANK}))
"""


@pytest.mark.slow
def test_joint_clipping_under_zero1_bf16_clips_by_the_joint_norm():
    """ZeRO 1 with bf16 runs DeepSpeed's BF16_Optimizer, which JointNorm did not know (a TypeError at the start
    of every memory run with memory.grad_clip auto there: the paper recipes' setting on a GPU). Now the norm it
    clips the anchor by is sqrt(anchor^2 + bank^2), its coefficient and total come back to the loop, and the
    anchor's first step equals the anchor alone clipped by the same factor; a skipped step leaves the wrapper."""
    import math

    result = _run_one_rank(_BF16_JOINT)
    alone, joint, scaled, skipped = result["alone"], result["joint"], result["scaled"], result["skipped"]
    assert joint["optimizer"] == "BF16_Optimizer"
    a, bank = alone["norms"][0], result["bank"]
    total = math.sqrt(a ** 2 + bank ** 2)  # sqrt(5) a
    assert joint["norms"][0] == pytest.approx(total, rel=1e-5) and joint["totals"][0] == pytest.approx(total, rel=1e-5)
    assert joint["coefficients"][0] == pytest.approx(0.05 / (total + 1e-6), rel=1e-6)
    assert joint["coefficients"][0] < 0.05 / a < 1  # clipping is active, and harder than the anchor's own
    assert scaled["norms"][0] == pytest.approx(a, rel=1e-6)
    # the step: the anchor's update is the one the anchor alone gets when clipped by the joint factor
    assert joint["weights"] == pytest.approx(scaled["weights"], rel=1e-4)
    assert joint["weights"][0] < 0.9 * alone["weights"][0]  # and it moved less than alone
    # a skipped step (the divergence guard) puts JointNorm's wrapper back: the bank's norm is in the next ones
    assert len(skipped["norms"]) == 2 and all(n > bank for n in skipped["norms"])


_EVERY_OPTIMIZER = r"""
import json, os, sys
import torch, torch.distributed as dist
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.parallel import engine as eng

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from memtrain.parallel.dist import import_group_capturers
import_group_capturers()
dist.init_process_group("gloo", rank=0, world_size=1)


def masters(engine):
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO 3 empties its groups
    return list(flats) if flats else [p for g in eng.base_optimizer(engine).param_groups for p in g["params"]]


result = {}
for stage in (0, 1, 2, 3):
    for prec in ("fp32", "bf16"):
        recipe = recipe_from_dict({}, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=64",
                                       "model.vocab_size=64", "data.tokenizer.vocab_size=64", "model.max_seq_len=16",
                                       "data.seq_len=16", "train.global_batch_tokens=32", "train.micro_batch_size=2",
                                       f"parallel.zero_stage={stage}", "train.schedule.warmup=0"])
        torch.manual_seed(0)
        engine, *_ = eng.initialize(build(recipe.model), recipe, 1, prec)
        out = {"optimizer": type(engine.optimizer).__name__}
        for skip in (True, False):  # finite gradients: the guard's skip, then a plain step
            start = [m.detach().double().clone() for m in masters(engine)]
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.autocast("cpu", torch.bfloat16, enabled=prec == "bf16"):
                logits = engine(ids).logits
            engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()))
            if skip:
                with eng.skipped_step(engine):
                    engine.step()
            else:
                engine.step()
            out["moved_skipped" if skip else "moved"] = sum(
                (m.detach().double() - s).abs().sum().item() for m, s in zip(masters(engine), start))
        out["finite"] = eng.weights_finite(engine)
        with torch.no_grad():
            masters(engine)[0].view(-1)[0] = float("nan")
        out["finite_after_nan"] = eng.weights_finite(engine)
        result[f"{stage}-{prec}"] = out
print("RESULT", json.dumps(result))
"""


@pytest.mark.slow
def test_every_zero_stage_and_precision_starts_skips_a_step_and_checks_its_weights():
    """Each (ZeRO stage, precision) DeepSpeed gets from memtrain, on CPU: it starts (ZeRO 0 in bf16 raised
    NotImplementedError in DeepSpeed's set-up, the default recipes' setting on a GPU), the divergence guard's
    skipped_step leaves every fp32 master weight as it was with finite gradients (ZeRO 1-2 in fp32 and ZeRO 3
    applied the step: the overflow check skipped_step replaced never ran there), the next step moves them, and
    weights_finite sees a NaN planted in them (it read nothing under ZeRO 3)."""
    result = _run_one_rank(_EVERY_OPTIMIZER)
    assert {k: v["optimizer"] for k, v in result.items()} == {
        "0-fp32": "AdamW", "0-bf16": "FP16_UnfusedOptimizer", "1-fp32": "DeepSpeedZeroOptimizer",
        "1-bf16": "BF16_Optimizer", "2-fp32": "DeepSpeedZeroOptimizer", "2-bf16": "DeepSpeedZeroOptimizer",
        "3-fp32": "DeepSpeedZeroOptimizer_Stage3", "3-bf16": "DeepSpeedZeroOptimizer_Stage3"}
    for key, out in result.items():
        assert out["moved_skipped"] == 0.0 and out["moved"] > 0, (key, out)
        assert out["finite"] and not out["finite_after_nan"], (key, out)


_GROUPED = r"""
import json, os, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from memtrain.config import recipe_from_dict
from memtrain.model import build
from memtrain.model.titans import arch, memory
from memtrain.parallel import engine as eng

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from memtrain.parallel.dist import import_group_capturers
import_group_capturers()  # before the group starts, so that destroy_process_group frees it
dist.init_process_group("gloo", rank=0, world_size=1)
grouped_linear = arch.grouped_linear
plain = lambda w, b=None, enabled=True: (lambda x: F.linear(x, w, b))
result = {}
for stage, prec in ((1, "bf16"), (2, "fp32")):
    recipe = recipe_from_dict({}, ["model.type=titans", "model.titans.variant=mac", "model.d_model=48",
                                   "model.n_layers=2", "model.n_heads=2", "model.titans.memory_heads=2",
                                   "model.titans.segment_len=8", "model.titans.persistent_tokens=2",
                                   "model.ffn_dim=64", "model.vocab_size=64", "data.tokenizer.vocab_size=64",
                                   "model.max_seq_len=32", "data.seq_len=32", "train.global_batch_tokens=64",
                                   "train.micro_batch_size=2", "train.optimizer.lr=0.5", "train.optimizer.eps=1.0",
                                   "train.schedule.warmup=0",
                                   f"parallel.zero_stage={stage}"])
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    for grouped in (True, False):
        arch.grouped_linear = memory.grouped_linear = grouped_linear if grouped else plain
        torch.manual_seed(0)
        engine, *_ = eng.initialize(build(recipe.model), recipe, 1, prec)
        start = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        losses = []
        for _ in range(3):
            loss = engine(ids, labels=ids.roll(-1, 1)).loss_sum.float() / ids.numel()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        end = {n: p.detach().float() for n, p in engine.module.named_parameters()}
        result[f"{stage}-{prec}-{grouped}"] = {
            "losses": losses, "params": {n: end[n].flatten()[:64].tolist() for n in end},
            "unchanged": [n for n in end if torch.equal(end[n], start[n])]}
print("RESULT", json.dumps(result))
"""


@pytest.mark.slow
def test_mac_grouped_weight_gradients_train_through_deepspeed(tmp_path):
    """Eager MAC computes each per-segment projection's weight gradient once (memtrain.model.grouped_linear) and
    delivers it through autograd once per weight, which DeepSpeed's gradient hooks see: under ZeRO-1 bf16
    (BF16_Optimizer, bf16 weights, no autocast, as training on a GPU runs) and ZeRO-2 fp32, three optimizer steps
    give the losses and parameters of autograd's per-use sums (fp32 to 1e-5; bf16 within its rounding), and every
    parameter moved. AdamW's eps is 1, so that its updates are about lr times the gradients (at eps 1e-8 they are
    about lr times their signs, and rounding flips those of gradients near zero)."""
    result = _run_one_rank(_GROUPED)
    for key, rel in (("2-fp32", 1e-5), ("1-bf16", 2e-2)):
        grouped, plain = result[f"{key}-True"], result[f"{key}-False"]
        # bf16 weights: updates below half an ulp of a weight leave it (as the gate biases, about -4.6) unchanged
        assert grouped["unchanged"] == plain["unchanged"] == ([] if key == "2-fp32" else plain["unchanged"]), (
            key, grouped["unchanged"], plain["unchanged"])
        assert grouped["losses"] == pytest.approx(plain["losses"], rel=rel), key
        assert grouped["losses"][-1] < grouped["losses"][0], key
        if key == "2-fp32":
            for name, values in plain["params"].items():
                assert grouped["params"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


def test_compiled_blocks_refuse_a_parameter_off_the_alignment():
    """The trainer's check before compiled blocks run on CUDA: one line naming the parameter, how far off it
    is and the way out (model.compile=false); nothing when every parameter starts aligned."""
    from memtrain.launcher.train import check_compiled_alignment

    flat = torch.zeros(64)
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Linear(4, 4, bias=False))
    model[0].weight.data, model[0].bias.data = flat[:3].view(1, 3), flat[4:5]  # views, as DeepSpeed's
    model[1].weight.data = flat[8:24].view(4, 4)
    check_compiled_alignment(model, None)  # offsets 0, 16 and 32 bytes
    model[0].bias.data = flat[3:4]  # 12 bytes
    model[1].weight.data = flat[5:21].view(4, 4)  # 20 bytes: 4 off
    with pytest.raises(LaunchError, match=r"^model.compile: 2 parameter\(s\) do not start 16-byte aligned "
                                          r"\(0.bias is 12 bytes off; .*set model.compile=false for this run$"):
        check_compiled_alignment(model, None)
