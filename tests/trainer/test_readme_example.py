"""The README's example config for a user's own data is a config the trainer accepts, as written."""

from __future__ import annotations

import re
from pathlib import Path

from trainer_svc.config import load

ROOT = Path(__file__).resolve().parents[2]


def test_the_your_data_example_config_loads(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Your data", 1)[1].split("\n### ", 1)[0]
    (example,) = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    path = tmp_path / "example.toml"
    path.write_text(example)
    cfg = load(path)
    assert cfg.data.task == "file" and cfg.data.chat and cfg.data.system_prompt
    assert cfg.reward.functions == ["correct", "my_rewards:brevity"]
