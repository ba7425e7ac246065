"""Recipes: loading, overrides, durations, and one clear error per mistake."""

from pathlib import Path

import pytest

from memtrain.config import Duration, RecipeError, load_recipe, parse_size, recipe_from_dict
from memtrain.launcher.cli import main

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.max_steps > 0
    assert recipe.tokens_per_step % recipe.data.seq_len == 0


def test_sizes_and_durations():
    assert parse_size("64K") == 64_000
    assert parse_size("2Mi") == 2 * 2**20
    assert parse_size("2^40") == 2**40
    assert parse_size("1.1T") == 1_100_000_000_000
    assert Duration.parse(100) == Duration(100, "steps")
    assert Duration.parse("10k steps") == Duration(10_000, "steps")
    assert Duration.parse("2B tokens") == Duration(2_000_000_000, "tokens")
    # Token durations round up to whole steps.
    assert Duration.parse("1000 tokens").to_steps(300) == 4
    with pytest.raises(ValueError, match="expected a count like 4096"):
        Duration.parse("ten steps")


def test_openlm_160m_paper_schedule_in_steps():
    r = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "openlm-160m.yaml")
    assert r.tokens_per_step == 2**20
    assert r.max_steps == 2**20  # 2^40 tokens / 2^20 tokens per step
    assert r.steps(r.train.schedule.warmup) == 10_000
    assert r.train.optimizer.betas == [0.9, 0.95]


def test_overrides_are_typed_and_nested():
    r = recipe_from_dict({}, ["train.max_steps=20", "model.tie_embeddings=true", "train.optimizer.lr=1e-3",
                              "data.sources=[a.jsonl, b.jsonl]", "train.schedule.warmup=5 steps"])
    assert r.max_steps == 20 and r.model.tie_embeddings is True
    assert r.train.optimizer.lr == pytest.approx(1e-3)
    assert r.data.sources == ["a.jsonl", "b.jsonl"]
    assert r.steps(r.train.schedule.warmup) == 5


@pytest.mark.parametrize("overrides, key", [
    (["train.max_stepz=3"], "train.max_stepz"),  # unknown key
    (["trian.max_steps=3"], "trian"),  # unknown section
    (["model.d_model=wide"], "model.d_model"),  # wrong type
    (["model.qk_norm=1"], "model.qk_norm"),  # bool is not an int
    (["parallel.precision=fp16"], "parallel.precision"),  # not a choice
    (["parallel.zero_stage=4"], "parallel.zero_stage"),
    (["train.schedule.warmup=200 steps"], "train.schedule.warmup"),  # warmup >= max_steps (100)
    (["train.global_batch_tokens=1000"], "train.global_batch_tokens"),  # not a multiple of seq_len
    (["model.n_heads=6"], "model.head_dim"),  # 512 not divisible by 6
    (["model.n_kv_heads=3"], "model.n_kv_heads"),  # 8 heads not a multiple of 3
    (["data.seq_len=4096"], "data.seq_len"),  # beyond model.max_seq_len
    (["train.schedule.min_lr=1.0"], "train.schedule.min_lr"),  # above lr
    (["slurm.time=forever"], "slurm.time"),
    (["model.norm.eps=1"], "model.norm"),
    (["noequals"], ""),
])
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({}, overrides)
    assert err.value.key == key
    assert str(err.value).startswith(f"recipe error: {key}" if key else "recipe error")


def test_unknown_key_in_file_suggests_the_right_one(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  max_step: 10\n")
    with pytest.raises(RecipeError, match=r"train.max_step: unknown key; did you mean 'train.max_steps'"):
        load_recipe(path)


def test_cli_error_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text("run: {name: bad}\ntrain: {max_steps: 10, micro_batch_size: 3}\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.micro_batch_size" in err
    assert main(["train", str(path), "train.micro_batch_size=4", "bogus.key=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [path]  # no run or data directory was created


def test_recipe_show_prints_recipe_deepspeed_config_and_parameters(capsys):
    path = Path(__file__).resolve().parents[1] / "recipes" / "openlm-160m.yaml"
    assert main(["recipe", "show", str(path), "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "model parameters: 163510016" in out
    assert '"train_micro_batch_size_per_gpu": 8' in out and '"gradient_accumulation_steps": 1' in out
    assert '"tensorboard": {\n    "enabled": false' in out
    assert "rope_theta: 100000.0" in out


def test_broken_yaml_is_one_line_naming_the_position(tmp_path):
    from memtrain.config import load_recipe

    path = tmp_path / "bad.yaml"
    path.write_text("model: {type: titans, titans: {kernel: [1")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert "\n" not in message and "not valid YAML at line 1, column 42" in message


def test_a_key_given_twice_is_one_line_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys without a word (`max_steps: 10` above `max_steps: 20` trained 20
    steps); memtrain's loader refuses them, nested ones too. A merge key's entries may still be overridden."""
    from memtrain.config import load_recipe

    path = tmp_path / "dup.yaml"
    path.write_text("run: {name: x}\ntrain:\n  max_steps: 10\n  global_batch_tokens: 4096\n  max_steps: 20\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == (f"recipe error: {path} is not valid YAML at line 5, column 3: the key 'max_steps' is "
                              "given twice (first at line 3); keep one")
    path.write_text("run: {name: x, seed: 1, seed: 2}\n")
    with pytest.raises(RecipeError, match="the key 'seed' is given twice"):
        load_recipe(path)
    path.write_text("x-common: &common {max_steps: 10, micro_batch_size: 4}\ntrain:\n  <<: *common\n  max_steps: 30\n")
    import yaml

    from memtrain.config import RecipeLoader

    assert yaml.load(path.read_text(), Loader=RecipeLoader)["train"] == {"max_steps": 30, "micro_batch_size": 4}


def test_a_recipe_that_is_a_folder_says_so(tmp_path):
    from memtrain.config import load_recipe

    with pytest.raises(RecipeError, match=rf"recipe '{tmp_path}' is a folder; pass a YAML recipe file"):
        load_recipe(tmp_path)
