"""bench/trl_gpu_compare.py and bench/trl_side.py set TRL's side from the config ours runs: the
same rows (never the held-out ones), batch, sampling, optimizer and correction; and its figures
read the runs' rows as stamped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import trl_gpu_compare as compare
from bench import trl_side, trl_tools

ROOT = Path(__file__).resolve().parents[2]

CONFIG = ROOT / "configs" / "smollm2-gpu.toml"


def arguments(**overrides) -> argparse.Namespace:
    values = {"config": str(CONFIG), "model": None, "prompts": None, "samples": None, "tokens": None,
              "steps": 120, "eval_every": 10, "trl_micro_batches": None} | overrides  # fmt: skip
    return argparse.Namespace(**values)


def test_trl_trains_on_the_configs_training_rows_and_is_graded_on_its_canary_rows(tmp_path):
    from trainer_svc.config import load
    from trainer_svc.data import load_problems

    raw = compare.load_settings(arguments())
    train, held_out, count = compare.problems(raw, tmp_path)
    cfg = load(CONFIG)
    expected_train, expected_held_out = load_problems(cfg.data, cfg.run.seed)
    trl_train = [json.loads(line) for line in train.read_text().splitlines()]
    trl_held_out = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert [r["prompt"] for r in trl_train] == [p.prompt for p in expected_train]
    assert [r["gold"] for r in trl_held_out] == [p.gold for p in expected_held_out[: cfg.canary.problems]]
    assert count == cfg.canary.problems == 64
    seen = {json.dumps(r["prompt"]) for r in trl_train}
    assert not any(json.dumps(r["prompt"]) in seen for r in trl_held_out)


def test_trl_settings_are_the_configs(tmp_path):
    raw = compare.load_settings(arguments(steps=7, eval_every=3))
    spec = trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments(steps=7, eval_every=3))
    assert spec["model"] == str((ROOT / "build" / "smollm2-135m-instruct").resolve())
    assert (spec["prompts_per_step"], spec["samples_per_prompt"], spec["max_tokens"]) == (64, 8, 16)
    assert (spec["temperature"], spec["top_p"], spec["lr"], spec["warmup_steps"]) == (0.7, 1.0, 2e-5, 5)
    assert (spec["correction"], spec["correction_cap"], spec["gpu_memory"], spec["max_model_len"]) == (
        "tis",
        2.0,
        0.3,
        512,
    )
    assert (spec["steps"], spec["eval_every"]) == (7, 3)
    assert (spec["clip_low"], spec["clip_high"], spec["betas"], spec["max_grad_norm"]) == (0.2, 0.28, [0.9, 0.99], 1.0)


def test_a_longer_tokens_raises_the_context_on_both_sides_and_a_larger_one_is_left_alone(tmp_path):
    from trainer_svc.rails.gates import worker_max_model_len

    raw = compare.load_settings(arguments(tokens=1024))
    assert raw["rollout"]["max_tokens"] == 1024
    assert worker_max_model_len(raw["rollout"]["worker_args"]) == 1024 + compare.PROMPT_ROOM
    assert raw["rollout"]["worker_args"].count("--max-model-len") == 1
    spec = trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments(tokens=1024))
    assert spec["max_model_len"] == 1024 + compare.PROMPT_ROOM
    wide = ["--dtype", "bfloat16", "--max-model-len=4096"]
    assert compare.with_max_model_len(wide, 1536) == wide
    assert compare.with_max_model_len(["--max-model-len=600", "--dtype", "bfloat16"], 1536) == [
        "--max-model-len",
        "1536",
        "--dtype",
        "bfloat16",
    ]


def test_random_weights_keep_the_tokenizers_vocabulary_and_special_tokens_and_are_seeded(tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from bench.models import BENCH_SHAPES, random_model

    source = AutoConfig.from_pretrained(tiny_model)
    first = random_model(tiny_model, tmp_path / "a", shape="tiny", seed=7)
    again = random_model(tiny_model, tmp_path / "b", shape="tiny", seed=7)
    other = random_model(tiny_model, tmp_path / "c", shape="tiny", seed=8)
    config = AutoConfig.from_pretrained(first)
    assert config.model_type == "qwen2" and config.hidden_size == BENCH_SHAPES["tiny"]["hidden_size"]
    assert config.vocab_size == source.vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, key) == getattr(source, key)
    assert (first / "tokenizer_config.json").exists()
    weights = [load_file(m / "model.safetensors") for m in (first, again, other)]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
    assert not all(weights[0][k].equal(weights[2][k]) for k in weights[0] if "norm" not in k)
    own = random_model(tiny_model, tmp_path / "d")  # no shape: the source's own architecture
    assert AutoConfig.from_pretrained(own).model_type == source.model_type


def test_trl_splits_a_step_into_the_micro_batches_asked_and_refuses_a_split_that_does_not_divide(tmp_path):
    raw = compare.load_settings(arguments())
    assert trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments())["micro_batches"] == 1
    raw["train"]["grad_accum"] = 4
    assert trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments())["micro_batches"] == 4
    spec = trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments(trl_micro_batches=16))
    assert spec["micro_batches"] == 16
    with pytest.raises(SystemExit, match="does not divide"):
        trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments(trl_micro_batches=7))


def test_trl_scores_with_the_configs_own_reward_functions_weighted_alike(tmp_path):
    raw = compare.load_settings(arguments())
    raw["reward"] = {"functions": ["trainer_svc.tasks.running_sums:steps_right", "overlong"], "weights": [1.0, 1.0]}
    spec = trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments())
    assert spec["user_rewards"] == [("trainer_svc.tasks.running_sums:steps_right", 1.0)]
    assert spec["eval_every"] == 0  # no gold answers to grade held-out rows by
    raw["reward"] = {"functions": ["correct", "trainer_svc.tasks.running_sums:steps_right"], "weights": [1.0, 0.5]}
    spec = trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments())
    assert spec["user_rewards"] == [("correct", 1.0), ("trainer_svc.tasks.running_sums:steps_right", 0.5)]
    assert spec["eval_every"] == arguments().eval_every  # correctness needs gold answers: they grade held-out rows


def test_a_reward_trl_cannot_mirror_is_refused(tmp_path):
    raw = compare.load_settings(arguments())
    raw["reward"] = {"functions": ["correct", "format"], "weights": [1.0, 0.5]}
    with pytest.raises(SystemExit, match="no other built-in"):
        trl_side.trl_spec(raw, tmp_path / "t", tmp_path / "h", tmp_path, arguments())


def test_summary_times_accuracy_from_launch_and_skips_the_first_steps():
    steps = [{"step": i, "t": 100.0 + i, "step_s": 9.0 if i <= 2 else 1.0, "reward": 0.5, "completion_tokens": 500}
             for i in range(1, 11)]  # fmt: skip
    evals = [{"step": 0, "accuracy": 0.1, "t": 99.0}, {"step": 5, "accuracy": 0.82, "t": 105.0},
             {"step": 10, "accuracy": 0.86, "t": 310.0}]  # fmt: skip
    figures = compare.summary({"exit": 0, "steps": steps, "evals": evals}, skip=2)
    assert figures["median_step_s"] == 1.0
    assert figures["median_generated_tokens_per_s"] == 500
    assert figures["launch_to_first_step_s"] == 101.0
    assert (figures["launch_to_accuracy_0.8_s"], figures["step_reaching_accuracy_0.8"]) == (105.0, 5)
    assert (figures["launch_to_accuracy_0.85_s"], figures["step_reaching_accuracy_0.85"]) == (310.0, 10)
    assert figures["best_accuracy_within_300_s"] == 0.82
    assert "held_out_reward_first" not in figures  # TRL's evals carry no reward


def test_summary_gives_the_held_out_reward_and_the_first_and_last_steps_lengths():
    steps = [{"step": i, "t": 10.0 * i, "step_s": 1.0, "reward": i / 20, "completion_tokens": 100 * i}
             for i in range(1, 16)]  # fmt: skip
    evals = [{"step": 0, "accuracy": 0.0, "reward": 0.1, "t": 5.0},
             {"step": 5, "accuracy": 0.0, "reward": 0.4, "t": 55.0},
             {"step": 15, "accuracy": 0.1, "reward": 0.3, "t": 700.0}]  # fmt: skip
    figures = compare.summary({"exit": 0, "steps": steps, "evals": evals}, skip=0)
    assert (figures["held_out_reward_first"], figures["held_out_reward_best"], figures["held_out_reward_last"]) == (
        0.1, 0.4, 0.3)  # fmt: skip
    assert figures["best_held_out_reward_within_600_s"] == 0.4
    assert figures["reward_last_10_steps"] == "6-15"
    assert (figures["completion_tokens_first_step"], figures["completion_tokens_last_step"]) == (100, 1500)


def test_the_workers_reloads_calls_and_build_are_read_from_its_log():
    log = "\n".join(
        [
            "x INFO rollout_svc.engines.vllm_host[7]: engine built for /m in 39.5 s (CUDA graphs FULL_DECODE_ONLY)",
            "x INFO rollout_svc.engines.vllm: engine process 7 built for /m in 61.9 s (CUDA graphs FULL_DECODE_ONLY)",
            "x vllm_host[7]: generated 64 sequences in 0.268 s (LLM.generate 0.239 s)",  # a canary: not a step's
            "x vllm_host[7]: reloaded /s/slot_0 in 0.247 s (weights and check 0.173 s, of it waiting for the files' "
            "sums 0.001 s; prefix cache 0.074 s)",
            "x vllm_host[7]: generated 512 sequences in 0.554 s (LLM.generate 0.528 s)",
            "x vllm_host[7]: reloaded /s/slot_1 in 0.043 s (weights and check 0.026 s, of it waiting for the files' "
            "sums 0.000 s; prefix cache 0.017 s)",
            "x vllm_host[7]: generated 512 sequences in 0.474 s (LLM.generate 0.445 s)",
            "x vllm_host[7]: reloaded /s/slot_0 in 0.155 s (weights and check 0.117 s, of it waiting for the files' "
            "sums 0.002 s; prefix cache 0.037 s)",
            "x vllm_host[7]: generated 512 sequences in 0.395 s (LLM.generate 0.378 s)",
        ]
    )
    assert compare.worker_figures(log, 512) == {
        "reload_s": 0.155,
        "reload_weights_and_check_s": 0.117,
        "reload_file_sums_wait_s": 0.001,
        "reload_prefix_cache_s": 0.037,
        "call_s": 0.474,
        "call_llm_generate_s": 0.445,
        "engine_process_build_s": 61.9,
        "engine_llm_s": 39.5,
    }


def test_the_reward_plot_is_drawn_from_a_runs_json(tmp_path):
    steps = [{"step": i, "t": 60.0 + 2 * i, "reward": 0.05 + 0.002 * i} for i in range(1, 31)]
    run = tmp_path / "ours.json"
    run.write_text(json.dumps({"side": "ours", "config": "c.toml", "machine": "GPU", "run": {"steps": steps}}))
    png = tmp_path / "reward.png"
    compare.plot_reward([str(run)], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# -- the tool-use comparison (bench.trl_tools) -----------------------------------------------------

TOOLS = ROOT / "configs" / "smollm2-gpu-tools.toml"


def test_trl_mirrors_the_environments_turns_and_refuses_another_environment(tmp_path):
    raw = compare.load_settings(arguments(config=str(TOOLS)))
    train, held_out, _ = compare.problems(raw, tmp_path)
    spec = trl_side.trl_spec(raw, train, held_out, tmp_path, arguments(config=str(TOOLS)))
    assert spec["env"] == {
        "class": "trainer_svc.tasks.calculator:Calculator",
        "max_turns": 3,
        "max_episode_tokens": 512,
    }
    assert spec["user_rewards"] == []
    raw["env"]["class"] = "my_envs:Other"
    with pytest.raises(SystemExit, match="mirrors the environment trainer_svc.tasks.calculator:Calculator"):
        trl_side.trl_spec(raw, train, held_out, tmp_path, arguments(config=str(TOOLS)))


def test_trl_prompts_are_the_environments_first_messages():
    from trainer_svc.tasks.calculator import Calculator

    row = {"a": 347, "b": 29}
    (trl_row,) = trl_tools.dataset_rows([row])
    assert trl_row == {"prompt": Calculator(row, seed=0).reset(), "a": 347, "b": 29}


def test_the_tool_template_renders_calls_our_parser_reads_and_plain_turns_as_chatml(tiny_model):
    """TEMPLATE writes an assistant's tool_calls in the format the environments' parser reads,
    and a conversation without tool calls as ChatML."""
    from transformers import AutoTokenizer

    from trainer_svc.envs.tools import find_calls, run_calls

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 * 34"}}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculate", "content": "408"},
    ]
    text = tokenizer.apply_chat_template(messages, chat_template=trl_tools.TEMPLATE, add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert text == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )
    assert run_calls(find_calls(text), {"calculate": trl_tools.calculate}) == [messages[-1]]


@pytest.mark.parametrize(
    ("conversation", "score"),
    [
        ([{"role": "assistant", "content": "Answer: 10063"}], 1.0),
        (
            [
                {"role": "assistant", "content": ""},
                {"role": "tool", "name": "calculate", "content": "10063"},
                {"role": "assistant", "content": "Answer: 10063"},
            ],
            1.1,
        ),  # fmt: skip
        (
            [
                {"role": "assistant", "content": ""},
                {"role": "tool", "name": "multiply", "content": "error"},
                {"role": "assistant", "content": "Answer: 10064"},
            ],
            0.0,
        ),  # fmt: skip
        (
            [{"role": "assistant", "content": "Answer: 10063", "tool_calls": [{"function": {"name": "calculate"}}]}],
            0.0,
        ),  # fmt: skip
        ([], 0.0),
    ],
)
def test_trls_reward_is_the_environments(conversation, score):
    assert trl_tools.reward([conversation], [347], [29]) == [pytest.approx(score)]


def test_trls_reward_counts_the_assistant_turns_of_each_conversation_for_the_steps_row():
    trl_tools.ASSISTANT_TURNS.clear()
    called = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculate"}}]},
              {"role": "tool", "name": "calculate", "content": "10063"},
              {"role": "assistant", "content": "Answer: 10063"}]  # fmt: skip
    trl_tools.reward([called, [{"role": "assistant", "content": "Answer: 1"}], []], [347] * 3, [29] * 3)
    assert trl_tools.ASSISTANT_TURNS == [2, 1, 0]


def test_summary_gives_assistant_turns_a_second_where_steps_count_them():
    steps = [{"step": i, "t": 10.0 * i, "step_s": 2.0 if i % 2 else 4.0, "reward": 0.5, "completion_tokens": 100,
              "turns": 120} for i in range(1, 6)]  # fmt: skip
    assert compare.summary({"exit": 0, "steps": steps, "evals": []}, skip=0)["median_turns_per_s"] == 60.0
    single_turn = [dict(s, turns=None) for s in steps]
    assert "median_turns_per_s" not in compare.summary({"exit": 0, "steps": single_turn, "evals": []}, skip=0)
    cached = [dict(s, prefix_cache_hit=h) for s, h in zip(steps, (0.5, 0.9, None, 0.8, 0.95), strict=True)]
    assert compare.summary({"exit": 0, "steps": cached, "evals": []}, skip=0)["median_prefix_cache_hit"] == 0.85
