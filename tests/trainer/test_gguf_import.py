"""`trainer-svc import-gguf` on a tiny Llama written as a GGUF file with the `gguf` package's own
writer, as llama.cpp's converter writes one (q and k rows permuted, tied output left out, some
matrices quantized to Q8_0): the HF directory it gives holds the original weights, the tokenizer
with its chat template, an end of turn taken from the template, and the same bytes every time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf  # the trainer_svc[gguf] extra, which `make test` installs (through `make real-model`)
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from protocol import exit_codes
from protocol.weights_dir import FileEntry, files_content_id, weights_content_id
from trainer_svc.cli import app
from trainer_svc.weights.gguf_import import ImportMismatch, import_gguf, write_pin

sys.path.append(str(Path(__file__).resolve().parents[1]))  # manifest_check, shared with the other tiers
from manifest_check import verify  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as SmolLM2 and Qwen write it: a turn ends with <|im_end|>, which is not the eos here.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = ["the sum of two and three is five", "what is the capital of france", "hello world, 12+7=19"] * 20
TEXTS = ["the sum of 2 and 3", "hello <|im_start|>user\nworld<|im_end|>", "Unseen WORDS: é ü 42"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k (rotary halves interleaved): what the importer undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(w: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray]:
    """(what the file holds, what reading it back gives) for a tensor stored as `kind`."""
    Q = gguf.GGMLQuantizationType
    if kind == Q.Q8_0:
        packed = gguf.quants.quantize(w, Q.Q8_0)
        return packed, gguf.quants.dequantize(packed, Q.Q8_0)
    if kind == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    return w, w


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Llama GGUF file and what its HF tensors must be (in float32, HF layout)."""
    Q = gguf.GGMLQuantizationType
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tokenizer = _tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS

    def matrix(rows, cols):
        return rng.normal(0, 0.3, (rows, cols)).astype(np.float32)

    hf: dict[str, np.ndarray] = {}  # expected, HF names and layout
    stored: list[tuple[str, np.ndarray, object]] = []  # GGUF names and layout

    def put(gguf_name, hf_name, w, kind, heads=None):
        data, back = _stored(_permute(w, heads) if heads else w, kind)
        stored.append((gguf_name, data, kind))
        hf[hf_name] = _permute_back(back, heads) if heads else back

    def norm():
        return 1 + rng.normal(0, 0.1, HIDDEN).astype(np.float32)

    kv = KV_HEADS * head_dim
    put("token_embd.weight", "model.embed_tokens.weight", matrix(len(tokens), HIDDEN), Q.F16)
    for i in range(LAYERS):
        blk, attn, mlp = f"blk.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        put(f"{blk}.attn_q.weight", f"{attn}.q_proj.weight", matrix(HIDDEN, HIDDEN), Q.Q8_0, HEADS)
        put(f"{blk}.attn_k.weight", f"{attn}.k_proj.weight", matrix(kv, HIDDEN), Q.Q8_0, KV_HEADS)
        put(f"{blk}.attn_v.weight", f"{attn}.v_proj.weight", matrix(kv, HIDDEN), Q.F16)
        put(f"{blk}.attn_output.weight", f"{attn}.o_proj.weight", matrix(HIDDEN, HIDDEN), Q.Q8_0)
        put(f"{blk}.ffn_gate.weight", f"{mlp}.gate_proj.weight", matrix(FFN, HIDDEN), Q.Q8_0)
        put(f"{blk}.ffn_up.weight", f"{mlp}.up_proj.weight", matrix(FFN, HIDDEN), Q.F16)
        put(f"{blk}.ffn_down.weight", f"{mlp}.down_proj.weight", matrix(HIDDEN, FFN), Q.Q8_0)
        put(f"{blk}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", norm(), Q.F32)
        put(f"{blk}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", norm(), Q.F32)
    put("output_norm.weight", "model.norm.weight", norm(), Q.F32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control (special)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_chat_template(TEMPLATE)
    for name, data, kind in stored:
        writer.add_tensor(name, data, raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": path, "hf": hf, "tokenizer": tokenizer, "vocab": vocab}


def _permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "tiny-hf"
    return import_gguf(tiny_gguf["path"], out)


def test_the_weights_are_the_files_dequantized_in_bf16_with_the_tied_output_left_out(imported, tiny_gguf):
    from safetensors import safe_open

    with safe_open(imported.path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(tiny_gguf["hf"])  # no lm_head.weight: tied to the embeddings
        for name, expected in tiny_gguf["hf"].items():
            got = f.get_tensor(name)
            assert got.dtype == torch.bfloat16 and tuple(got.shape) == expected.shape, name
            assert torch.equal(got, torch.from_numpy(expected).to(torch.bfloat16)), name
    config = json.loads((imported.path / "config.json").read_text())
    assert "quantization_config" not in config and "transformers_version" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (HIDDEN, LAYERS, 2)
    assert imported.parameters == sum(w.size for w in tiny_gguf["hf"].values())


def test_transformers_loads_it_with_the_embeddings_tied(imported, tiny_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(imported.path)
    embed = torch.from_numpy(tiny_gguf["hf"]["model.embed_tokens.weight"]).to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, embed) and torch.equal(model.model.embed_tokens.weight, embed)


def test_the_tokenizer_gives_the_files_ids_and_renders_its_chat_template(imported, tiny_gguf):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(imported.path)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == tiny_gguf["tokenizer"].encode(text).ids, text
    assert (imported.path / "chat_template.jinja").read_text() == TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_generation_config_ends_a_reply_at_the_templates_end_of_turn_then_at_eos(imported, tiny_gguf):
    vocab = tiny_gguf["vocab"]
    generation = json.loads((imported.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [vocab["<|im_end|>"], vocab["<|endoftext|>"]] == imported.end_of_turn
    assert generation["bos_token_id"] == vocab["<|im_start|>"]


def test_the_manifest_holds_the_content_id_workers_report_and_every_files_checksums(imported):
    manifest = verify(imported.path, checksums=True)  # sizes and crc32c, as published weights are checked
    assert weights_content_id(str(imported.path)) == manifest.content_id == imported.content_id
    files = sorted(p.name for p in imported.path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest.files) == files
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    recomputed = {name: FileEntry(size=0, sha256=_sha256(imported.path / name)) for name in files}
    assert files_content_id(recomputed) == imported.content_id


def test_two_imports_give_the_same_bytes(imported, tiny_gguf, tmp_path):
    again = import_gguf(tiny_gguf["path"], tmp_path / "again")
    names = sorted(p.name for p in imported.path.iterdir())
    assert names == sorted(p.name for p in again.path.iterdir())
    for name in names:
        assert (imported.path / name).read_bytes() == (again.path / name).read_bytes(), name
    assert again.content_id == imported.content_id


def test_a_pin_lets_a_matching_import_in_and_keeps_a_differing_one_out(imported, tiny_gguf, tmp_path):
    pin = tmp_path / "pin.json"
    write_pin(imported.path, pin)
    out = tmp_path / "pinned"
    assert import_gguf(tiny_gguf["path"], out, expect=pin).content_id == imported.content_id
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    wrong = json.loads(pin.read_text())
    wrong["content_id"] = "sha256-0000000000000000"
    wrong["files"]["tokenizer.json"] = "0" * 64
    wrong["made_with"]["transformers"] = "0.0.1"
    pin.write_text(json.dumps(wrong))
    with pytest.raises(ImportMismatch) as refused:
        import_gguf(tiny_gguf["path"], out, expect=pin)
    message = str(refused.value)
    assert f"is {imported.content_id}, pinned sha256-0000000000000000" in message
    assert "tokenizer.json: sha256" in message and "model.safetensors" not in message
    assert "made with transformers" in message and "the pin with 0.0.1" in message and "--write-pin" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the pinned directory stays as it was
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_the_command_imports_and_refuses_a_file_that_is_not_gguf(tiny_gguf, tmp_path):
    runner = CliRunner()
    done = runner.invoke(app, ["import-gguf", str(tiny_gguf["path"]), str(tmp_path / "out"), "--dtype", "float32"])
    assert done.exit_code == 0, done.output
    assert "content id sha256-" in done.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32"
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    refused = runner.invoke(app, ["import-gguf", str(not_gguf), str(tmp_path / "bad")])
    assert refused.exit_code == exit_codes.USAGE and "is not a GGUF file" in refused.output
    assert not (tmp_path / "bad").exists()
    bad_dtype = runner.invoke(app, ["import-gguf", str(tiny_gguf["path"]), str(tmp_path / "bad"), "--dtype", "int8"])
    assert bad_dtype.exit_code == exit_codes.USAGE and "--dtype int8 is not one of" in bad_dtype.output


def test_the_cli_never_imports_the_converter_or_gguf_until_asked():
    probe = "import sys, trainer_svc.cli; print(sorted({'gguf', 'trainer_svc.weights.gguf_import', 'transformers'} & set(sys.modules)))"  # noqa: E501
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
