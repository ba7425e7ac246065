"""The on/off switches (memtrain.model.switches): 0 turns one off, unset / empty / 1 keep it on, and any other value
stops a run with one line before anything is written. Before, each was read as ``value != "0"``, so ``off`` or
``false`` silently kept on what the user asked to turn off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memtrain.config import recipe_from_dict
from memtrain.errors import SettingError
from memtrain.model import build, switches

TINY = {"model": {"type": "decoder", "vocab_size": 40, "d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_dim": 32,
                  "max_seq_len": 16},
        "data": {"seq_len": 16, "tokenizer": {"vocab_size": 40}}}


@pytest.fixture
def clean_switches(monkeypatch):
    for name in switches.FLAGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_switch_reads_0_as_off_and_unset_empty_or_1_as_on(clean_switches):
    assert len(switches.FLAGS) == 7
    for name in switches.FLAGS:
        assert switches.flag(name) is True
        for raw, on in (("", True), ("1", True), ("0", False)):
            clean_switches.setenv(name, raw)
            assert switches.flag(name) is on, (name, raw)
            switches.check_flags()
        clean_switches.delenv(name)


@pytest.mark.parametrize("raw", ["off", "false", "no", "2", " 0", "0 ", "on", "true"])
def test_any_other_value_is_one_line_naming_the_variable_and_what_0_turns_off(clean_switches, raw):
    from memtrain.launcher.train import check_kernels

    recipe = recipe_from_dict(TINY)
    for name, what in switches.FLAGS.items():
        clean_switches.setenv(name, raw)
        message = (f"{name}={raw!r}: expected 0 (turns off {what}) or 1 (on, the default; or unset it)")
        for call in (lambda: switches.flag(name), switches.check_flags):
            with pytest.raises(ValueError) as err:
                call()
            assert str(err.value) == message
        with pytest.raises(SettingError) as err:  # the trainer's checks, before the run directory is touched
            check_kernels(recipe, torch.device("cpu"))
        assert str(err.value) == message
        with pytest.raises(SettingError) as err:  # every entry point that builds a model
            build(recipe.model)
        assert str(err.value) == message
        clean_switches.delenv(name)
    build(recipe.model)


def test_the_places_that_read_a_switch_follow_it(clean_switches):
    """Each switch reaches the code it turns off: the SwiGLU's recomputation and the grouped weight gradients run on
    CPU; the fused kernels' predicates are checked as functions (their kernels need a GPU or the interpreter)."""
    from memtrain.model import anchor
    from memtrain.model.grouped_linear import _applies
    from memtrain.model.swiglu import recompute_applies
    from memtrain.model.titans import memory

    g = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(1, 2, 4, 8)
    cos = sin = torch.ones(4, 8)
    fused = {switches.TITANS_FUSED_PROLOGUE: memory.fused_prologue, switches.TITANS_FUSED_OUTPUT: memory.fused_output,
             switches.TITANS_FUSED_READ: memory.fused_read, switches.TITANS_FUSED_CONV: memory.fused_conv}
    clean_switches.setattr(anchor, "FUSED_ROPE_DEVICES", ("cuda", "cpu"))
    checks = {switches.SWIGLU_RECOMPUTE: lambda: recompute_applies(g, g, w),
              switches.GROUPED_WGRAD: lambda: _applies(g, True),
              switches.FUSED_ROPE: lambda: anchor.fused_rope_applies(x, cos, sin), **fused}
    assert checks.keys() == switches.FLAGS.keys()
    for name, applies in checks.items():
        assert applies() is True, name
        clean_switches.setenv(name, "0")
        assert applies() is False, name
        clean_switches.setenv(name, "off")  # read as on before; now refused where it is read
        with pytest.raises(ValueError, match=f"^{name}='off': expected 0"):
            applies()
        clean_switches.delenv(name)


def test_memtrain_train_refuses_a_bad_switch_in_one_line_and_writes_nothing(tmp_path):
    """The command line: exit 2, one line on stderr, no run directory (the check comes before the prepared data is
    read, so none is needed here)."""
    import yaml

    run_dir = tmp_path / "runs" / "r"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**TINY, "run": {"name": "r", "dir": str(run_dir)},
                                                     "data": {**TINY["data"], "dir": str(tmp_path / "data")}}))
    env = {**os.environ, switches.GROUPED_WGRAD: "false"}
    out = subprocess.run([sys.executable, "-m", "memtrain", "train", str(tmp_path / "r.yaml")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"memtrain: MEMTRAIN_GROUPED_WGRAD='false': expected 0 (turns off "
        f"{switches.FLAGS[switches.GROUPED_WGRAD]}) or 1 (on, the default; or unset it)"], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not run_dir.exists() and sorted(os.listdir(tmp_path)) == ["r.yaml"]
