"""Your own prompts and reward: JSONLPrompts/HFPrompts field mapping, chat-template encoding, and a
run from a working directory that holds a prompt file and a reward module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from brace_lightning.models.tokenizer import build_char_tokenizer
from brace_lightning.tasks import HFPrompts, JSONLPrompts, Prompt
from brace_lightning.tasks.base import encode_prompt, encode_prompts
from brace_lightning.warmstart import _encode_pairs

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


def test_jsonl_prompts_map_fields_and_keep_the_rest(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"q": "1+2=", "label": 3, "id": 7}, {"q": "4+4=", "label": "8", "id": 8}],
    )
    source = JSONLPrompts(
        str(path), prompt_field="q", answer_field="label", template="Q: {prompt}", limit=1
    )
    assert len(source) == 1
    prompt = source[0]
    assert prompt.text == "Q: 1+2="
    assert prompt.answer == "3"
    assert prompt.metadata["id"] == 7 and prompt.metadata["label"] == 3
    assert "q" not in prompt.metadata
    assert prompt.metadata["source"].endswith("p.jsonl:1")


def test_jsonl_prompts_errors_name_the_line_and_the_field(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a", "answer": "b"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        JSONLPrompts(str(bad_json))
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ValueError, match=r"p.jsonl:1: prompt_field='prompt' is not a field"):
        JSONLPrompts(str(path))
    with pytest.raises(ValueError, match="no '{prompt}' field"):
        JSONLPrompts(str(path), prompt_field="question", template="Q:")
    with pytest.raises(ValueError, match="expected an existing JSONL file"):
        JSONLPrompts(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        JSONLPrompts(str(empty))


def test_hf_prompts_map_a_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    # `datasets` is an optional extra; a stand-in module isolates the mapping from the download.
    calls = []

    def load_dataset(name: str, config: str | None, split: str) -> list[dict]:
        calls.append((name, config, split))
        return [{"problem": "2*3=", "solution": "6"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    source = HFPrompts(
        "me/data", split="test", prompt_field="problem", answer_field="solution", system_prompt="S"
    )
    assert calls == [("me/data", None, "test")]
    assert (source[0].text, source[0].answer, source[0].metadata["system"]) == ("2*3=", "6", "S")


def test_hf_prompts_without_datasets_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[datasets\]'"):
        HFPrompts("me/data")


def test_plain_tokenizer_encodes_text_as_is_with_the_system_prompt_first() -> None:
    tokenizer = build_char_tokenizer()
    assert not tokenizer.chat_template
    plain = Prompt("1+2=", "3")
    assert encode_prompt(tokenizer, plain) == tokenizer("1+2=")["input_ids"]
    with_system = Prompt("1+2=", "3", {"system": "Add."})
    assert tokenizer.decode(encode_prompt(tokenizer, with_system)) == "Add.\n\n1+2="
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        encode_prompt(tokenizer, Prompt("x", "y", {"chat_template": True}))


def test_chat_template_renders_system_and_user_turns_by_default() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    prompt = Prompt("1+2=", "3", {"system": "Add."})
    ids = encode_prompt(tokenizer, prompt)
    assert tokenizer.decode(ids) == "<system>Add.\n<user>1+2=\n<assistant>"
    off = Prompt("1+2=", "3", {"chat_template": False})
    assert encode_prompts(tokenizer, [off]) == [tokenizer("1+2=")["input_ids"]]


def test_warm_start_encodes_prompts_with_the_chat_template_like_the_rollouts() -> None:
    # The warm start teaches the answer format in the context the engine will sample it in.
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    [(ids, labels)] = _encode_pairs(tokenizer, [("1+2=", "3")])
    rollout_ids = encode_prompts(tokenizer, [Prompt("1+2=", "3")])[0]
    assert tokenizer.decode(rollout_ids) == "<user>1+2=\n<assistant>"
    completion = tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == rollout_ids + completion
    assert labels == [-100] * len(rollout_ids) + completion


REWARD_MODULE = """
from brace_lightning.tasks import RewardFunction


class FirstLine(RewardFunction):
    def __call__(self, prompt, completion):
        return float(completion.strip().split("\\n")[0] == prompt.answer)
"""


@pytest.mark.slow
def test_console_script_runs_your_prompts_and_reward_from_the_working_directory(
    tmp_path: Path,
) -> None:
    write_jsonl(
        tmp_path / "mine.jsonl",
        [{"question": f"{a}+{b}=", "label": str(a + b)} for a in range(3) for b in range(3)],
    )
    (tmp_path / "myreward.py").write_text(REWARD_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # the package under test, not the working directory
    command = [
        str(Path(sys.executable).with_name("brace-lightning")),
        "fit",
        "--config",
        str(REPO / "configs/quickstart.yaml"),
        "--config",
        str(REPO / "configs/tasks/my_prompts.yaml"),
        "--data.task.init_args.path=mine.jsonl",
        "--data.reward=myreward.FirstLine",
        "--data.prompts_per_step=2",
        "--data.samples_per_prompt=2",
        "--data.engine.init_args.max_new_tokens=4",
        "--trainer.limit_train_batches=2",
        "--trainer.logger.init_args.save_dir=runs",
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_epochs=1` reached" in result.stderr + result.stdout
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints/my_prompts/last.ckpt").is_file()


def test_a_relative_data_path_is_read_from_the_working_directory_then_the_recipe_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from brace_lightning.tasks import base

    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    (project / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(base, "RECIPE_ROOTS", [])
    assert base.project_root(project / "configs" / "x.yaml") == project
    with pytest.raises(ValueError, match="from the project folder of a --config"):
        JSONLPrompts("data.jsonl")
    base.RECIPE_ROOTS.append(project)
    assert base.resolve_data_path("data.jsonl") == project / "data.jsonl"
    assert [p.text for p in JSONLPrompts("data.jsonl").prompts] == ["1+1="]
    (elsewhere / "data.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    assert [p.text for p in JSONLPrompts("data.jsonl").prompts] == ["2+2="]  # the working dir wins


@pytest.mark.slow
def test_the_my_prompts_recipe_runs_from_any_folder(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "brace_lightning.cli",
            "fit",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "--config",
            str(REPO / "configs" / "tasks" / "my_prompts.yaml"),
            "--trainer.limit_train_batches=2",
            "--data.prompts_per_step=2",
            "--data.samples_per_prompt=2",
            "--data.engine.init_args.max_new_tokens=8",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "my_prompts" / "last.ckpt").is_file()
