"""``verl-cppack verify-cp``: the user-facing CP check passes for both attention implementations."""

from __future__ import annotations

import argparse
import importlib.metadata
import json

import pytest

from verl_cppack.cli import main
from verl_cppack.cli.verify_cp import verify_batch, verl_forward_available

pytestmark = pytest.mark.slow  # the tiny GPT at CP=1 and CP=2 in gloo processes


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_verify_cp_2_passes_and_writes_the_report(attention, tmp_path):
    report_path = tmp_path / "report.json"
    assert main(["verify-cp", "--cp", "2", "--attention", attention, "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["cp"] == 2 and report["attention"] == attention and report["passed"] is True
    assert report["used_verl_forward"] is _verl_installed()  # auto: verl's forward wherever verl is installed
    assert 0 <= report["logprob_max_abs_diff"] <= 1e-5
    assert 0 <= report["entropy_max_abs_diff"] <= 1e-5
    assert 0 <= report["grad_max_rel_diff"] <= 1e-4
    assert report["tolerances"] == {"logprob_abs": 1e-5, "entropy_abs": 1e-5, "grad_rel": 1e-4}


def _verl_installed() -> bool:
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "2"], "--tp > 1"),
        (["--attention", "ring", "--layout", "contiguous"], "zigzag"),
        (["--cp", "0"], ">= 1"),
    ],
)
def test_verify_cp_refuses_what_it_cannot_check_with_exit_code_2(argv, message, capsys):
    assert main(["verify-cp", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err  # one error line, as every command


def test_the_rollout_batch_has_left_padded_prompts_right_padded_responses_and_a_two_token_row():
    args = argparse.Namespace(batch_size=5, prompt_length=6, response_length=7, seed=3)
    input_ids, mask = verify_batch(args)
    assert input_ids.shape == mask.shape == (5, 13)
    prompt, response = mask[:, :6], mask[:, 6:]
    assert (prompt.int().diff(dim=1) >= 0).all()  # left padding: once valid, valid to the end of the prompt
    assert (response.int().diff(dim=1) <= 0).all()  # right padding
    assert prompt[:, -1].all() and response[:, 0].all()
    assert mask[0].sum() == 2
    assert input_ids.min() >= 0 and input_ids.max() < 97  # inside the tiny GPT's vocabulary


def test_a_stand_in_verl_module_without_a_spec_means_no_verl_forward(monkeypatch):
    """``find_spec("verl")`` raises ``ValueError`` when a ``verl`` module without a spec was imported (a stand-in, as a
    measuring shim makes); ``auto`` then runs verl_cppack's forward instead of crashing."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
    assert verl_forward_available() is False
