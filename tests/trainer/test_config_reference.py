"""The config reference comes from the code: every field has a description, the walk sees every
field of every section, and docs/config.md is what the code writes today."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from trainer_svc.config import TrainConfig, load
from trainer_svc.config.reference import REGENERATE, code_placeholders, fields, markdown, sections

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_what_the_code_writes():
    written = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == markdown(), f"docs/config.md is out of date with the config's descriptions; run: {REGENERATE}"


def test_every_field_has_a_description():
    undocumented = [f"{doc.section}.{doc.name}" for doc in fields() if not doc.description.strip()]
    assert not undocumented, f"config fields without a msgspec.Meta(description=...): {undocumented}"


def test_every_section_has_a_docstring():
    assert [name for name, struct, _ in sections() if not (struct.__doc__ or "").strip()] == []


def test_the_walk_yields_each_field_of_each_section_once():
    walked = [(doc.section, doc.attr) for doc in fields()]
    expected = [(name, info.name) for name, struct, _ in sections() for info in msgspec.structs.fields(struct)]
    assert walked == expected and len(set(walked)) == len(walked)
    assert {name for name, _, _ in sections()} >= {"run", "model", "train", "loss", "lora", "env"}


def test_a_field_reads_with_its_type_default_and_description():
    docs = {(doc.section, doc.name): doc for doc in fields()}
    steps = docs["train", "steps"]
    assert (steps.type, steps.default, steps.description) == ("int >= 1", "200", "optimizer steps")
    assert docs["run", "dir"].default == "required"
    assert docs["loss", "clip_low"].type == "float >= 0 <= 1, or unset"
    assert docs["env", "class"].attr == "class_"  # the TOML key, not the attribute
    assert docs["rollout", "top_p"].type == "float > 0 <= 1"  # constraints survive the description


def test_descriptions_do_not_change_what_loads():
    # A description sits beside the constraint in the same Annotated: the constraint still refuses.
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 1 - at `\$.steps`"):
        msgspec.convert({"steps": 0}, TrainConfig)


def test_the_config_command_prints_each_keys_value_default_and_description(monkeypatch):
    # The real entry point, on a shipped config: its values (relative paths resolved), beside the reference.
    shipped = ROOT / "configs" / "demo.toml"
    out = subprocess.run(
        [sys.executable, "-m", "trainer_svc.cli", "config", str(shipped)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    monkeypatch.chdir(ROOT)  # the command resolves relative paths from its working directory
    cfg = load(shipped)
    lines = out.splitlines()
    at = lines.index(f"prompts_per_step = {cfg.rollout.prompts_per_step}")
    assert lines[at + 1] == (
        "    default 16; prompts trained on per optimizer step (each sampled samples_per_prompt times)"
    )
    assert f'dir = "{cfg.run.dir}"' in lines and cfg.run.dir != "runs/demo"  # resolved, as the run sees it
    assert "[env]  # unset" in lines and "[train]" in lines


def test_placeholders_show_in_markdown_as_code():
    # Markdown reads a bare <run.dir> as an HTML tag and shows nothing: outside code spans, no "<word>".
    outside_code = re.sub(r"`[^`]*`", "", (ROOT / "docs" / "config.md").read_text())
    assert not re.findall(r"<[\w.-]+>", outside_code)
    assert code_placeholders("default <run.dir>/spool.") == "default `<run.dir>/spool`."
    assert code_placeholders("(<x>) and `<y>` and a < b") == "(`<x>`) and `<y>` and a < b"
