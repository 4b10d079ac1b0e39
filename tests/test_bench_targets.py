"""`verl-cppack bench --strict`: the target checker read on made-up result rows (no timing is measured here).

Every figure below is chosen by hand against the targets: B=1 preprocess >= 2x verl and postprocess >= 1.3x;
B >= 4 preprocess >= 3x and postprocess within 0.3 ms of its floor; B=256 preprocess >= 70% of the copies-only
ratio; <= 24 ATen ops and <= 1 host sync per micro-batch, flat in B; peak extra memory <= verl's.
"""

from __future__ import annotations

import copy

import pytest

from verl_cppack.bench.targets import missed_targets


def row(batch_size=4, seq_len=1024, cp_size=2, **changes):
    """A point that meets every target: verl 1.0 / ours 0.25 / floor 0.1 ms preprocess (4x, copies-only 10x, ours at
    40% of the floor's speed: the B=256 target alone would miss it), postprocess verl 2.0 / ours 1.2 / floor 1.0 ms."""
    point = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "cp_size": cp_size,
        "verl": {
            "preprocess_ms": 1.0,
            "postprocess_ms": 2.0,
            "step_ms": 3.0,
            "aten_ops": 300,
            "host_syncs": 20,
            "peak_extra_mb": 1.0,
        },
        "verl_cppack": {
            "preprocess_ms": 0.25,
            "postprocess_ms": 1.2,
            "step_ms": 1.45,
            "aten_ops": 24,
            "host_syncs": 1,
            "peak_extra_mb": 1.0,
        },
        "floor": {"preprocess_ms": 0.1, "postprocess_ms": 1.0, "step_ms": 1.1, "all_gathers_ms": 0.9},
    }
    for path, value in changes.items():
        impl, key = path.split("__")
        point[impl][key] = value
    return point


def large_batch_row(**changes):
    """B=256 meeting every target: ours 0.125 ms against the floor's 0.1 ms (80% of the floor's speed)."""
    return row(batch_size=256, **{"verl_cppack__preprocess_ms": 0.125, **changes})


def test_points_that_meet_every_target_pass():
    assert missed_targets([row(batch_size=1), row(batch_size=4), row(batch_size=16), large_batch_row()]) == []


def test_exactly_at_each_target_is_met():
    at_b1 = row(batch_size=1, verl_cppack__preprocess_ms=0.5, verl_cppack__postprocess_ms=2.0 / 1.3)  # 2.0x, 1.3x
    at_b4 = row(verl_cppack__preprocess_ms=1 / 3, verl_cppack__postprocess_ms=1.25)  # 3.0x, 0.25 ms above
    at_share = large_batch_row(verl_cppack__preprocess_ms=0.1 / 0.7)  # 70% of the floor's speed
    assert missed_targets([at_b1, at_b4, at_share]) == []


@pytest.mark.parametrize(
    ("point", "expected"),
    [
        (
            row(batch_size=1, verl_cppack__preprocess_ms=0.6),
            "B=1 S=1024 CP=2: preprocess 1.67× verl's speed (target ≥ 2.0×)",
        ),
        (
            row(batch_size=1, verl_cppack__postprocess_ms=1.6),
            "B=1 S=1024 CP=2: postprocess 1.25× verl's speed (target ≥ 1.3×)",
        ),
        (
            row(batch_size=4, verl_cppack__preprocess_ms=0.4),
            "B=4 S=1024 CP=2: preprocess 2.50× verl's speed (target ≥ 3.0×)",
        ),
        (
            row(batch_size=64, verl_cppack__postprocess_ms=1.5),
            "B=64 S=1024 CP=2: postprocess 0.50 ms above its floor (all-gathers plus one copy: 1.00 ms; target ≤ 0.3 ms)",
        ),
        (
            row(batch_size=256),
            "B=256 S=1024 CP=2: preprocess 4.0× verl's speed is 40% of the copies-only 10.0× (target ≥ 70%)",
        ),
        (large_batch_row(verl_cppack__aten_ops=25), "B=256 S=1024 CP=2: 25 ATen ops per micro-batch (target ≤ 24)"),
        (row(verl_cppack__host_syncs=2), "B=4 S=1024 CP=2: 2 host syncs per micro-batch (target ≤ 1)"),
        (
            row(verl_cppack__peak_extra_mb=1.5),
            "B=4 S=1024 CP=2: peak extra memory 1.5 MB, verl's 1 MB (target: no more than verl's)",
        ),
    ],
    ids=[
        "b1-preprocess",
        "b1-postprocess",
        "b4-preprocess",
        "b64-postprocess-floor",
        "b256-copies-only",
        "ops",
        "syncs",
        "memory",
    ],
)
def test_each_missed_target_is_one_line_naming_the_point_the_figure_and_the_target(point, expected):
    assert missed_targets([point]) == [expected]


def test_the_b1_targets_are_not_the_b4_ones():
    """At B=1 a 2.5x preprocess is enough and the postprocess is held to 1.3x verl's speed, not to its floor."""
    b1 = row(batch_size=1, verl_cppack__preprocess_ms=0.4, verl_cppack__postprocess_ms=1.5)  # 2.5x, 1.33x, 0.5 ms above
    assert missed_targets([b1]) == []
    assert len(missed_targets([row(batch_size=4, verl_cppack__preprocess_ms=0.4)])) == 1


def test_op_counts_must_be_the_same_for_every_batch_size_of_a_series():
    flat_elsewhere = [
        row(batch_size=4, seq_len=4096, verl_cppack__aten_ops=20),
        row(batch_size=16, seq_len=4096, verl_cppack__aten_ops=20),
    ]
    growing = [row(batch_size=4, verl_cppack__aten_ops=20), row(batch_size=16, verl_cppack__aten_ops=22)]
    assert missed_targets(flat_elsewhere + growing) == [
        "S=1024 CP=2: ATen ops per micro-batch differ across B (B=4: 20, B=16: 22; target: the same for every B)"
    ]


def test_every_missed_target_of_a_point_is_named():
    point = row(batch_size=1, verl_cppack__preprocess_ms=2.0, verl_cppack__host_syncs=3, verl_cppack__aten_ops=40)
    missed = missed_targets([point])
    assert (
        len(missed) == 3
        and "preprocess 0.50×" in missed[0]
        and "40 ATen ops" in missed[1]
        and "3 host syncs" in missed[2]
    )


def test_the_vlm_mask_builders_sync_at_most_once_and_are_never_slower():
    point = row()
    point["vlm_masks"] = {
        "thd": {"verl": {"ms": 1.0, "host_syncs": 9}, "verl_cppack": {"ms": 0.5, "host_syncs": 1}},
        "bshd": {"verl": {"ms": 1.0, "host_syncs": 9}, "verl_cppack": {"ms": 0.5, "host_syncs": 1}},
    }
    assert missed_targets([point]) == []
    slow = copy.deepcopy(point)
    slow["vlm_masks"]["bshd"]["verl_cppack"].update(ms=2.0, host_syncs=2)
    assert missed_targets([slow]) == [
        "VLM bshd B=4 S=1024: 2 host syncs per call (target ≤ 1)",
        "VLM bshd B=4 S=1024: 0.50× verl's speed (target: never slower)",
    ]


def test_strict_exits_1_naming_each_missed_target_and_0_when_all_are_met(tmp_path, monkeypatch, capsys):
    from verl_cppack.cli import bench, main

    argv = ["bench", "--batch-sizes", "1,4", "--seq-lens", "1024", "--cp-sizes", "2", "--output", str(tmp_path)]
    monkeypatch.setattr(bench, "write_outputs", lambda rows, settings, output, machine: {})  # no plot to draw
    monkeypatch.setattr(bench, "run_benchmark", lambda settings: [row(batch_size=1), row(verl_cppack__host_syncs=2)])
    assert main([*argv, "--strict"]) == 1
    out = capsys.readouterr().out
    assert "target missed: B=4 S=1024 CP=2: 2 host syncs per micro-batch (target ≤ 1)" in out
    assert out.count("target missed:") == 1
    assert main(argv) == 0  # without --strict a miss is reported, not an error
    capsys.readouterr()
    monkeypatch.setattr(bench, "run_benchmark", lambda settings: [row(batch_size=1), row()])
    assert main([*argv, "--strict"]) == 0
    assert "every target met" in capsys.readouterr().out
