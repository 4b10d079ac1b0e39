"""``verl-cppack demo``: the worked example on stdout; bad sizes are one ``error:`` line on stderr and exit 2."""

from __future__ import annotations

import pytest

from verl_cppack.cli import main


@pytest.mark.parametrize("argv, flag", [(["--cp", "0"], "--cp"), (["--tp", "0"], "--tp"), (["--cp", "-3"], "--cp")])
def test_sizes_below_one_are_an_error_line_and_exit_2(capsys, argv, flag):
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} must be >= 1")


def test_the_worked_example_is_printed(capsys):
    assert main(["demo", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: index [0, 3, 4, 7, 8, 9, 14, 15] -> a E d P f g P P (5 valid)" in out
    assert "rank 1: index [1, 2, 5, 6, 10, 11, 12, 13] -> b c e E h i j E (8 valid)" in out
