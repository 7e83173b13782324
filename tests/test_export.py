"""``brace-lightning export``: Hugging Face folders from single-process and sharded checkpoints and at
the end of ``fit``, loading with ``from_pretrained`` to the trainer's log-probs and values, served by
vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from brace_lightning import export as export_module
from brace_lightning.cli import run
from brace_lightning.export import export_checkpoint, load_exported_critic
from brace_lightning.logs import read_scalars
from brace_lightning.models.policy import token_logprobs
from tests.test_checkpoints import BAD_FILES, BAD_IDS, hostile
from tests.test_trainer import small_run

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["3+4=", "9+9=7", "1+1=2 and"]


def _batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask of TEXTS."""
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    return ids, mask


def _assert_same_outputs(module, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(out / "actor")
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", dtype=torch.float32).eval()
    critic = load_exported_critic(out / "critic", dtype=torch.float32).eval()
    ids, mask = _batch(tokenizer)
    assert tokenizer.decode(tokenizer("1+1=2")["input_ids"]) == "1+1=2"
    with torch.no_grad():
        module.actor.eval()
        module.critic.eval()
        want, _ = token_logprobs(module.actor, ids, mask)
        got, _ = token_logprobs(actor, ids, mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(critic(ids, mask), module.critic(ids, mask), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A short quickstart run (its last.ckpt: callbacks.RunCheckpoint) that also exports at fit
    end; (cli, root)."""
    root = tmp_path_factory.mktemp("run")
    cli = run(
        small_run(
            root,
            "--trainer.enable_checkpointing=true",
            "--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd",
            f"--trainer.callbacks.out={root / 'at_fit_end'}",
        )
    )
    return cli, root


def test_export_of_a_checkpoint_file_matches_the_trainer(trained, tmp_path: Path) -> None:
    cli, _ = trained
    ckpt = Path(cli.trainer.checkpoint_callback.last_model_path)
    assert ckpt.is_file()
    out = export_checkpoint(ckpt, tmp_path / "exported")
    _assert_same_outputs(cli.model, out)


def test_the_fit_end_callback_exports_the_final_weights(trained) -> None:
    cli, root = trained
    _assert_same_outputs(cli.model, root / "at_fit_end")


def export_command(ckpt_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run ``brace-lightning export`` as a user would."""
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("brace-lightning")),
            "export",
            f"--ckpt_path={ckpt_path}",
            f"--out={out}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_export_command_refuses_a_missing_checkpoint_with_one_sentence(tmp_path: Path) -> None:
    done = export_command(tmp_path / "nope.ckpt", tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path={str(tmp_path / 'nope.ckpt')!r} does not exist; expected a .ckpt file "
        "or a sharded checkpoint folder."
    )
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_checkpoint_whose_pickle_runs_code_without_running_it(tmp_path: Path):
    """``weights_only=False`` ran the pickle's shell command before export said anything."""
    ckpt, marker = hostile(tmp_path)
    done = export_command(ckpt, tmp_path / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: ckpt_path={str(ckpt)!r} was refused: its pickle asks to call ")
    assert last.endswith(
        "nothing in it was run; expected a Lightning checkpoint written by brace-lightning."
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("make", "sentence"), BAD_FILES[1:], ids=BAD_IDS[1:])
def test_export_refuses_a_damaged_or_foreign_checkpoint_with_one_sentence(
    tmp_path: Path, make, sentence
) -> None:
    ckpt = make(tmp_path)
    with pytest.raises(ValueError) as info:
        export_checkpoint(ckpt, tmp_path / "out")
    # export also needs the run's hyperparameters
    sentence = sentence.replace(
        "'pytorch-lightning_version' and 'state_dict'",
        "'pytorch-lightning_version', 'state_dict' and 'hyper_parameters'",
    )
    assert str(info.value) == f"ckpt_path={str(ckpt)!r} {sentence}"
    assert "weights_only" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _leftovers(folder: Path) -> list[str]:
    """Hidden staging folders ``export`` left beside its target."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_export_refuses_a_non_empty_or_file_target_without_overwrite(trained, tmp_path: Path):
    cli, _ = trained
    ckpt = Path(cli.trainer.checkpoint_callback.last_model_path)
    used = tmp_path / "used"
    (used / "actor").mkdir(parents=True)
    (used / "actor" / "chat_template.jinja").write_text("{{ 'stale' }}")
    with pytest.raises(ValueError) as info:
        export_checkpoint(ckpt, used)
    assert str(info.value) == (
        f"out={str(used)!r} is a folder that is not empty; expected a new or empty folder "
        "(--overwrite replaces it whole)."
    )
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ValueError, match=r"^out='.*afile' is a file; expected a new or empty"):
        export_checkpoint(ckpt, afile)
    assert afile.read_text() == "mine"
    # DIR/actor a file: export used to report success and write no actor.
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "actor").write_text("not a folder")
    done = export_command(ckpt, clash)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: out={str(clash)!r} is a folder that is not empty")
    )
    assert (clash / "actor").read_text() == "not a folder"
    # --overwrite replaces the folder whole: the stale template does not become the model's.
    done = export_command(ckpt, used, "--overwrite")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (used / "actor" / "chat_template.jinja").exists()
    _assert_same_outputs(cli.model, used)
    out = export_checkpoint(ckpt, clash, overwrite=True)
    assert (out / "actor").is_dir() and (out / "actor" / "config.json").is_file()
    out = export_checkpoint(ckpt, afile, overwrite=True)
    assert (out / "critic" / "value_head.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(ckpt, empty)  # an empty folder is fine without --overwrite
    assert (empty / "actor" / "config.json").is_file()
    assert _leftovers(tmp_path) == []


def test_a_failed_export_leaves_no_half_folder(trained, tmp_path: Path, monkeypatch) -> None:
    cli, _ = trained
    ckpt = Path(cli.trainer.checkpoint_callback.last_model_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # The actor is written, then the critic's value head fails.
    monkeypatch.setattr(export_module, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(ckpt, tmp_path / "new")
    assert list(tmp_path.iterdir()) == []
    previous = tmp_path / "previous"
    (previous / "actor").mkdir(parents=True)
    (previous / "actor" / "config.json").write_text("{}")
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(ckpt, previous, overwrite=True)
    assert [p.name for p in previous.iterdir()] == ["actor"]  # the old export, untouched
    assert (previous / "actor" / "config.json").read_text() == "{}"
    assert _leftovers(tmp_path) == []


def test_the_fit_end_export_refuses_a_file_where_a_folder_goes_before_training(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "critic").write_text("not a folder")
    with pytest.raises(ValueError, match=r"^out='.*out' holds a file named critic; expected a"):
        run(
            small_run(
                tmp_path,
                "--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd",
                f"--trainer.callbacks.out={tmp_path / 'out'}",
                steps=1,
            )
        )
    logs = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    assert all(not read_scalars(folder) for folder in logs)  # not one step was trained


@pytest.mark.slow
def test_export_of_a_sharded_fsdp_checkpoint_matches_the_gathered_weights(tmp_path: Path) -> None:
    from tests.test_parallel import _cli, _driver, _weights

    first = tmp_path / "first"
    ckpt = tmp_path / "ckpt"
    _driver(
        first,
        *_cli(tmp_path, "fsdp/cpu_2proc.yaml"),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        # FSDP: gathered on rank 0 only, bucket by bucket (models/weight_sync.py)
        "--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd",
        f"--trainer.callbacks.out={tmp_path / 'at_fit_end'}",
        "--trainer.max_steps=1",
    )
    (checkpoint,) = ckpt.iterdir()
    assert checkpoint.is_dir()
    done = export_command(checkpoint, tmp_path / "exported")
    assert done.returncode == 0, done.stderr[-3000:]
    gathered = _weights(first)  # the full weights rank 0 gathered at the end of that run
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / "actor")
    critic = load_exported_critic(tmp_path / "exported" / "critic")
    at_fit_end = AutoModelForCausalLM.from_pretrained(tmp_path / "at_fit_end" / "actor")
    critic_at_fit_end = load_exported_critic(tmp_path / "at_fit_end" / "critic")
    for name, state in (
        ("actor", actor.state_dict()),
        ("critic", critic.state_dict()),
        ("actor", at_fit_end.state_dict()),
        ("critic", critic_at_fit_end.state_dict()),
    ):
        for key, tensor in gathered[name].items():
            torch.testing.assert_close(state[key], tensor, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_exported_actor_with_the_trainer_log_probs(trained, tmp_path: Path) -> None:
    from tests.support.vllm_support import require_vllm

    require_vllm()
    import vllm

    cli, root = trained
    out = root / "at_fit_end" / "actor"
    llm = vllm.LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=0)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=tokenizer(t)["input_ids"]) for t in TEXTS]
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:  # now, not whenever the LLM is garbage-collected (vLLM then tears down process state)
        llm.llm_engine.engine_core.shutdown()
    actor = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gap = 0.0
    for result in results:
        sample = result.outputs[0]
        ids = torch.tensor([list(result.prompt_token_ids) + list(sample.token_ids)])
        with torch.no_grad():
            want, _ = token_logprobs(actor, ids, torch.ones_like(ids, dtype=torch.bool))
        start = len(result.prompt_token_ids)
        for i, (token, logprobs) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            gap = max(gap, abs(logprobs[token].logprob - float(want[0, start + i])))
    assert gap < 1e-3
