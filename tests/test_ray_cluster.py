"""What a job asks of a Ray cluster, decided before verl starts, and what it hands its workers (Ray is started only by the
two tests marked slow, which hold a real local cluster).

- ``ParallelShape``: workers = tp x cp x dp, the same number on each of ``nnodes`` nodes;
- ``capacity_problem``: a cluster holds the job only with ``workers / nnodes`` slots (Ray GPUs) and 3 CPUs per slot
  on each of ``nnodes`` nodes (verl's placement-group bundles, packed per node), CPUs besides for verl's other
  actors, and all of it free; otherwise one line naming what is there, what is needed, and how to start the nodes;
- ``worker_environment``: gloo on loopback on one node, on each node's own interface across nodes, the user's
  choice kept; the drop-in records through Ray's key-value store;
- ``interface_holding``: the interface that holds an address, read from this host's real interfaces.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from verl_cppack.jobs.parallel_shape import ParallelShape
from verl_cppack.jobs.ray_cluster import CPUS_PER_SLOT, EXTRA_CPUS, NodeCapacity, capacity_problem, ray_host_port


def nodes(*slots_and_cpus: tuple[float, float]) -> list[NodeCapacity]:
    return [NodeCapacity(f"node{i}", f"10.0.0.{i}", slots, cpus) for i, (slots, cpus) in enumerate(slots_and_cpus)]


def free(node_list: list[NodeCapacity]) -> dict[str, float]:
    return {"GPU": sum(n.slots for n in node_list), "CPU": sum(n.cpus for n in node_list)}


@pytest.mark.parametrize(
    "shape, workers, per_node",
    [
        (ParallelShape(), 2, 2),
        (ParallelShape(tp=2, cp=2), 4, 4),
        (ParallelShape(cp=2, dp=2, nnodes=2), 4, 2),
        (ParallelShape(tp=1, cp=1, dp=1), 1, 1),
        (ParallelShape(tp=2, cp=3, dp=2, nnodes=3), 12, 4),
    ],
)
def test_workers_are_tp_times_cp_times_dp_spread_evenly(shape, workers, per_node):
    assert shape.workers == workers and shape.workers_per_node == per_node


@pytest.mark.parametrize(
    "fields, error, message",
    [
        ({"tp": 0}, ValueError, "tp must be >= 1"),
        ({"dp": -1}, ValueError, "dp must be >= 1"),
        ({"cp": 2.0}, TypeError, "cp must be an int"),
        ({"nnodes": True}, TypeError, "nnodes must be an int"),
        ({"cp": 2, "dp": 2, "nnodes": 3}, ValueError, "nnodes=3 does not divide the 4 workers"),
        ({"cp": 1, "nnodes": 2}, ValueError, "pick nnodes among [1]"),
    ],
)
def test_a_shape_that_cannot_be_laid_out_is_refused(fields, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelShape(**fields)


def test_a_cluster_with_the_slots_and_cpus_on_every_node_holds_the_job():
    shape = ParallelShape(cp=2, dp=2, nnodes=2)  # 2 slots per node, 6 CPUs per node for the bundles
    cluster = nodes((2, 2 * CPUS_PER_SLOT + EXTRA_CPUS), (2, 2 * CPUS_PER_SLOT))
    assert capacity_problem(cluster, free(cluster), shape, "head:6379") is None
    # more nodes than needed: fine; the nodes that fit are enough
    bigger = [*cluster, *nodes((0, 64))]
    assert capacity_problem(bigger, free(bigger), shape, "head:6379") is None


def test_too_few_slots_names_what_is_there_what_is_needed_and_how_to_start_the_nodes():
    shape = ParallelShape(cp=4, nnodes=2)  # 4 workers, 2 per node
    cluster = nodes((1, 8), (1, 8))
    problem = capacity_problem(cluster, free(cluster), shape, "head:6379")
    assert problem is not None and "\n" not in problem
    assert "the Ray cluster at head:6379 has 2 worker slots" in problem
    assert "needs 4 worker slots" in problem and "2 per node" in problem
    assert "ray start ... --num-gpus 2" in problem


def test_slots_spread_so_no_node_has_its_share_are_refused():
    """4 slots in all, but 3 + 1: a node of 2 workers' bundles (STRICT_PACK) fits on one node only."""
    shape = ParallelShape(cp=2, dp=2, nnodes=2)
    cluster = nodes((3, 16), (1, 16))
    assert "has 4 worker slots" in capacity_problem(cluster, free(cluster), shape, "x:1")


def test_too_few_cpus_per_node_or_in_all_are_refused():
    shape = ParallelShape(cp=2)
    one_short = nodes((2, 2 * CPUS_PER_SLOT - 1))
    assert "has 2 worker slots" in capacity_problem(one_short, free(one_short), shape, "x:1")
    bundles_only = nodes((2, 2 * CPUS_PER_SLOT))  # the bundles fit, verl's other actors would not
    problem = capacity_problem(bundles_only, free(bundles_only), shape, "x:1")
    assert f"has {2 * CPUS_PER_SLOT} CPUs" in problem and f"{2 * CPUS_PER_SLOT + EXTRA_CPUS} in all" in problem


def test_slots_other_jobs_hold_are_not_counted_as_free():
    shape = ParallelShape(cp=2)
    cluster = nodes((2, 16))
    problem = capacity_problem(cluster, {"GPU": 1.0, "CPU": 16.0}, shape, "x:1")
    assert "has 1 of 2 worker slots" in problem and "other jobs hold the rest" in problem


@pytest.mark.parametrize(
    "address, parsed",
    [("10.1.2.3:6379", ("10.1.2.3", 6379)), ("auto", None), ("ray://head:10001", None), ("[::1]:6379", ("::1", 6379))],
)
def test_addresses(address, parsed):
    assert ray_host_port(address) == parsed


@pytest.mark.parametrize("address", ["head", "head:", ":6379", "[]:6379", "head:0", "head:65536", "head:port"])
def test_an_address_that_is_not_host_port_is_refused(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        ray_host_port(address)


def test_workers_of_a_one_node_job_use_loopback_and_of_a_spanning_job_their_nodes_interface(tmp_path):
    from verl_cppack.jobs.worker_env import worker_environment

    def environment(nnodes: int, user_env: dict[str, str]) -> dict[str, str]:
        return worker_environment(tmp_path / "m.jsonl", "calls/x", tmp_path / "calls", nnodes, user_env)

    one = environment(1, {})
    assert one["GLOO_SOCKET_IFNAME"] == "lo" and "VERL_CPPACK_GLOO_INTERFACE" not in one
    spanning = environment(2, {})
    assert "GLOO_SOCKET_IFNAME" not in spanning and spanning["VERL_CPPACK_GLOO_INTERFACE"] == "ray-node"
    assert environment(2, {"GLOO_SOCKET_IFNAME": "ib0"})["GLOO_SOCKET_IFNAME"] == "ib0"  # the user's choice
    assert one["VERL_PLATFORM"] == "cpu"
    assert one["VERL_USE_EXTERNAL_MODULES"] == "verl_cppack.verl_plugin,verl_cppack.jobs.call_counts"
    assert one["VERL_CPPACK_CALL_COUNT_RAY_KEY"] == "calls/x"
    assert Path(one["VERL_FILE_LOGGER_PATH"]).is_absolute()


def test_the_runtime_environment_ships_the_task_directory_and_the_package(tmp_path):
    import verl_cppack
    from verl_cppack.jobs.worker_env import runtime_environment

    runtime_env = runtime_environment({"A": "1"}, tmp_path)
    assert runtime_env["working_dir"] == str(tmp_path.resolve())
    assert runtime_env["py_modules"] == [str(Path(verl_cppack.__file__).resolve().parent)]
    assert runtime_env["env_vars"] == {"A": "1"}


def test_the_interface_holding_an_address_is_found_on_this_host():
    psutil = pytest.importorskip("psutil")
    from verl_cppack.runtime.gloo_interface import interface_holding

    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family == socket.AF_INET:
                assert interface_holding(entry.address) == name
    with pytest.raises(RuntimeError, match="no network interface of this host holds its Ray node address 203.0.113.7"):
        interface_holding("203.0.113.7")  # TEST-NET-3: on no host


@pytest.mark.slow  # starts a local Ray cluster
def test_a_placement_group_verl_cannot_place_is_reported_after_the_timeout():
    """A real local cluster held by a session: a verl-named placement group asking for more than the cluster has
    stays pending; ``watch`` says so once it has waited ``PENDING_PLACEMENT_TIMEOUT_S``, never before. Groups that
    are not verl's, or that existed before the session, are none of the job's business."""
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group

    from verl_cppack.jobs.ray_cluster import PENDING_PLACEMENT_TIMEOUT_S, ClusterSession

    session = ClusterSession.open(None, ParallelShape(cp=1))
    try:
        assert session.started_here and ray.cluster_resources()["GPU"] == 1
        assert session.watch() is None
        placement_group([{"CPU": 1000}], name="someone_else_group:0")  # not verl's
        placement_group([{"CPU": 1000, "GPU": 1}], name="global_poolverl_group_1:0")
        first = time.monotonic()
        assert session.watch(now=first) is None
        assert session.watch(now=first + PENDING_PLACEMENT_TIMEOUT_S - 1) is None
        problem = session.watch(now=first + PENDING_PLACEMENT_TIMEOUT_S)
        assert problem is not None and "'global_poolverl_group_1:0'" in problem and "could not be placed" in problem
        assert "CPU" in problem and "\n" not in problem
    finally:
        session.close()
    assert not ray.is_initialized()


@pytest.mark.slow  # starts a local Ray cluster
def test_a_local_cluster_is_started_even_where_ray_start_left_an_address_behind(monkeypatch):
    """`ray start` records its address in Ray's temp dir and `ray.init()` without an address connects there — to a
    cluster long dead, or to the user's own cluster with num_cpus refused. The job's local cluster is its own."""
    ray = pytest.importorskip("ray")
    import shutil
    import tempfile

    from verl_cppack.jobs.ray_cluster import ClusterSession

    temp_root = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        monkeypatch.setenv("RAY_TMPDIR", temp_root)
        (Path(temp_root) / "ray").mkdir()
        (Path(temp_root) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing answers there
        session = ClusterSession.open(None, ParallelShape(cp=2))
        try:
            assert session.started_here and not session.address.endswith(":1")
            assert ray.cluster_resources()["GPU"] == 2
        finally:
            session.close()
        assert not ray.is_initialized()
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
