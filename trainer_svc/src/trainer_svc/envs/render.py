"""Exact tokens across turns: the ids of an episode's first prompt, and of each environment
turn as a suffix to the ids the engine saw.

Tokens in, tokens out. A turn's request carries the exact prompt ids: the previous turn's
prompt ids, then the engine's completion ids (as it returned them, never re-tokenized from its
text), then the new environment messages rendered on their own as a suffix. Earlier turns are
never rendered again, so the ids a sample trains on are, turn by turn, the ids the engine saw.

Two renderers, picked once from the tokenizer:
- ChatRenderer (the tokenizer has a chat template): the first messages are rendered with the
  generation prompt (and the tools' schemas, where the environment has tools) and tokenized
  without the tokenizer's own special tokens, as the rollout worker renders conversations. A
  suffix is the template's rendering of the new messages after a stand-in conversation, cut at
  the end of the stand-in assistant turn: where the assistant's last id (its end-of-turn token)
  sits in the stand-in's rendering (TRL's `_get_tool_suffix_ids` does the same). So the suffix
  starts with what the template writes after an assistant's end-of-turn token ("\n" in ChatML)
  and ends with the next generation prompt.
  Drift: a template may render earlier turns differently once later ones exist (Qwen3-style
  templates drop earlier reasoning). Before each environment turn the whole conversation so far
  is rendered in full and compared, as text through the tokenizer, with the ids held plus the
  suffix; where they differ (or the assistant's turn did not end with the end-of-turn token the
  template writes) the conversation has drifted, and the episode ends there (`env.drift =
  "end"`, counted) or the run stops (`"refuse"`). Either way no id the engine did not see is
  trained on.
- PlainRenderer (no chat template, as the tiny test model): the conversation is its messages'
  contents back to back; a suffix is the new contents tokenized alone (a tool result as
  `<tool_response>...</tool_response>\n`, the tools' schemas as a first system message). Nothing
  is rendered again, so nothing can drift.
"""

from __future__ import annotations

from typing import Protocol

from .tools import plain_tools_message

STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class Renderer(Protocol):
    def first_ids(self, messages: list[dict], tools: list[dict]) -> list[int]: ...

    def suffix_ids(self, messages: list[dict], tools: list[dict], last_id: int) -> list[int] | None:
        """The ids of `messages` after an assistant turn whose last id is `last_id`; None where
        the template cannot continue after it (the turn did not end with its end-of-turn token)."""
        ...

    def agrees(self, conversation: list[dict], tools: list[dict], held: list[int]) -> bool:
        """Whether the whole `conversation`, rendered now with the generation prompt, is `held`."""
        ...


def renderer_for(tokenizer) -> Renderer:
    return ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else PlainRenderer(tokenizer)


class ChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict], tools: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return self._ids(self._render(messages, tools, True))

    def suffix_ids(self, messages: list[dict], tools: list[dict], last_id: int) -> list[int] | None:
        before = self._ids(self._render(STAND_IN, tools, False))
        after = self._ids(self._render(STAND_IN + messages, tools, True))
        ends = [i for i, token in enumerate(before) if token == last_id]
        if not ends or after[: ends[-1] + 1] != before[: ends[-1] + 1]:
            return None
        return after[ends[-1] + 1 :]

    def agrees(self, conversation: list[dict], tools: list[dict], held: list[int]) -> bool:
        rendered = self._ids(self._render(conversation, tools, True))
        decode = self.tokenizer.decode
        return rendered == held or decode(rendered, skip_special_tokens=False) == decode(
            held, skip_special_tokens=False
        )


class PlainRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _ids(self, messages: list[dict]) -> list[int]:
        text = "".join(
            f"<tool_response>{m['content']}</tool_response>\n" if m["role"] == "tool" else m["content"]
            for m in messages
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return self._ids(([plain_tools_message(tools)] if tools else []) + messages)

    def suffix_ids(self, messages: list[dict], tools: list[dict], last_id: int) -> list[int] | None:
        return self._ids(messages)

    def agrees(self, conversation: list[dict], tools: list[dict], held: list[int]) -> bool:
        return True
