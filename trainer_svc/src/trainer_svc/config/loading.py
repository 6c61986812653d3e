"""Loading a TOML file into a Config (errors name the file, the key and the reason), the --smoke
shape of a run, and the resolved config's TOML."""

from __future__ import annotations

from pathlib import Path

import msgspec

from protocol import exit_codes

from .root import Config
from .train_loss import BUILTIN_REWARDS, RETIRED_REWARD_KEYS


class ConfigError(ValueError):
    """The config cannot be used; the message names the file, the key and the reason."""

    exit_code = exit_codes.USAGE


def load(path: str | Path, *, smoke: bool = False) -> Config:
    path = Path(path)
    try:
        text = path.read_bytes()
        config = msgspec.toml.decode(text, type=Config)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_retired_reward_keys(text) or exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    config = _resolve_paths(config)
    return smoke_shape(config) if smoke else config


def _retired_reward_keys(text: bytes) -> str | None:
    """What to write instead, for a [reward] section with the keys reward functions replaced."""
    section = msgspec.toml.decode(text).get("reward")
    retired = [key for key in RETIRED_REWARD_KEYS if isinstance(section, dict) and key in section]
    if not retired:
        return None
    defaults = {"correct": 1.0, "format_weight": 0.0, "overlong_weight": 1.0}
    weights = [float(section.get(key, default)) for key, default in defaults.items()]
    return (
        f"reward.{', reward.'.join(retired)}: replaced by reward.functions and reward.weights (one weight per "
        f"function). The same reward is: functions = {list(BUILTIN_REWARDS)}, weights = {weights}".replace("'", '"')
    )


def _resolve_paths(config: Config) -> Config:
    """Relative paths are taken from the working directory (where the command runs), resolved
    once here so that every later reader, and the resolved config, sees absolute paths."""

    def resolve(value: str) -> str:
        return str(Path(value).absolute()) if value else value

    return msgspec.structs.replace(
        config,
        sft=msgspec.structs.replace(config.sft, base=resolve(config.sft.base)) if config.sft else None,
        run=msgspec.structs.replace(config.run, dir=resolve(config.run.dir)),
        model=msgspec.structs.replace(config.model, path=resolve(config.model.path)),
        data=msgspec.structs.replace(
            config.data, path=resolve(config.data.path), band_file=resolve(config.data.band_file)
        ),
        band=msgspec.structs.replace(config.band, out=resolve(config.band.out)),
        publish=msgspec.structs.replace(
            config.publish, dir=resolve(config.publish.dir), slots_dir=resolve(config.publish.slots_dir)
        ),
        rollout=msgspec.structs.replace(
            config.rollout, spool=resolve(config.rollout.spool), rollout_venv=resolve(config.rollout.rollout_venv)
        ),
    )


def smoke_shape(config: Config) -> Config:
    """`--smoke`: the same run, tiny: a few small steps, to check a setup end to end.

    It never touches the run's files: it has a run directory of its own (`<run.dir>-smoke`), its
    own published weights (`<publish.dir>-smoke`; a publish.dir inside run.dir moves into the
    smoke's) and, spawning its own worker, its own spool the same way. With rollout.spawn = false
    it uses the run's spool, where the workers are; its request ids start with its own run
    directory's name. A smoke directory that would be, hold or lie in one of the run's is refused."""
    run_dir = config.run_dir
    smoke_dir = run_dir.with_name(run_dir.name + "-smoke")

    def own(path: Path) -> Path:
        if path.is_relative_to(run_dir):
            return smoke_dir / path.relative_to(run_dir)
        return path.with_name(path.name + "-smoke")

    spool = str(config.spool_dir)  # without a worker of its own: the workers' spool
    if config.rollout.spawn:
        spool = str(own(config.spool_dir)) if config.rollout.spool else ""
    smoke = msgspec.structs.replace(
        config,
        run=msgspec.structs.replace(config.run, dir=str(smoke_dir)),
        rollout=msgspec.structs.replace(config.rollout, spool=spool, prompts_per_step=4, samples_per_prompt=4),
        train=msgspec.structs.replace(
            config.train,
            steps=3,
            grad_accum=min(config.train.grad_accum, 2),
            updates_per_batch=min(config.train.updates_per_batch, 2),
            warmup_steps=0,
        ),
        publish=msgspec.structs.replace(
            config.publish, every=1, dir=str(own(config.publish_dir)) if config.publish.dir else ""
        ),
        checkpoint=msgspec.structs.replace(config.checkpoint, every=1),
    )
    _check_apart(config, smoke)
    return smoke


def _check_apart(config: Config, smoke: Config) -> None:
    """Refuse a smoke directory that is, holds or lies in one of the run's directories."""
    theirs = {"run.dir": config.run_dir, "publish.dir": config.publish_dir, "rollout.spool": config.spool_dir}
    ours = {"run directory": smoke.run_dir, "published weights": smoke.publish_dir}
    if config.rollout.spawn:
        ours["spool"] = smoke.spool_dir
    for what, mine in ours.items():
        for key, path in theirs.items():
            if mine.is_relative_to(path) or path.is_relative_to(mine):
                raise ConfigError(
                    f"--smoke would write its {what} into {mine}, which is or shares a directory with the run's {key} "
                    f"({path}); a smoke run never touches the run's files. Give the run a {key} apart from "
                    f"{mine} (the smoke run's directories are named after the run's, ending in -smoke)"
                )


def dump(config: Config) -> bytes:
    """TOML of the resolved config; sections and keys that are not set (None) are left out, as
    TOML has no null (loaded again, they are None: their default)."""

    def unset_left_out(value):
        if isinstance(value, dict):
            return {k: unset_left_out(v) for k, v in value.items() if v is not None}
        return value

    return msgspec.toml.encode(unset_left_out(msgspec.to_builtins(config)))
