"""The tiny Llama model: reproducible files, a character tokenizer that round-trips, loadable by
transformers, readable by other users, and built atomically."""

from __future__ import annotations

import os
import stat

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rollout_svc.tiny_model as tiny_model
from rollout_svc.tiny_model import (
    BOS_ID,
    CHARACTERS,
    EOS_ID,
    HEAD_DIM,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    build,
    vocab_size,
)
from rollout_svc.weights import WeightsPolicy, check_tokenizer_fits

pytestmark = pytest.mark.timeout(120)

PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7F))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three builds: seed 0 twice (the second from a relative path), seed 1 once."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    first = build(root / "seed0-a", seed=0)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        second = build("seed0-b", seed=0)
    finally:
        os.chdir(cwd)
    other = build(root / "seed1", seed=1)
    return {"seed0": first, "seed0-again": second, "seed1": other}


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["seed0"])


def files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- reproducibility -----------------------------------------------------------------------------


def test_build_returns_the_absolute_directory(models):
    assert models["seed0"].is_absolute() and models["seed0-again"].is_absolute()
    assert models["seed0-again"] == models["seed0"].parent / "seed0-b"


def test_the_same_seed_gives_byte_identical_files(models):
    a, b = files(models["seed0"]), files(models["seed0-again"])
    assert set(a) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_another_seed_changes_only_the_weights(models):
    a, c = files(models["seed0"]), files(models["seed1"])
    assert a.keys() == c.keys()
    assert sorted(name for name in a if a[name] != c[name]) == ["model.safetensors"]


def test_no_staging_directory_is_left_next_to_the_builds(models):
    assert sorted(p.name for p in models["seed0"].parent.iterdir()) == ["seed0-a", "seed0-b", "seed1"]


def test_files_are_readable_by_other_users(models):
    directory = models["seed0"]
    assert stat.S_IMODE(directory.stat().st_mode) & 0o005 == 0o005  # list and enter
    for path in directory.iterdir():
        assert path.is_file()
        assert stat.S_IMODE(path.stat().st_mode) & 0o004, path.name


# -- tokenizer -----------------------------------------------------------------------------------


def test_the_tokenizer_is_fast_with_the_special_tokens(tokenizer):
    from transformers import PreTrainedTokenizerFast

    assert tokenizer.is_fast and isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
        UNK_ID,
    )
    assert tokenizer.convert_ids_to_tokens(list(range(4))) == SPECIAL_TOKENS
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS) <= vocab_size()


def test_every_printable_ascii_character_is_one_token_and_round_trips(tokenizer):
    assert set(PRINTABLE_ASCII + "\n") == set(CHARACTERS)
    ids = []
    for char in PRINTABLE_ASCII + "\n":
        encoded = tokenizer(char, add_special_tokens=False)["input_ids"]
        assert len(encoded) == 1 and encoded[0] >= len(SPECIAL_TOKENS), repr(char)
        assert tokenizer.decode(encoded) == char
        ids.append(encoded[0])
    assert len(set(ids)) == len(ids)  # distinct characters, distinct ids
    assert max(ids) < vocab_size()


def test_the_tokenizer_adds_no_special_tokens_and_keeps_spaces(tokenizer):
    text = '  Hello ,  world !\n\n x = [1, 2] ; y\'s "ok" '
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_unknown_characters_become_unk(tokenizer):
    assert tokenizer("\té", add_special_tokens=False)["input_ids"] == [UNK_ID, UNK_ID]


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=CHARACTERS, max_size=80))
def test_mixed_text_round_trips_one_token_per_character(tokenizer, text):
    assume(not any(token in text for token in SPECIAL_TOKENS))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ["a<s>b", "</s>", "<unk>", "x<pad>"])
def test_text_spelling_a_special_token_is_still_one_token_per_character(tokenizer, text):
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == len(text)


# -- the model -----------------------------------------------------------------------------------


def test_transformers_loads_the_model(models, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["seed0"])
    config = model.config
    assert config.model_type == "llama"
    shape = (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.head_dim)
    assert shape == (vocab_size(), 128, 2, HEAD_DIM)
    assert config.tie_word_embeddings is False
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tokenizer("2+2=4")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, vocab_size())
    assert torch.isfinite(logits).all()


def test_the_weights_policy_accepts_the_build(models, tokenizer):
    weights = WeightsPolicy([str(models["seed0"].parent)]).inspect(str(models["seed0"]))
    assert weights.shards == ("model.safetensors",)
    assert weights.config["vocab_size"] == vocab_size() and vocab_size() % 64 == 0
    check_tokenizer_fits(weights, len(tokenizer))


# -- refusals and atomicity ----------------------------------------------------------------------


def test_an_existing_directory_is_refused(models):
    before = files(models["seed0"])
    with pytest.raises(FileExistsError, match="exists"):
        build(models["seed0"])
    assert files(models["seed0"]) == before


def test_an_existing_empty_directory_or_file_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "empty", tmp_path / "file"):
        with pytest.raises(FileExistsError):
            build(out)
    assert sorted(os.listdir(tmp_path)) == ["empty", "file"]
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("hidden", [100, 32, 65])
def test_a_hidden_size_that_is_not_a_multiple_of_64_is_refused(tmp_path, hidden):
    with pytest.raises(ValueError, match=f"hidden size {hidden} must be a multiple of the head size 64"):
        build(tmp_path / "m", hidden=hidden)
    assert os.listdir(tmp_path) == []


def test_a_build_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    def broken(model_dir):
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "_pin_tokenizer_class", broken)
    with pytest.raises(OSError, match="disk full"):
        build(tmp_path / "m", layers=1, hidden=64, intermediate=64)
    assert os.listdir(tmp_path) == []


def test_a_tokenizer_filled_to_a_vocabulary_decodes_every_id_and_encodes_as_before(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tiny_model.write_tokenizer(tmp_path, max_positions=64, vocab_size=1000)
    filled = AutoTokenizer.from_pretrained(tmp_path)
    assert len(filled) == 1000
    text = "12+7= Hello, world!"
    assert filled(text)["input_ids"] == tokenizer(text)["input_ids"]
    fillers = list(range(len(tokenizer), 1000))
    assert filled.decode(fillers[:2]) == f"<|{fillers[0]}|><|{fillers[1]}|>"
    assert all(filled.convert_ids_to_tokens(i) is not None for i in fillers)


def test_a_vocabulary_smaller_than_the_characters_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 10 is below"):
        tiny_model.write_tokenizer(tmp_path, max_positions=64, vocab_size=10)
