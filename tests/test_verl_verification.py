"""The runtime check: a drop-in checks its first calls against verl's own function and puts verl's back when they
differ (``runtime_check.VerifiedDropIn``); on the tested releases nothing is wrapped.

Stand-in pairs (``verl`` / ``ours``) drive every outcome here — equal, different, verl raising, ours raising,
verl rewriting its arguments — and a 2-rank gloo world checks that a CP group decides together. The real verl
releases: ``tests/test_verl_changed_release.py`` (a stand-in verl 0.10.0 whose functions changed their results).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_gloo
from verl_cppack.integrations.verl import comparison, runtime_check
from verl_cppack.integrations.verl.runtime_check import MAX_TRIES, STEP_ASIDE_AFTER, BehaviourChanged, VerifiedDropIn

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"


def verl_double(x: torch.Tensor, need_roll: bool = False) -> torch.Tensor:
    return x * 2


def our_double(x: torch.Tensor, need_roll: bool = False) -> torch.Tensor:
    return x * 2


def verl_double_plus_one(x: torch.Tensor, need_roll: bool = False) -> torch.Tensor:
    return x * 2 + 1


class Bindings:
    """Records what the wrapper asked to put back or to bind instead of itself."""

    def __init__(self) -> None:
        self.put_back: list[tuple[str, str]] = []
        self.stepped_aside: list[str] = []

    def wrap(self, verl, ours, release="0.10.0", name="preprocess_packed_seqs") -> VerifiedDropIn:
        return VerifiedDropIn(
            name,
            verl,
            ours,
            release,
            on_put_back=lambda n, reason: self.put_back.append((n, reason)),
            on_step_aside=lambda n, function: self.stepped_aside.append(n),
        )


# ------------------------------------------------------------------------------------------------ when
@pytest.mark.parametrize(
    ("value", "release", "expected"),
    [
        ("", "0.9.1", False),
        ("", "0.6.1", False),
        ("", "0.10.0", True),
        ("", None, True),
        ("1", "0.9.1", True),
        ("true", "0.8.0", True),
        ("0", "0.10.0", False),
        ("off", None, False),
    ],
)
def test_verification_runs_on_untested_releases_or_when_asked(monkeypatch, value, release, expected):
    monkeypatch.setenv(runtime_check.VERIFY_ENV, value)
    assert runtime_check.wanted(release) is expected


def test_design_md_describes_exactly_the_intended_differences_the_library_excuses():
    """Each row of docs/design.md's table opens with a key and its releases as ``comparison`` renders them, in
    order, and the table has no other row."""
    section = DESIGN.read_text().split("### Intended differences", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    expected = comparison.intended_rows()
    assert len(table) == len(expected), (len(table), len(expected))
    for line, opening in zip(table, expected):
        assert line.startswith(opening + " "), (line[:80], opening)


def test_an_untested_release_is_excused_what_the_newest_tested_one_is():
    newest = comparison.intended_keys("0.9.1")
    assert comparison.intended_keys("0.10.0") == newest == comparison.intended_keys(None)
    assert not {"positions-back-chunk", "positions-padding", "nested-float32-cp"} & newest  # older releases' bugs
    assert {"roll-last-token", "roll-padding", "positions-roll"} <= newest
    assert {"positions-back-chunk", "positions-padding"} <= comparison.intended_keys("0.7.1")


def test_release_ranges_are_read_over_the_tested_releases():
    assert comparison.releases_of("0.7.1–0.9.0") == ("0.7.1", "0.8.0", "0.9.0")
    assert comparison.releases_of("0.6.1, 0.9.1") == ("0.6.1", "0.9.1")
    with pytest.raises(ValueError, match="not one of the tested releases"):
        comparison.releases_of("0.5.0")


# ------------------------------------------------------------------------------------------------ outcomes
def test_an_equal_drop_in_is_kept_and_steps_aside_once_its_modes_are_verified():
    bindings = Bindings()
    check = bindings.wrap(verl_double, our_double)
    x = torch.arange(4)
    assert torch.equal(check.function(x), x * 2)
    assert torch.equal(check.function(x, need_roll=True), x * 2)  # a new mode: checked too
    assert check.checks == 2 and len(check.verified) == 2
    for _ in range(STEP_ASIDE_AFTER):
        check.function(x)
    assert bindings.stepped_aside == ["preprocess_packed_seqs"] and check.stepped_aside
    assert check.checks == 2 and bindings.put_back == []


def test_a_different_result_puts_verls_function_back_with_one_warning_naming_it():
    bindings = Bindings()
    check = bindings.wrap(verl_double_plus_one, our_double)
    x = torch.arange(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = check.function(x)
        second = check.function(x)
    assert torch.equal(first, x * 2 + 1) and torch.equal(second, x * 2 + 1)  # verl's results, from the first call
    [(name, reason)] = bindings.put_back
    assert name == "preprocess_packed_seqs" and reason.startswith("values: verl [1, 3, 5, 7], ours [0, 2, 4, 6]")
    [warning] = [w for w in caught if issubclass(w.category, BehaviourChanged)]
    assert "verl 0.10.0's preprocess_packed_seqs" in str(warning.message)
    assert "values: verl [1, 3, 5, 7]" in str(warning.message) and "put back" in str(warning.message)
    assert check.state()["put_back"] == reason


def test_an_intended_difference_of_the_release_is_excused():
    """The newest release's roll at the last token (``roll-last-token``) is excused, a value elsewhere is not."""
    nested = torch.nested.nested_tensor([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], layout=torch.jagged)

    def verl_pre(input_ids, need_roll=False):  # verl's roll: each last token takes the next sequence's first
        values = input_ids.values()
        return (torch.roll(values, -1) if need_roll else values).unsqueeze(0), None

    def our_pre(input_ids, need_roll=False):  # ours wraps inside the sequence
        values = input_ids.values()
        if need_roll:
            values = torch.cat([torch.roll(part, -1) for part in input_ids.unbind()])
        return values.unsqueeze(0), None

    bindings = Bindings()
    check = bindings.wrap(verl_pre, our_pre, name="preprocess_packed_seqs_no_padding")
    check.function(nested, need_roll=True)
    assert bindings.put_back == [] and len(check.verified) == 1

    def our_wrong(input_ids, need_roll=False):
        packed, params = our_pre(input_ids, need_roll)
        return packed.masked_fill(packed == 6, 0), params  # a token that is not a last one

    bindings = Bindings()
    bindings.wrap(verl_pre, our_wrong, name="preprocess_packed_seqs_no_padding").function(nested, need_roll=True)
    assert [name for name, _ in bindings.put_back] == ["preprocess_packed_seqs_no_padding"]


def test_where_verl_raises_the_check_moves_to_the_next_call_a_bounded_number_of_times():
    calls = {"n": 0}

    def verl_fails_twice(x, need_roll=False):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("verl's crash on short sequences")
        return x * 2

    bindings = Bindings()
    check = bindings.wrap(verl_fails_twice, our_double)
    x = torch.arange(3)
    for _ in range(3):
        assert torch.equal(check.function(x), x * 2)
    assert check.checks == 3 and len(check.verified) == 1 and check.state()["unverified"] == []

    def verl_always_fails(x, need_roll=False):
        raise RuntimeError("never runs")

    check = bindings.wrap(verl_always_fails, our_double)
    for _ in range(MAX_TRIES + 3):
        check.function(x)
    assert check.checks == MAX_TRIES and bindings.put_back == []
    assert check.state()["unverified"] == [f"verl's function raised on each of its first {MAX_TRIES} checks"]


def test_where_ours_raises_and_verl_does_not_verls_function_is_put_back_and_its_result_returned():
    def ours_fails(x, need_roll=False):
        raise ValueError("ours refuses")

    bindings = Bindings()
    result = bindings.wrap(verl_double, ours_fails).function(torch.arange(3))
    assert torch.equal(result, torch.arange(3) * 2)
    assert bindings.put_back[0][1].startswith("ours raised where verl's did not (ValueError: ours refuses")


def test_both_raising_is_bad_input_ours_is_raised_and_nothing_is_decided():
    def verl_fails(x, need_roll=False):
        raise RuntimeError("verl")

    def ours_fails(x, need_roll=False):
        raise ValueError("x must be a tensor")

    bindings = Bindings()
    check = bindings.wrap(verl_fails, ours_fails)
    with pytest.raises(ValueError, match="x must be a tensor"):
        check.function(torch.arange(3))
    assert check.verified == set() and check.tries == {} and bindings.put_back == []


def test_verls_function_runs_on_copies_so_it_cannot_change_what_ours_reads():
    """verl's postprocess_packed_seqs_for_dict_output rebinds ``output.entropy`` and writes into tensors."""

    def verl_rewrites(labels, output):
        output.entropy = output.entropy.view(1, -1)
        labels.zero_()
        return {"entropy": output.entropy.view(-1) * 1}

    def ours(labels, output):
        assert output.entropy.dim() == 1 and labels.sum() == 3, "verl's rewrite reached ours"
        return {"entropy": output.entropy * 1}

    from dataclasses import dataclass

    @dataclass
    class Output:
        entropy: torch.Tensor

    bindings = Bindings()
    output, labels = Output(torch.rand(3)), torch.ones(3)
    bindings.wrap(verl_rewrites, ours, name="postprocess_packed_seqs_for_dict_output").function(labels, output)
    assert bindings.put_back == [] and output.entropy.dim() == 1 and labels.sum() == 3


def test_an_integer_attention_mask_is_not_compared():
    """``integer-masks``: verl indexes with a 0/1 integer mask (positions 0 and 1): nothing to verify against."""

    def verl_indexes(input_ids, attention_mask):
        return input_ids[attention_mask]

    def ours(input_ids, attention_mask):
        return input_ids[attention_mask.bool()]

    bindings = Bindings()
    check = bindings.wrap(verl_indexes, ours)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 0]])
    assert torch.equal(check.function(ids, mask), torch.tensor([5, 6]))
    assert bindings.put_back == [] and check.verified == set()
    check.function(ids, mask.bool())
    assert len(check.verified) == 1


def test_the_mode_tells_flags_and_optional_arguments_apart():
    import inspect

    signature = inspect.signature(lambda x, need_roll=False, n=None, layout="zigzag": None)
    modes = {
        runtime_check.mode_of(signature.bind(*args, **kwargs))
        for args, kwargs in [
            ((torch.zeros(2),), {}),
            ((torch.ones(3),), {}),  # another tensor of the same kind: the same mode
            ((torch.zeros(2),), {"need_roll": True}),
            ((torch.zeros(2),), {"n": 4}),
            ((torch.zeros(2),), {"n": 5}),  # another number: the same mode
            ((torch.zeros(2),), {"layout": "contiguous"}),
        ]
    }
    assert len(modes) == 4


def test_a_copied_argument_is_a_new_tensor_without_autograd():
    x = torch.rand(3, requires_grad=True)
    namespace = SimpleNamespace(a=x)
    copied = runtime_check.copy_argument([x, {"k": x}, namespace])
    assert copied[0] is not x and not copied[0].requires_grad and torch.equal(copied[0], x)
    assert copied[1]["k"] is not x and copied[2] is namespace  # an object that is no dataclass is shared


# ------------------------------------------------------------------------------------------------ together
def _decide_worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    try:
        bindings = Bindings()

        def verl_differs_on_rank_1(x, need_roll=False):
            return x * 2 + (1 if rank == 1 else 0)

        check = bindings.wrap(verl_differs_on_rank_1, our_double)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BehaviourChanged)
            first = check.function(torch.arange(3)).tolist()
        after = check.function(torch.arange(3)).tolist()

        raised = {"n": 0}

        def verl_raises_on_rank_0_once(x, need_roll=False):
            raised["n"] += 1
            if rank == 0 and raised["n"] == 1:
                raise RuntimeError("rank 0's verl crashes on its first call")
            return x * 2

        second_check = Bindings().wrap(verl_raises_on_rank_0_once, our_double)
        second_check.function(torch.arange(3))
        verified_after_one = len(second_check.verified)
        second_check.function(torch.arange(3))
        return {
            "put_back": [name for name, _ in bindings.put_back],
            "reason": bindings.put_back[0][1] if bindings.put_back else None,
            "first": first,
            "after": after,
            "verified_after_one": verified_after_one,
            "verified_after_two": len(second_check.verified),
            "checks": second_check.checks,
        }
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow
def test_the_ranks_of_a_cp_group_decide_together():
    pytest.importorskip("megatron.core")
    rank0, rank1 = run_gloo(_decide_worker, 2)
    # rank 0 found its results equal, rank 1 did not: both put verl's back at the same call
    assert rank0["put_back"] == rank1["put_back"] == ["preprocess_packed_seqs"]
    assert rank0["reason"] == "another rank of the CP group found a difference"
    assert rank1["reason"].startswith("values: verl [1, 3, 5]")
    assert rank0["first"] == rank0["after"] == [0, 2, 4] and rank1["first"] == rank1["after"] == [1, 3, 5]
    # verl raised on rank 0 only: neither rank decides, both check the next call and agree there
    for rank in (rank0, rank1):
        assert rank["verified_after_one"] == 0 and rank["verified_after_two"] == 1 and rank["checks"] == 2


# ------------------------------------------------------------------------------------------------ tested releases
def test_on_a_tested_release_the_drop_ins_are_bound_unwrapped(monkeypatch):
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")
    monkeypatch.delenv(runtime_check.VERIFY_ENV, raising=False)
    from verl.models.mcore import model_forward

    from verl_cppack.integrations.verl import dropins, patching

    was_installed = patching.is_installed()
    patching.uninstall()
    try:
        patching.install()
        status = patching.status()
        assert status["release"] in comparison.TESTED_RELEASES and status["verifying"] is False
        assert model_forward.preprocess_packed_seqs is dropins.preprocess_packed_seqs  # no wrapper, no cost
        assert runtime_check.verification_of(model_forward.postprocess_thd_engine) is None
        monkeypatch.setenv(runtime_check.VERIFY_ENV, "1")
        patching.uninstall()
        patching.install()
        assert patching.status()["verifying"] is True
        assert runtime_check.verification_of(model_forward.preprocess_packed_seqs) is not None
    finally:
        patching.uninstall()
        monkeypatch.delenv(runtime_check.VERIFY_ENV, raising=False)
        if was_installed:
            patching.install()


def test_a_put_back_function_is_verls_in_every_module_and_on_later_imports(monkeypatch):
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")
    monkeypatch.setenv(runtime_check.VERIFY_ENV, "1")
    from verl.models.mcore import model_forward, util

    from verl_cppack.integrations.verl import patching

    was_installed = patching.is_installed()
    patching.uninstall()
    try:
        patching.install()
        original = patching.originals()["preprocess_packed_seqs"]
        patching.put_back("preprocess_packed_seqs", "values: a test")
        assert model_forward.preprocess_packed_seqs is original and util.preprocess_packed_seqs is original
        assert "preprocess_packed_seqs" not in patching.originals()
        status = patching.status()
        assert status["put_back"] == {"preprocess_packed_seqs": "values: a test"}
        assert all("preprocess_packed_seqs" not in names for names in status["covered"].values())
        assert model_forward.preprocess_packed_seqs is original  # status() re-patches nothing put back
    finally:
        patching.uninstall()
        monkeypatch.delenv(runtime_check.VERIFY_ENV, raising=False)
        if was_installed:
            patching.install()
    assert model_forward.postprocess_packed_seqs.__module__.startswith("verl")


def test_a_release_is_read_beside_util_without_importing_verl(tmp_path):
    from verl_cppack.integrations.verl.patching import release_of

    util_file = tmp_path / "verl" / "models" / "mcore" / "util.py"
    util_file.parent.mkdir(parents=True)
    util_file.write_text("")
    (tmp_path / "verl" / "version").mkdir()
    (tmp_path / "verl" / "version" / "version").write_text("0.10.0\n")
    assert release_of(SimpleNamespace(__file__=str(util_file))) == "0.10.0"
