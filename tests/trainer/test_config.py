"""The run config: the shipped demo loads; every bad file fails with ConfigError naming the file,
the key path and the reason; relative paths become absolute once, at load; --smoke's shape;
dump() round trips."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from trainer_svc.config import Config, ConfigError, RewardConfig, dump, load, smoke_shape

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"

MINIMAL = '[run]\ndir = "run"\n[model]\npath = "model"\n'


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_demo_config_loads_with_its_values():
    cfg = load(DEMO)
    assert isinstance(cfg, Config)
    assert cfg.rollout.prompts_per_step == 16 and cfg.rollout.samples_per_prompt == 8
    assert cfg.rollout.worker_args == ["--max-model-len", "64"]
    assert cfg.train.betas == (0.9, 0.99)
    assert cfg.data.arithmetic_high == 20 and cfg.data.held_out == 41
    assert cfg.sft is not None and cfg.sft.problems == 200 and cfg.sft.stop_at_accuracy == 0.3
    assert cfg.checkpoint.keep_last == 3 and cfg.checkpoint.every == 50 and cfg.publish.every == 1
    # the file writes out the default reward; keys it leaves out keep their defaults
    assert cfg.reward == RewardConfig()
    assert cfg.reward.functions == ["correct", "format", "overlong"] and cfg.reward.weights == [1.0, 0.0, 1.0]
    assert cfg.reward.overlong_buffer == 0 and cfg.reward.timeout_s == 30.0


def test_minimal_config_takes_every_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(write(tmp_path, MINIMAL))
    assert cfg.train.steps == 200 and cfg.rollout.samples_per_prompt == 8
    assert cfg.data.task == "arithmetic" and cfg.sft is None
    assert cfg.spool_dir == tmp_path / "run" / "spool"
    assert cfg.publish_dir == tmp_path / "run" / "weights" and cfg.publish.dtype == "auto"


BAD = {
    "unknown section": (MINIMAL + "[bogus]\nx = 1\n", "`bogus`", "unknown field"),
    "unknown key": (MINIMAL + "[train]\nstepz = 3\n", "`$.train`", "unknown field `stepz`"),
    "wrong type": (MINIMAL + '[train]\nsteps = "many"\n', "`$.train.steps`", "Expected `int`, got `str`"),
    "out of range": (MINIMAL + "[train]\nsteps = 0\n", "`$.train.steps`", ">= 1"),
    "float out of range": (MINIMAL + "[rollout]\ntop_p = 1.5\n", "`$.rollout.top_p`", "<= 1.0"),
    "samples_per_prompt 1": (MINIMAL + "[rollout]\nsamples_per_prompt = 1\n", "`$.rollout.samples_per_prompt`", ">= 2"),
    "bad choice": (MINIMAL + '[loss]\ndenominator = "tokens"\n', "`$.loss.denominator`", "'tokens'"),
    "betas of one": (MINIMAL + "[train]\nbetas = [0.9]\n", "`$.train.betas`", "length 2"),
    "task file without path": (
        MINIMAL + '[data]\ntask = "file"\n',
        "`$.data`",
        "data.path must name a JSONL or Parquet file",
    ),
    "chat on arithmetic": (MINIMAL + "[data]\nchat = true\n", "`$.data`", "apply to prompt files"),
    "arithmetic_high < low": (
        MINIMAL + "[data]\narithmetic_low = 5\narithmetic_high = 2\n",
        "`$.data`",
        "arithmetic_high must be >= data.arithmetic_low",
    ),
    "unknown arithmetic op": (MINIMAL + '[data]\narithmetic_ops = "+/"\n', "`$.data`", "data.arithmetic_ops must be"),
    "error_retries out of range": (MINIMAL + "[rollout]\nerror_retries = -1\n", "`$.rollout.error_retries`", ">= 0"),
    "negative reward shaping": (
        MINIMAL + '[reward]\nfunctions = ["correct", "overlong"]\nweights = [1.0, -1.0]\n',
        "`$.reward`",
        "reward.weights[1] = -1.0 for the built-in 'overlong' is negative",
    ),
    "a weight per function": (
        MINIMAL + '[reward]\nfunctions = ["correct", "my.mod:fn"]\n',
        "`$.reward`",
        "reward.weights has 3 values for 2 reward.functions",
    ),
    "a function name of neither kind": (
        MINIMAL + '[reward]\nfunctions = ["correct", "my/mod.py"]\nweights = [1.0, 1.0]\n',
        "`$.reward`",
        "reward.functions[1] = 'my/mod.py' is neither a built-in (correct, format, overlong) nor",
    ),
    "a function named twice": (
        MINIMAL + '[reward]\nfunctions = ["correct", "correct"]\nweights = [1.0, 1.0]\n',
        "`$.reward`",
        "names a function twice",
    ),
    "no function": (MINIMAL + "[reward]\nfunctions = []\nweights = []\n", "`$.reward`", "reward.functions is empty"),
    "an infinite weight": (
        MINIMAL + '[reward]\nfunctions = ["a.b:c"]\nweights = [inf]\n',
        "`$.reward`",
        "reward.weights[0] (for 'a.b:c') = inf is not a finite number",
    ),
    "an env class that is no class name": (
        MINIMAL + '[env]\nclass = "my_envs.py"\n',
        "`$.env`",
        "env.class = 'my_envs.py' does not name a class",
    ),
    "an env without a class": (MINIMAL + "[env]\nmax_turns = 2\n", "`class`", "missing required field"),
    "missing [run]": ('[model]\npath = "model"\n', "`run`", "missing required field"),
    "missing run.dir": ('[run]\nseed = 1\n[model]\npath = "model"\n', "`dir`", "missing required field"),
    "not TOML": ("[run\ndir = ", "", "not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_config_names_key_and_reason(tmp_path, case):
    text, key, reason = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert key in message, message
    assert reason in message, message


@pytest.mark.parametrize(
    "section, weights",
    [
        ("correct = 2.0\n", "[2.0, 0.0, 1.0]"),
        ("format_weight = 0.5\noverlong_buffer = 2\n", "[1.0, 0.5, 1.0]"),
        ("correct = 1.0\nformat_weight = 0.1\noverlong_weight = 0.3\n", "[1.0, 0.1, 0.3]"),
    ],
)
def test_the_keys_reward_functions_replaced_are_refused_naming_what_to_write(tmp_path, section, weights):
    path = write(tmp_path, MINIMAL + "[reward]\n" + section)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: reward.") and "replaced by reward.functions and reward.weights" in message
    assert f'functions = ["correct", "format", "overlong"], weights = {weights}' in message, message
    # what it says to write loads, and is the same reward
    fixed = write(tmp_path, MINIMAL + f'[reward]\nfunctions = ["correct", "format", "overlong"]\nweights = {weights}\n')
    assert load(fixed).reward.weights == [float(w) for w in weights.strip("[]").split(", ")]


def test_an_env_section_loads_with_its_class(tmp_path):
    cfg = load(write(tmp_path, MINIMAL + '[env]\nclass = "my_envs:AddThenAdd"\nmax_turns = 2\n'))
    assert (cfg.env.class_, cfg.env.max_turns, cfg.env.drift) == ("my_envs:AddThenAdd", 2, "end")
    assert load(write(tmp_path, dump(cfg).decode(), "again.toml")).env == cfg.env  # the resolved config, read again
    assert load(write(tmp_path, MINIMAL, "none.toml")).env is None


def test_missing_file_is_a_config_error(tmp_path):
    path = tmp_path / "nowhere.toml"
    with pytest.raises(ConfigError, match="no such config file") as info:
        load(path)
    assert str(path) in str(info.value)


def test_config_path_that_is_a_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load(tmp_path)


def test_relative_paths_become_absolute_against_the_working_directory(tmp_path, monkeypatch):
    # The file lives elsewhere: paths are taken from where the command runs, not from the file.
    config_dir, work = tmp_path / "configs", tmp_path / "work"
    config_dir.mkdir()
    work.mkdir()
    path = write(
        config_dir,
        '[run]\ndir = "runs/a"\n[model]\npath = "models/m"\n'
        '[data]\ntask = "file"\npath = "data/train.jsonl"\n'
        '[rollout]\nspool = "spool"\nrollout_venv = "venvs/rollout"\n'
        '[sft]\nbase = "build/tiny"\n',
    )
    monkeypatch.chdir(work)
    cwd = Path.cwd()
    cfg = load(path)
    assert cfg.run.dir == str(cwd / "runs/a")
    assert cfg.model.path == str(cwd / "models/m")
    assert cfg.data.path == str(cwd / "data/train.jsonl")
    assert cfg.rollout.spool == str(cwd / "spool")
    assert cfg.rollout.rollout_venv == str(cwd / "venvs/rollout")
    assert cfg.sft.base == str(cwd / "build/tiny")
    assert cfg.spool_dir == cwd / "spool"


def test_absolute_and_empty_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    cfg = load(write(tmp_path, f'[run]\ndir = "{elsewhere}/run"\n[model]\npath = "{elsewhere}/m"\n'))
    assert cfg.run.dir == f"{elsewhere}/run" and cfg.model.path == f"{elsewhere}/m"
    assert cfg.data.path == "" and cfg.rollout.spool == ""  # empty means "not set", not the cwd
    assert cfg.spool_dir == elsewhere / "run" / "spool"


def test_smoke_shape_is_small_and_runs_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = (
        MINIMAL
        + "[rollout]\nprompts_per_step = 32\nsamples_per_prompt = 16\n"
        + "[train]\nsteps = 500\ngrad_accum = 8\nwarmup_steps = 20\nlr = 3e-5\n[checkpoint]\nevery = 10\n"
    )
    full = load(write(tmp_path, text))
    smoke = load(tmp_path / "run.toml", smoke=True)
    assert smoke == smoke_shape(full)
    assert smoke.train.steps == 3 and smoke.train.warmup_steps == 0
    assert smoke.rollout.prompts_per_step * smoke.rollout.samples_per_prompt <= 16
    assert smoke.rollout.samples_per_prompt >= 2
    assert 1 <= smoke.train.grad_accum <= 2
    assert smoke.checkpoint.every == 1
    assert smoke.run.dir == str(tmp_path / "run-smoke")
    assert smoke.spool_dir == tmp_path / "run-smoke" / "spool"  # never the full run's spool
    # everything else is the same run
    assert smoke.model == full.model and smoke.data == full.data and smoke.loss == full.loss
    assert smoke.train.lr == full.train.lr and smoke.run.seed == full.run.seed
    # and it is still a valid config
    assert msgspec.convert(msgspec.to_builtins(smoke), Config) == smoke


def test_smoke_shape_has_directories_of_its_own_where_the_run_names_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = MINIMAL + '[publish]\ndir = "/srv/weights/run"\n[rollout]\nspool = "/srv/spool"\n'
    smoke = load(write(tmp_path, text), smoke=True)
    assert smoke.run_dir == tmp_path / "run-smoke"
    assert smoke.publish_dir == Path("/srv/weights/run-smoke")  # never the run's published steps
    assert smoke.spool_dir == Path("/srv/spool-smoke")  # its own worker serves its own spool
    inside = MINIMAL + f'[publish]\ndir = "{tmp_path}/run/weights"\n'
    assert load(write(tmp_path, inside), smoke=True).publish_dir == tmp_path / "run-smoke" / "weights"


@pytest.mark.parametrize("spool", ["", "/srv/spool"])
def test_smoke_shape_without_a_worker_of_its_own_uses_the_workers_spool(tmp_path, monkeypatch, spool):
    monkeypatch.chdir(tmp_path)
    full = load(write(tmp_path, MINIMAL + f'[rollout]\nspawn = false\nspool = "{spool}"\n'))
    smoke = smoke_shape(full)
    assert smoke.spool_dir == full.spool_dir and smoke.run_dir == tmp_path / "run-smoke"


@pytest.mark.parametrize(
    "section, clash",
    [('[publish]\ndir = "run-smoke"\n', "publish.dir"), ('[rollout]\nspool = "run-smoke/spool"\n', "rollout.spool")],
)
def test_smoke_shape_refuses_directories_it_would_share_with_the_run(tmp_path, monkeypatch, section, clash):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, MINIMAL + section), smoke=True)
    message = str(info.value)
    assert "--smoke" in message and clash in message and str(tmp_path / "run-smoke") in message


def test_smoke_shape_keeps_a_grad_accum_of_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(write(tmp_path, MINIMAL), smoke=True).train.grad_accum == 1


@pytest.mark.parametrize("source", ["demo", "minimal", "everything set"])
def test_dump_round_trips(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    if source == "demo":
        cfg = load(DEMO)
    elif source == "minimal":
        cfg = load(write(tmp_path, MINIMAL))
    else:
        cfg = load(
            write(
                tmp_path,
                MINIMAL
                + '[data]\ntask = "file"\npath = "rows.jsonl"\ntemplate = "Q: {question}\\nA:"\n'
                + '[rollout]\nspawn = false\nspool = "/srv/spool"\nworker_args = ["--dtype", "float32"]\ntop_p = 0.95\n'
                + '[train]\nschedule = "cosine"\nbetas = [0.8, 0.95]\nlr = 1e-6\n'
                + '[loss]\nkl_coef = 0.05\ndenominator = "constant"\n'
                + '[reward]\nfunctions = ["correct", "pkg.mod:fn"]\nweights = [0.0, -0.5]\noverlong_buffer = 4\n',
            )
        )
    text = dump(cfg)
    assert isinstance(text, bytes)
    assert msgspec.toml.decode(text, type=Config) == cfg
    # what is written into the run directory is itself a loadable config
    assert load(write(tmp_path, text.decode(), "resolved.toml")) == cfg
