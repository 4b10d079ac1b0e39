"""The one multi-process harness (``verl_cppack.runtime.gloo_world.run_world``), held to its promise:

- every rank runs in its own process of one gloo group, with the environment asked for, and the values come back
  in rank order, tensors as plain copies;
- a rank that raises, or exits without reporting, is named in ``RankFailed`` (its exception's line), the other
  ranks are stopped rather than left waiting, and nothing is left running;
- bad arguments are refused before anything starts.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from verl_cppack.runtime.gloo_world import RankFailed, run_world


def report_rank(rank: int, world_size: int, offset: int) -> dict:
    import torch.distributed as dist

    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return {"rank": rank, "pid": os.getpid(), "sum": total, "marker": os.environ.get("VERL_CPPACK_TEST_MARKER")}


def fail_on_rank_one(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 would wait here for ever: the harness must stop it


def exit_silently_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)


def test_values_come_back_in_rank_order_from_one_group_with_the_environment():
    results = run_world(report_rank, 3, 10, environment={"VERL_CPPACK_TEST_MARKER": "set"})
    assert [result["rank"] for result in results] == [0, 1, 2]
    assert len({result["pid"] for result in results} | {os.getpid()}) == 4  # three processes besides this one
    assert all(torch.equal(result["sum"], torch.tensor([33])) for result in results)  # 10 + 11 + 12
    assert {result["marker"] for result in results} == {"set"}


def test_a_failing_rank_is_named_and_the_others_are_stopped():
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError: rank one cannot go on") as failure:
        run_world(fail_on_rank_one, 2)
    assert failure.value.rank == 1 and "Traceback" in failure.value.report
    assert multiprocessing.active_children() == []


def test_a_rank_that_exits_without_reporting_is_named():
    with pytest.raises(RankFailed, match="rank 0 exited with code 7 without reporting"):
        run_world(exit_silently_on_rank_zero, 2)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("world_size, backend", [(0, "gloo"), (True, "gloo"), (2, "mpi")])
def test_bad_arguments_are_refused(world_size, backend):
    with pytest.raises(ValueError, match="world_size|backend"):
        run_world(report_rank, world_size, 0, backend=backend)
