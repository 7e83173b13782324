"""The benchmark scripts' shared argparse types: one error sentence per bad value."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import long_responses
from benchmarks._common import model_size, positive_int
from benchmarks.long_responses import failure, ladder


def test_model_size_parses_hidden_by_layers_and_names_the_expected_form():
    assert model_size("64x1") == (64, 1)
    assert model_size("1024x8") == (1024, 8)
    for bad in ("64", "64x", "x2", "0x1", "64x0", "64x1x2", "-64x1"):
        with pytest.raises(
            argparse.ArgumentTypeError, match=f"HIDDENxLAYERS such as 64x1; got '{bad}'"
        ):
            model_size(bad)


def test_positive_int_refuses_zero_negatives_and_text():
    assert positive_int("3") == 3
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"integer >= 1; got '{bad}'"):
            positive_int(bad)


def test_a_bad_size_on_the_command_line_is_one_error_naming_the_argument(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", type=model_size)
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "32x1", "32"])
    assert (
        "argument --sizes: expected HIDDENxLAYERS such as 64x1; got '32'" in capsys.readouterr().err
    )


def test_the_length_ladder_doubles_up_to_its_cap_and_a_failed_rung_says_why_in_a_few_words():
    assert ladder(4096, 32768) == [4096, 8192, 16384, 32768]
    assert ladder(1000, 3000) == [1000, 2000, 3000]
    assert ladder(64, 64) == [64]
    oom = "Traceback ...\nRuntimeError: DefaultCPUAllocator: can't allocate memory: you tried"
    assert failure(oom) == "out of memory"
    assert failure("x\nMemoryError\n") == "out of memory"
    cuda_oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.55 GiB."
    assert failure(cuda_oom) == "out of memory"
    assert failure("ImportError: a | b\n\n") == "ImportError: a / b"  # keeps the table's cells
    assert failure("") == "no error output"


def test_the_ladders_cpu_address_space_cap_is_refused_on_a_gpu_in_one_sentence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["long_responses", "--largest", "--device", "cuda", "--memory-gib", "40"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit):
        long_responses.main()
    assert (
        "--memory-gib caps the CPU's address space; got 40.0 with --device cuda, whose cap is "
        "the GPU's own memory" in capsys.readouterr().err
    )
