"""TRL's side of a tool-use comparison (bench.trl_gpu_compare with a config that has an [env] of
trainer_svc.tasks.calculator): GRPOTrainer(tools=[calculate]) on the prompts, the tool and the
reward our Calculator environment gives, and the held-out accuracy of greedy episodes.

What is mirrored, and how:
- Prompts: each row's first messages are the environment's own `reset()` (its system message,
  the worked example, the question), so both sides see the same conversation.
- The chat template. TRL 1.16 runs tools only with a template that renders `tool_calls` (its
  `supports_tool_calling`), and parses the model's calls only where it knows the template's
  response format; SmolLM2's own template renders message contents alone. TEMPLATE is SmolLM2's
  ChatML with assistant `tool_calls` written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  after the content (the format the worked example shows and our parser reads). A conversation
  without tool calls renders to the same text as under SmolLM2's template (`same_prompts` checks
  it at launch), so both sides' prompts are the same ids. The model's calls are read by TRL's own
  parser for that call format (its Qwen3 response template: `<tool_call>` JSON blocks before the
  end-of-turn token). Qwen2.5's template, which TRL knows, was tried and rejected: its long
  tools preamble and tool results as user turns took SmolLM2-135M from 59 calls of `calculate`
  in 256 episodes to none.
- The tool: `calculate`, the environment's own arithmetic (trainer_svc.tasks.calculator.evaluate),
  with the same name, arguments and docstring, run in TRL's process.
- Turns: TRL calls the tools and generates again up to max_tool_calling_iterations = env.max_turns
  - 1 times (our episode: at most max_turns assistant turns, the last one calls no tool);
  max_completion_length = env.max_episode_tokens less the longest prompt (TRL counts every turn's
  tokens and the tools' in one completion, as our episode budget does).
- Reward: the environment's (1 for the product in the last assistant turn, 0.1 more when a
  `calculate` call was made), from the conversation TRL returns; 0 for one that ran out of turns
  while still calling the tool, as our episode ends there without a score.
- Held out: greedy episodes of the held-out rows with transformers' generate, turn by turn, the
  tool results from a fresh environment per row; accuracy = the last answer's verdict against the
  row's gold (protocol.answers), as ours grades its canary's episodes.
"""

from __future__ import annotations

from protocol.answers import extract_answer, verdict

SUPPORTED = "trainer_svc.tasks.calculator:Calculator"

TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set function = call['function'] if 'function' in call else call %}"
    "{{- '<tool_call>' + {'name': function['name'], 'arguments': function['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def calculate(expression: str) -> int:
    """Work out an arithmetic expression of integers.

    Args:
        expression: integers with + - * // % and parentheses, for example "347 * 29"
    """
    from trainer_svc.tasks.calculator import evaluate

    return evaluate(expression)


def check_env(env: dict) -> None:
    if env.get("class") != SUPPORTED:
        raise SystemExit(
            f"TRL's side mirrors the environment {SUPPORTED} (its tool, its reward), not {env.get('class')!r}"
        )


def first_messages(row: dict) -> list[dict]:
    from trainer_svc.tasks.calculator import Calculator

    return Calculator(row, seed=0).reset()


def tool_tokenizer(model: str):
    """The model's tokenizer with TEMPLATE and TRL's parser of `<tool_call>` blocks."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    own = tokenizer.chat_template
    tokenizer.chat_template = TEMPLATE
    tokenizer.response_template = qwen3_template
    return tokenizer, own


def same_prompts(tokenizer, own_template: str, conversations: list[list[dict]]) -> None:
    """SystemExit where TEMPLATE renders a conversation otherwise than the model's own template."""
    for messages in conversations:
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        theirs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=own_template
        )
        if ours != theirs:
            raise SystemExit(f"the tool template renders a prompt otherwise than the model's:\n{ours!r}\n{theirs!r}")


ASSISTANT_TURNS: list[int] = []  # per conversation scored since the step's row took them


def reward(completions, a, b, **_) -> list[float]:
    """The Calculator environment's reward, from the conversations TRL returns."""
    from trainer_svc.tasks.calculator import TOOL_BONUS, final_answer

    scores = []
    for messages, x, y in zip(completions, a, b, strict=True):
        said = [m for m in messages if m["role"] == "assistant"]
        ASSISTANT_TURNS.append(len(said))
        if not said or said[-1].get("tool_calls"):  # out of turns while calling: ours ends it unscored
            scores.append(0.0)
            continue
        used = any(m["role"] == "tool" and m.get("name") == "calculate" for m in messages)
        right = final_answer(said[-1]["content"] or "") == int(x) * int(y)
        scores.append(float(right) + (TOOL_BONUS if used else 0.0))
    return scores


def greedy_episodes(model, tokenizer, rows: list[dict], max_turns: int, max_tokens: int) -> list[dict]:
    """Each row's greedy episode (turns batched over the rows): its last text, reward, turns."""
    import torch

    from trainer_svc.envs.api import tool_methods
    from trainer_svc.envs.tools import find_calls, run_calls, schemas
    from trainer_svc.tasks.calculator import Calculator

    envs = [Calculator(r, seed=0) for r in rows]
    conversations = [e.reset() for e in envs]
    tools = schemas(tool_methods(envs[0]))
    out = [None] * len(rows)
    running = list(range(len(rows)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for turn in range(max_turns):
        if not running:
            break
        texts = [
            tokenizer.apply_chat_template(conversations[i], tools=tools, add_generation_prompt=True, tokenize=False)
            for i in running
        ]
        batch = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**batch.to(model.device), max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        answers = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        still = []
        for i, text in zip(running, answers, strict=True):
            conversations[i].append({"role": "assistant", "content": text})
            calls = find_calls(text)
            if calls and turn + 1 < max_turns:
                conversations[i].extend(run_calls(calls, tool_methods(envs[i])))
                still.append(i)
            elif calls:  # out of turns while calling: ours ends the episode there, unscored
                out[i] = {"text": text, "reward": 0.0, "turns": turn + 1}
            else:
                out[i] = {"text": text, "reward": envs[i].step(text).reward, "turns": turn + 1}
        running = still
    return out


def held_out_accuracy(model, tokenizer, rows: list[dict], max_turns: int, max_tokens: int) -> dict:
    was_training = model.training
    model.eval()
    try:
        episodes = greedy_episodes(model, tokenizer, rows, max_turns, max_tokens)
    finally:
        model.train(was_training)
    right = [verdict(extract_answer(e["text"]), r["gold"]) is True for e, r in zip(episodes, rows, strict=True)]
    return {
        "accuracy": sum(right) / len(right),
        "reward": sum(e["reward"] for e in episodes) / len(episodes),
        "n": len(right),
    }


def dataset_rows(rows: list[dict]) -> list[dict]:
    """TRL's training rows: the environment's first messages as the prompt, the row's numbers."""
    return [{"prompt": first_messages(r), "a": int(r["a"]), "b": int(r["b"])} for r in rows]


def spec_fields(raw: dict) -> dict:
    env = raw["env"]
    check_env(env)
    return {
        "env": {
            "class": env["class"],
            "max_turns": env.get("max_turns", 4),
            "max_episode_tokens": env.get("max_episode_tokens", 1024),
        }
    }


def longest_prompt(tokenizer, rows: list[dict]) -> int:
    return max(
        len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in rows
    )
