"""A real pretrained model, SmolLM2-135M-Instruct as `make real-model` builds it, served by one real
vLLM worker through the spool.

The worker renders conversations with the model's chat template in the rollout venv's
transformers; the trainer tokenizes with the trainer venv's, another version. Both must give the
same ids, or the trainer would score and train on tokens the engine never saw. And a greedy reply
must end its turn (the generation config's end of turn, `<|im_end|>`), not run to max_tokens.

One engine start for the module: `served_real` is shared, and any test of this module that needs
the real model served (GRPO steps on it, say) asks for `real_worker`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ServedWorker, keep_running
from run_config import write_run_config

from protocol.messages import ChatTurn, Request
from protocol.spool import Spool

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = ROOT / ".venvs" / "trainer" / "bin" / "python"
TRAINER = ROOT / ".venvs" / "trainer" / "bin" / "trainer-svc"
PIN = ROOT / "configs" / "models" / "smollm2-135m-instruct.pin.json"
WORKER = "e2e-real"
MAX_MODEL_LEN = 512  # chat prompts here are under 60 tokens; a small limit keeps the engine cheap

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+3? Answer with a number."},
]
# No system turn: SmolLM2's template writes its own default system turn first.
USER_ONLY = [{"role": "user", "content": "Name a colour of the sky."}]
PLAIN_TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def served_real(real_model, tmp_path_factory):
    """The module's worker on the real model: started by the first test that needs it. No
    --allowed-root, so weights a test publishes elsewhere (a trainer's) are served too."""
    base = tmp_path_factory.mktemp("real-worker")
    args = [
        "--engine", "vllm", "--weights", str(real_model), "--max-model-len", str(MAX_MODEL_LEN),
        "--idle-exit", "1800",
    ]  # fmt: skip
    served = ServedWorker(Spool(base / "spool", create=True), WORKER, args, log_dir=base)
    yield served
    served.stop()


@pytest.fixture
def real_worker(served_real) -> ServedWorker:
    keep_running(served_real)
    return served_real


_ids = iter(range(10**6))


def ask(client, real_model: Path, **fields):
    fields = dict(n_samples_per_prompt=1, max_tokens=32, temperature=0.0) | fields
    request = Request(request_id=f"real{next(_ids)}-{time.time_ns()}", weights_dir=str(real_model), **fields)
    client.submit(request)
    result = client.wait([request.request_id], timeout_s=600)[request.request_id]
    assert result.ok, result.error
    return result


def turns(conversation: list[dict]) -> list[ChatTurn]:
    return [ChatTurn(**turn) for turn in conversation]


# Run in the trainer venv: its own transformers, as the trainer tokenizes.
_TRAINER_TOKENIZER = """
import json, sys
from transformers import AutoTokenizer

asked = json.load(sys.stdin)
tokenizer = AutoTokenizer.from_pretrained(asked["model"])
chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in asked["conversations"]]
print(json.dumps({
    "chats": [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats],
    "texts": [tokenizer(t)["input_ids"] for t in asked["texts"]],
    "transformers": __import__("transformers").__version__,
}))
"""


def trainer_tokenizer(model: Path, conversations: list[list[dict]], texts: list[str]) -> dict:
    asked = json.dumps({"model": str(model), "conversations": conversations, "texts": texts})
    done = subprocess.run(
        [str(TRAINER_PYTHON), "-c", _TRAINER_TOKENIZER], input=asked, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_worker_renders_and_tokenizes_as_the_trainer_does(real_worker, real_model, client_for):
    client = client_for(real_worker.spool.root)
    chat = ask(client, real_model, messages=[turns(SYSTEM_AND_USER), turns(USER_ONLY)], max_tokens=1)
    text = ask(client, real_model, prompts=[PLAIN_TEXT], max_tokens=1)
    trainer = trainer_tokenizer(real_model, [SYSTEM_AND_USER, USER_ONLY], [PLAIN_TEXT])
    import transformers

    print(f"\nrollout venv transformers {transformers.__version__}, trainer venv {trainer['transformers']}")
    assert chat.prompt_token_ids == trainer["chats"]
    assert text.prompt_token_ids == trainer["texts"]
    # What the template writes: each turn opened by <|im_start|> (id 1) and closed by <|im_end|> (2),
    # the default system turn first where none is given, the assistant's turn opened at the end.
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model)
    rendered = [tokenizer.decode(ids) for ids in chat.prompt_token_ids]
    assert rendered[0].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert rendered[1].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert all(r.endswith("<|im_end|>\n<|im_start|>assistant\n") for r in rendered)


def test_a_greedy_answer_is_right_and_ends_its_turn(real_worker, real_model, client_for):
    client = client_for(real_worker.spool.root)
    result = ask(client, real_model, messages=[turns(SYSTEM_AND_USER)], max_tokens=32)
    [[text]], [[ids]], [[reason]] = result.texts, result.token_ids, result.finish_reasons
    print(f"\nanswer {text!r}, ids {ids}")
    assert "5" in text and reason == "stop" and len(ids) < 32
    # The generation config's end of turn stopped it: the last id is <|im_end|>, not kept in the text.
    generation = json.loads((real_model / "generation_config.json").read_text())
    assert ids[-1] == generation["eos_token_id"] == 2 and "<|im_end|>" not in text
    # The content id the worker reports is the pinned one (make real-model checked the build against it).
    assert result.weights_content_id == json.loads(PIN.read_text())["content_id"]


# -- GRPO on the real model ------------------------------------------------------------------------

USER_REWARDS = '''
"""A reward users write: as many digits in the completion as the row's `digits` field says."""


def digit_count(completions, prompts, digits, **kwargs):
    return [float(sum(ch.isdigit() for ch in text) == want) for text, want in zip(completions, digits)]
'''

SYSTEM_PROMPT = "Answer with the number only."


def addition_rows(n: int) -> list[dict]:
    """Chat rows of two-digit sums, with a field of their own for the user's reward."""
    rows = []
    for i in range(n):
        a, b = 11 + 7 * i % 80, 23 + 5 * i % 70
        question = [{"role": "user", "content": f"What is {a}+{b}?"}]
        rows.append({"messages": question, "answer": a + b, "digits": len(str(a + b))})
    return rows


def test_grpo_steps_on_parquet_chat_rows_with_a_user_reward_function(real_worker, real_model, tmp_path):
    """The whole path a user takes: conversations from a Parquet file with a system prompt, the
    worker rendering them with the model's chat template, the built-in verifier and a reward
    function from a module on PYTHONPATH, two GRPO steps with the published weights served by
    the worker. The prompt ids the trainer trained on are the trainer tokenizer's own rendering."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tmp_path / "sums.parquet"
    pq.write_table(pa.Table.from_pylist(addition_rows(12)), rows)
    module_dir = tmp_path / "user_code"
    module_dir.mkdir()
    (module_dir / "my_rewards.py").write_text(USER_REWARDS)
    run_dir = tmp_path / "run"
    config = write_run_config(
        tmp_path / "run.toml",
        {
            "run": {"dir": run_dir, "seed": 3},
            "model": {"path": real_model, "compile": "off"},
            "data": {"task": "file", "path": rows, "system_prompt": SYSTEM_PROMPT, "held_out": 2},
            "rollout": {
                "spawn": False, "spool": real_worker.spool.root, "prompts_per_step": 2, "samples_per_prompt": 4,
                "max_tokens": 8, "temperature": 1.0, "timeout_s": 600.0,
            },
            "train": {"steps": 2, "lr": 1e-5},
            "loss": {"dead_group_retries": 0},
            "reward": {"functions": ["correct", "my_rewards:digit_count"], "weights": [1.0, 0.5]},
            "publish": {"dir": tmp_path / "weights"},
            "tripwire": {"armed": False},
        },
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(module_dir), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [str(TRAINER), "train", str(config)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward/my_rewards:digit_count"] <= 1.0 for m in metrics)
    assert all("reward/correct" in m and "accuracy" in m for m in metrics)
    # Step 2 was sampled from the weights step 1 published: the worker reloaded them.
    served = [json.loads(p.read_text()) for p in real_worker.spool.done.glob(f"{run_dir.name}-train-*.result.json")]
    assert {Path(r["weights_dir"]).parent for r in served if r["ok"]} >= {tmp_path / "weights"}
    # The ids trained on are the engine's; they equal the trainer venv's own chat rendering.
    requests = [json.loads(p.read_text()) for p in real_worker.spool.done.glob(f"{run_dir.name}-train-*.request.json")]
    conversations = [chat for request in requests for chat in request["messages"]]
    assert all(chat[0] == {"role": "system", "content": SYSTEM_PROMPT} for chat in conversations)
    rendered = trainer_tokenizer(real_model, conversations, [])["chats"]
    engine_ids = {}
    for request in requests:
        result = json.loads(real_worker.spool.done.joinpath(f"{request['request_id']}.result.json").read_text())
        engine_ids.update(zip(map(json.dumps, request["messages"]), result["prompt_token_ids"], strict=True))
    assert [engine_ids[json.dumps(chat)] for chat in conversations] == rendered
