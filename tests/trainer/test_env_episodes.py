"""Episodes turn by turn (trainer_svc.envs): for every assistant turn the trained ids are the
engine's ids, for every environment turn the ids the next request carried, through the real spool
with echo workers and with a chat template; a template that rewrites earlier turns ends the
episode there or stops the run, as env.drift says; tool calls are run and answered; an episode's
later turns prefer the worker that served its previous one, and go to another when it is gone;
a relaunch replays the journaled turns."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import make_config
from echo_workers import EchoWorkers
from env_modules import user_envs  # noqa: F401 (a fixture)
from local_turns import ScriptedTurns, Service

from protocol.client import SpoolClient
from protocol.messages import decode_request
from trainer_svc.data import arithmetic_problems
from trainer_svc.envs.errors import EnvError
from trainer_svc.envs.sampler import EpisodeSampler
from trainer_svc.rollout.turn_batcher import TurnBatcher
from trainer_svc.rollout_types import Ticket, WeightsRef

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("user_envs")]

PROBLEMS = arithmetic_problems(0, 9)
CHATML = (
    "{%- for m in messages %}{{ '<|' + m.role + '|>' + m.content + '</s>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)
# As Qwen3's template drops earlier reasoning: an assistant turn that is not the last loses
# what comes before its "#".
DROPS_HISTORY = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}"
    "{{ '<|' + m.role + '|>' + m.content.split('#')[-1] + '</s>' + '\\n' }}"
    "{%- else %}{{ '<|' + m.role + '|>' + m.content + '</s>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)


def env_config(tmp_path, model, name: str, **env):
    return make_config(
        tmp_path / "run", model, rollout={"samples_per_prompt": 2, "max_tokens": 4}, env={"class": name, **env}
    )


def ticket(problems, model: Path, seed: int = 5) -> Ticket:
    return Ticket(
        tuple(p.prompt for p in problems), WeightsRef(str(model)), 0, 0, seed, problem_ids=tuple(p.id for p in problems)
    )


def tokenizer_of(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def templated(tiny_model: Path, tmp_path: Path, template: str) -> Path:
    """The tiny model's tokenizer with a chat template whose end of turn is its "</s>"."""
    path = tmp_path / "templated"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(chat_template=template, split_special_tokens=False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def run_episodes(cfg, turns, model: Path, problems=PROBLEMS[:2]):
    sampler = EpisodeSampler(cfg, Service(turns), problems, tokenizer_of(model))
    try:
        call = sampler.submit(ticket(problems, model))
        return sampler.collect(call)
    finally:
        sampler.close()


class Recording:
    """A real TurnBatcher, keeping every Turn put and every outcome returned."""

    def __init__(self, batcher: TurnBatcher):
        self.batcher, self.turns, self.outcomes = batcher, {}, {}

    def set_weights(self, *args) -> None:
        self.batcher.set_weights(*args)

    def put(self, turn) -> None:
        self.turns[turn.key] = turn
        self.batcher.put(turn)

    def poll(self, timeout_s: float):
        found = self.batcher.poll(timeout_s)
        self.outcomes.update({o.key: o for o in found})
        return found

    def pending(self) -> int:
        return self.batcher.pending()

    def close(self) -> None:
        self.batcher.close()


def check_exact(groups, turns: dict, outcomes: dict, renders) -> None:
    """Each sample is the first prompt, then per turn the engine's ids (mask 1, its logprobs) and
    the environment's (mask 0, logprob 0), where the next turn's request carried them."""
    [call] = {key.partition(".")[0] for key in turns}
    for p, group in enumerate(groups):
        for g, sample in enumerate(group.samples):
            episode, offset = f"{call}.p{p}g{g}", 0
            for t in range(sample.turns):
                turn, outcome = turns[f"{episode}.t{t}"], outcomes[f"{episode}.t{t}"]
                assert turn.prompt_token_ids == group.prompt_ids + sample.token_ids[:offset]
                n = len(outcome.token_ids)
                assert sample.token_ids[offset : offset + n] == outcome.token_ids
                assert sample.loss_mask[offset : offset + n] == [1] * n
                assert sample.logprobs[offset : offset + n] == outcome.logprobs
                offset += n
                if t + 1 < sample.turns:
                    following = turns[f"{episode}.t{t + 1}"].prompt_token_ids[len(group.prompt_ids) + offset :]
                    assert following == renders(t + 1)
                    assert sample.token_ids[offset : offset + len(following)] == following
                    assert sample.loss_mask[offset : offset + len(following)] == [0] * len(following)
                    assert sample.logprobs[offset : offset + len(following)] == [0.0] * len(following)
                    assert turns[f"{episode}.t{t + 1}"].prefer_worker == outcome.worker_id
                    offset += len(following)
            assert offset == len(sample.token_ids) == len(sample.loss_mask)
            assert f"{episode}.t{sample.turns}" not in turns


def test_through_the_spool_every_turn_trains_on_the_ids_the_engine_saw(tiny_model, tmp_path):
    workers = EchoWorkers(tmp_path / "spool", tmp_path / "logs")
    try:
        workers.start("echo-a")
        workers.start("echo-b")
        client = SpoolClient(tmp_path / "spool", no_worker_grace_s=30)
        batcher = TurnBatcher(
            client, weights_dir=str(tiny_model), weights_content_id=None, max_tokens=4, temperature=1.0, top_p=1.0,
            stop=[],
        )  # fmt: skip
        turns = Recording(batcher)
        cfg = env_config(tmp_path, tiny_model, "user_envs:Chat", max_turns=3)
        groups = run_episodes(cfg, turns, tiny_model)
    finally:
        workers.close()
    tokenizer = tokenizer_of(tiny_model)
    assert [len(g.samples) for g in groups] == [2, 2]
    assert groups[0].prompt_ids == tokenizer(PROBLEMS[0].prompt, add_special_tokens=False)["input_ids"]
    for group in groups:
        for sample in group.samples:
            assert (sample.turns, sample.ended) == (3, "done")
            # The echo's answer of a prompt is its first 4 ids: the row's prompt, every turn.
            assert sample.reward == 1.0 + 1.0 + len(PROBLEMS[groups.index(group)].prompt)
    check_exact(
        groups, turns.turns, turns.outcomes, lambda t: tokenizer(f"ok{t}", add_special_tokens=False)["input_ids"]
    )
    # What the spool's requests carried is exactly what was put: 2 rows x 2 episodes x 3 turns.
    carried = []
    for path in (tmp_path / "spool" / "done").iterdir():
        if "ok" not in json.loads(path.read_bytes()):  # a request, not the result kept beside it
            carried += [tuple(ids) for ids in decode_request(path.read_bytes()).prompt_token_ids]
    assert sorted(carried) == sorted(tuple(t.prompt_token_ids) for t in turns.turns.values())
    assert len(carried) == 12


def test_with_a_chat_template_environment_turns_are_suffixes_and_history_is_never_rendered_again(tiny_model, tmp_path):
    model = templated(tiny_model, tmp_path, CHATML)
    tokenizer = tokenizer_of(model)
    turns = ScriptedTurns(tokenizer, ["7", "8", "9"])
    groups = run_episodes(env_config(tmp_path, model, "user_envs:Chat", max_turns=3), turns, model)
    prompt = f"<|user|>{PROBLEMS[0].prompt}</s>\n<|assistant|>"
    assert groups[0].prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def suffix(t: int) -> list[int]:  # what the template writes after an assistant's "</s>"
        return tokenizer(f"\n<|user|>ok{t}</s>\n<|assistant|>", add_special_tokens=False)["input_ids"]

    check_exact(groups, turns.turns, turns.outcomes, suffix)
    sample = groups[0].samples[0]
    assert (sample.turns, sample.ended) == (3, "done")
    conversation = [{"role": "user", "content": PROBLEMS[0].prompt}]
    for t, answer in enumerate(["7", "8", "9"]):
        conversation.append({"role": "assistant", "content": answer})
        if t < 2:
            conversation.append({"role": "user", "content": f"ok{t + 1}"})
    # The ids trained on are the whole conversation as the template renders it, end to end.
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False).removesuffix("\n")
    assert groups[0].prompt_ids + sample.token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_history_ends_the_episode_there_on_the_ids_the_engine_saw(tiny_model, tmp_path):
    model = templated(tiny_model, tmp_path, DROPS_HISTORY)
    tokenizer = tokenizer_of(model)
    eos = tokenizer.eos_token_id
    groups = run_episodes(env_config(tmp_path, model, "user_envs:Chat"), ScriptedTurns(tokenizer, ["a#7"] * 3), model)
    for group in groups:
        for sample in group.samples:
            assert (sample.turns, sample.ended) == (1, "drift")
            assert sample.token_ids == tokenizer("a#7", add_special_tokens=False)["input_ids"] + [eos]
            assert sample.loss_mask == [1] * len(sample.token_ids)
            assert sample.reward == 1.0  # the step's reward counts; the turn it would have led to is not taken
    # The same template keeps answers without the dropped part as written: no drift.
    shutil.rmtree(tmp_path / "run")
    groups = run_episodes(env_config(tmp_path, model, "user_envs:Chat"), ScriptedTurns(tokenizer, ["7"] * 3), model)
    assert {(s.turns, s.ended) for g in groups for s in g.samples} == {(3, "done")}


def test_a_template_that_rewrites_history_stops_the_run_when_drift_is_refused(tiny_model, tmp_path):
    model = templated(tiny_model, tmp_path, DROPS_HISTORY)
    cfg = env_config(tmp_path, model, "user_envs:Chat", drift="refuse")
    with pytest.raises(EnvError) as refused:
        run_episodes(cfg, ScriptedTurns(tokenizer_of(model), ["a#7"] * 3), model)
    message = str(refused.value)
    assert re.search(r"environment user_envs:Chat \(episode train-s00000000-a0-\w+\.p\dg\d, turn 1\)", message)
    assert "renders the conversation so far otherwise than the token ids the engine saw" in message
    assert 'env.drift = "end"' in message


def test_a_tool_call_is_run_and_its_result_is_the_next_environment_turn(tiny_model, tmp_path):
    tokenizer = tokenizer_of(tiny_model)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    unknown = '<tool_call>{"name": "mul", "arguments": {"a": 2}}</tool_call>'
    turns = ScriptedTurns(tokenizer, [call, unknown, "5"])
    groups = run_episodes(env_config(tmp_path, tiny_model, "user_envs:Calculator"), turns, tiny_model, PROBLEMS[:1])
    first = tokenizer.decode(groups[0].prompt_ids)
    assert '"name": "add"' in first and "<tool_call>" in first and first.endswith(PROBLEMS[0].prompt)
    sample = groups[0].samples[0]
    assert (sample.turns, sample.ended, sample.reward) == (3, "done", 1.0)
    environment = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m == 0]
    assert tokenizer.decode(environment) == (
        "<tool_response>5</tool_response>\n"
        "<tool_response>error: no tool named 'mul'; the tools are ['add']</tool_response>\n"
    )


def test_a_relaunch_replays_the_journaled_turns_and_asks_the_engine_only_for_the_rest(tiny_model, tmp_path):
    import time

    tokenizer = tokenizer_of(tiny_model)
    problems = PROBLEMS[:2]
    straight = run_episodes(env_config(tmp_path / "a", tiny_model, "user_envs:Chat", max_turns=3),
                            ScriptedTurns(tokenizer, ["7", "8", "9"]), tiny_model)  # fmt: skip

    # A launch whose engine answers every first turn and no later one, stopped then.
    cfg = env_config(tmp_path / "b", tiny_model, "user_envs:Chat", max_turns=3)
    first = ScriptedTurns(tokenizer, ["7", "8", "9"], hold=lambda key: not key.endswith(".t0"))
    sampler = EpisodeSampler(cfg, Service(first), problems, tokenizer)
    call = sampler.submit(ticket(problems, tiny_model))
    deadline = time.monotonic() + 60
    while len(first.outcomes) < 4 or len(first.turns) < 8:  # 4 first turns answered, 4 second ones asked
        assert time.monotonic() < deadline, (first.outcomes, first.turns)
        time.sleep(0.01)
    sampler.close()

    relaunch = ScriptedTurns(tokenizer, ["7", "8", "9"])
    sampler = EpisodeSampler(cfg, Service(relaunch), problems, tokenizer)
    try:
        sampler.restore(call)
        groups = sampler.collect(call)
    finally:
        sampler.close()
    assert sorted(k.rpartition(".t")[2] for k in relaunch.turns) == ["1"] * 4 + ["2"] * 4  # no first turn again
    assert groups == straight
    assert not list((tmp_path / "b" / "run" / "episodes").iterdir())  # collected: the journal is gone


def test_a_replay_the_environment_answers_otherwise_stops_the_run(tiny_model, tmp_path):
    import time

    tokenizer = tokenizer_of(tiny_model)
    cfg = env_config(tmp_path, tiny_model, "user_envs:Clock", max_turns=3)
    first = ScriptedTurns(tokenizer, ["7", "8", "9"], hold=lambda key: not key.endswith(".t0"))
    sampler = EpisodeSampler(cfg, Service(first), PROBLEMS[:1], tokenizer)
    call = sampler.submit(ticket(PROBLEMS[:1], tiny_model))
    deadline = time.monotonic() + 60
    while len(first.turns) < 4:  # both first turns answered and their environments' answers journaled
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sampler.close()
    sampler = EpisodeSampler(cfg, Service(ScriptedTurns(tokenizer, ["7", "8", "9"])), PROBLEMS[:1], tokenizer)
    try:
        sampler.restore(call)
        with pytest.raises(EnvError, match=r"turn 1\) answered the replayed assistant turns of a resume otherwise"):
            sampler.collect(call)
    finally:
        sampler.close()


def test_a_call_made_again_for_its_step_replaces_the_first_whose_episodes_are_then_dropped(tiny_model, tmp_path):
    import time
    from dataclasses import replace

    tokenizer = tokenizer_of(tiny_model)
    cfg = env_config(tmp_path, tiny_model, "user_envs:Chat", max_turns=3)
    sampler = EpisodeSampler(cfg, Service(ScriptedTurns(tokenizer, ["7", "8", "9"])), PROBLEMS[:2], tokenizer)
    try:
        stale = sampler.submit(ticket(PROBLEMS[:2], tiny_model))
        fresh = sampler.submit(replace(stale, weights=WeightsRef(str(tiny_model), "newer", 3)))
        groups = sampler.collect(fresh)
        assert [g.weights_step for g in groups] == [3, 3]
        deadline = time.monotonic() + 60
        while sampler.runner.episodes or list((tmp_path / "run" / "episodes").iterdir()):
            assert time.monotonic() < deadline, sampler.runner.episodes.keys()
            time.sleep(0.01)
    finally:
        sampler.close()


def test_an_episodes_turn_goes_to_another_worker_when_the_one_that_served_it_is_gone(tiny_model, tmp_path):
    import time

    workers = EchoWorkers(tmp_path / "spool", tmp_path / "logs")
    tokenizer = tokenizer_of(tiny_model)
    try:
        workers.start("echo-a")
        workers.start("echo-b")
        client = SpoolClient(tmp_path / "spool", no_worker_grace_s=30)
        batcher = TurnBatcher(
            client, weights_dir=str(tiny_model), weights_content_id=None, max_tokens=4, temperature=1.0, top_p=1.0,
            stop=[],
        )  # fmt: skip
        turns = Recording(batcher)
        cfg = env_config(tmp_path, tiny_model, "user_envs:Gated", max_turns=3)
        sampler = EpisodeSampler(cfg, Service(turns), PROBLEMS[:2], tokenizer)
        try:
            call = sampler.submit(ticket(PROBLEMS[:2], tiny_model))
            deadline = time.monotonic() + 60
            while len(turns.outcomes) < 4:  # every episode's first turn answered; their steps wait at the gate
                assert time.monotonic() < deadline
                time.sleep(0.01)
            gone = turns.outcomes[sorted(turns.outcomes)[0]].worker_id
            workers.stop(gone)
            (tmp_path / "user" / "gate").touch()
            groups = sampler.collect(call)
        finally:
            sampler.close()
    finally:
        workers.close()
    check_exact(
        groups, turns.turns, turns.outcomes, lambda t: tokenizer(f"ok{t}", add_special_tokens=False)["input_ids"]
    )
    moved = [k for k, turn in turns.turns.items() if turn.prefer_worker == gone and k.endswith(".t1")]
    assert moved and all(turns.outcomes[k].worker_id != gone for k in moved)
    assert {(s.turns, s.ended) for g in groups for s in g.samples} == {(3, "done")}


class CachingTurns(ScriptedTurns):
    """As ScriptedTurns, each answer saying the worker's cache served all of its prompt but the
    last 3 tokens (or, with `silent`, saying nothing, as the echo engine)."""

    def __init__(self, tokenizer, answers, silent_after: int | None = None):
        super().__init__(tokenizer, answers)
        self.silent_after, self.prompts = silent_after, {}

    def put(self, turn) -> None:
        self.prompts[turn.key] = len(turn.prompt_token_ids)
        super().put(turn)

    def poll(self, timeout_s: float):
        from dataclasses import replace

        answered = super().poll(timeout_s)
        told = [self.silent_after is None or len(self.outcomes) <= self.silent_after for _ in answered]
        return [
            replace(o, cached_tokens=self.prompts[o.key] - 3 if t else None)
            for o, t in zip(answered, told, strict=True)
        ]


def test_an_episodes_later_turns_count_the_prompt_tokens_the_cache_served(tiny_model, tmp_path):
    """The first turn is left out (nothing of the episode can be cached for it); a later turn adds
    its whole prompt and what the worker said its cache served; the step's figure is their ratio,
    and none where a worker did not say."""
    from trainer_svc.rollout.sampling import _episode_figures

    tokenizer = tokenizer_of(tiny_model)
    cfg = env_config(tmp_path / "a", tiny_model, "user_envs:Chat", max_turns=3)
    turns = CachingTurns(tokenizer, ["7", "8", "9"])
    samples = [s for g in run_episodes(cfg, turns, tiny_model) for s in g.samples]
    later = sum(n for key, n in turns.prompts.items() if not key.endswith(".t0"))
    assert later > 0 and all(s.turns == 3 for s in samples)
    assert sum(s.later_prompt_tokens for s in samples) == later
    assert sum(s.cached_tokens for s in samples) == later - 3 * sum(s.turns - 1 for s in samples)
    assert _episode_figures(samples)["prefix_cache_hit"] == pytest.approx(sum(s.cached_tokens for s in samples) / later)
    quiet = CachingTurns(tokenizer, ["7", "8", "9"], silent_after=1)
    cfg = env_config(tmp_path / "b", tiny_model, "user_envs:Chat", max_turns=3)
    samples = [s for g in run_episodes(cfg, quiet, tiny_model) for s in g.samples]
    assert "prefix_cache_hit" not in _episode_figures(samples)
