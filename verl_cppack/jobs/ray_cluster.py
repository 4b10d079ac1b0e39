"""The Ray cluster a job runs on, held by the launcher from before verl starts until after it ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl_cppack.jobs.parallel_shape import ParallelShape

# verl's RayResourcePool bundle, one per worker slot: {"CPU": max_colocate_count (3), "GPU": 1}, STRICT_PACK per node.
CPUS_PER_SLOT = 3
# Logical CPUs verl asks for outside the placement groups (TaskRunner, agent-loop, reward, TransferQueue), + 1 spare
EXTRA_CPUS = 4
LOCAL_CLUSTER_CPUS = 16  # logical CPUs of the local cluster (the v1 trainer's TransferQueue stalled with 8)
SLOT_RESOURCE = "GPU"  # verl's resource pools count GPUs; the CPU platform maps one logical GPU to one worker
ADDRESS_PROBE_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 30.0  # Ray retries a GCS that does not answer for minutes; a job gives up sooner
PENDING_PLACEMENT_TIMEOUT_S = 90.0
VERL_PLACEMENT_GROUP_MARK = "verl_group"  # verl names its placement groups "<pool>verl_group_<sizes>:<index>"


class ClusterUnavailable(RuntimeError):
    """No Ray cluster answers at the address, or joining it failed (exit 3)."""


class ClusterTooSmall(ValueError):
    """The cluster cannot hold the job (exit 2: nothing was started)."""


@dataclass(frozen=True)
class NodeCapacity:
    """One alive Ray node: its id, address and total logical resources."""

    node_id: str
    address: str
    slots: float  # Ray "GPU"
    cpus: float


def ray_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray head address, ``None`` for 'auto' or ``ray://...``; ``ValueError`` otherwise."""
    if address == "auto" or address.startswith("ray://"):
        return None
    host, _, port = address.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--address must be HOST:PORT of a Ray head node (or 'auto'), got {address!r}")
    return host.strip("[]"), int(port)  # an IPv6 host is written [::1]


def check_address_answers(address: str) -> None:
    """Refuse an address where nothing listens, in bounded time (Ray itself retries for minutes)."""
    host_port = ray_host_port(address)
    if host_port is None:
        return
    try:
        with socket.create_connection(host_port, timeout=ADDRESS_PROBE_TIMEOUT_S):
            pass
    except OSError as error:
        raise ClusterUnavailable(
            f"no Ray cluster answers at {address} ({error}); start one with `ray start --head`"
        ) from error


AUTH_MODE_ENV = "RAY_AUTH_MODE"


def check_joinable(address: str) -> None:
    """Refuse in bounded time (``JOIN_TIMEOUT_S``) an address with no Ray head, or one wanting a token not sent."""
    check_address_answers(address)
    probe = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')"
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe, address],
            capture_output=True,
            text=True,
            timeout=JOIN_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as error:
        raise ClusterUnavailable(
            f"no Ray cluster answered at {address} within {JOIN_TIMEOUT_S:.0f} s (something listens there, but not a "
            "Ray head); pass the address `ray start --head` printed"
        ) from error
    if result.returncode == 0:
        return
    if "InvalidAuthToken" in result.stderr:
        mode = os.environ.get(AUTH_MODE_ENV, "unset")
        raise ClusterUnavailable(
            f"the Ray cluster at {address} asks for an authentication token and this client sends none ({AUTH_MODE_ENV} "
            f"is {mode}); run `export {AUTH_MODE_ENV}=token` (the token `ray start` saved in ~/.ray/auth_token, or "
            "RAY_AUTH_TOKEN, is then sent), or use --address auto on a node of the cluster"
        )
    errors = [line for line in result.stderr.splitlines() if "Error" in line] or result.stderr.splitlines()
    raise ClusterUnavailable(f"could not join the Ray cluster at {address}: {(errors or ['no output'])[-1].strip()}")


def capacity_problem(
    nodes: Sequence[NodeCapacity], available: dict[str, float], shape: ParallelShape, where: str
) -> str | None:
    """What the cluster lacks for ``shape`` (None: it fits); ``nodes``: alive ones' totals, ``available``: free now."""
    per_node = shape.workers_per_node
    node_cpus = CPUS_PER_SLOT * per_node
    slots = sum(node.slots for node in nodes)
    fitting = [node for node in nodes if node.slots >= per_node and node.cpus >= node_cpus]
    layout = ", ".join(f"{node.address}: {node.slots:g} slots, {node.cpus:g} CPUs" for node in nodes) or "no nodes"
    wanted = (
        f"this job needs {shape.workers} worker slots ({shape.describe()}), {per_node} per node with {node_cpus} CPUs"
    )
    how = (
        f"start each node with `ray start ... --num-gpus {per_node} --num-cpus {node_cpus + EXTRA_CPUS}` (the CPU "
        f"job counts one logical GPU per worker; on GPUs, {per_node} real ones) or change --tp/--cp/--dp/--nnodes"
    )
    if len(fitting) < shape.nnodes:
        return f"the Ray cluster at {where} has {slots:g} worker slots ({layout}); {wanted}; {how}"
    needed_cpus = CPUS_PER_SLOT * shape.workers + EXTRA_CPUS
    total_cpus = sum(node.cpus for node in nodes)
    if total_cpus < needed_cpus:
        return (
            f"the Ray cluster at {where} has {total_cpus:g} CPUs ({layout}); {wanted} and {needed_cpus} in all; {how}"
        )
    free_slots, free_cpus = available.get(SLOT_RESOURCE, 0.0), available.get("CPU", 0.0)
    if free_slots < shape.workers or free_cpus < needed_cpus:
        return (
            f"the Ray cluster at {where} has {free_slots:g} of {slots:g} worker slots and {free_cpus:g} CPUs free "
            f"(other jobs hold the rest); {wanted} and {needed_cpus} CPUs in all; wait for them or add nodes"
        )
    return None


class ClusterSession:
    """A connection to the job's Ray cluster (this process is a Ray driver while it is open)."""

    def __init__(self, ray: Any, address: str, started_here: bool) -> None:
        self._ray, self.address, self.started_here = ray, address, started_here
        self._existing_groups = set(ray.util.placement_group_table())  # made before the trainer: not the job's
        self._pending_since: dict[str, float] = {}  # placement group id -> when first seen pending
        self._job_nodes: set[str] = set()  # nodes hosting the job's bundles

    @classmethod
    def open(cls, address: str | None, shape: ParallelShape) -> ClusterSession:
        """Start a local cluster (``address`` None) or join ``address``; ``ClusterTooSmall``/``ClusterUnavailable``."""
        import ray

        if address is not None:
            check_joinable(address)
        try:
            if address is None:  # "local": a new cluster even where `ray start` left its address behind
                context = ray.init(
                    address="local",
                    num_cpus=max(LOCAL_CLUSTER_CPUS, CPUS_PER_SLOT * shape.workers + EXTRA_CPUS),
                    num_gpus=shape.workers,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level="ERROR",
                )
                join_address = context.address_info["gcs_address"]
            else:  # verl's trainer joins with the user's own words ('auto' finds the cluster, and its token, as here)
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                join_address = address
        except (ConnectionError, RuntimeError, ValueError) as error:
            ray.shutdown()
            where = "start a local Ray cluster" if address is None else f"join the Ray cluster at {address}"
            raise ClusterUnavailable(f"could not {where}: {error}") from error
        session = cls(ray, join_address, address is None)
        try:
            problem = capacity_problem(session.nodes(), ray.available_resources(), shape, address or "this machine")
            if problem is not None:
                raise ClusterTooSmall(problem)
        except BaseException:
            session.close()
            raise
        return session

    def nodes(self) -> list[NodeCapacity]:
        return [
            NodeCapacity(
                node["NodeID"],
                node["NodeManagerAddress"],
                float(node["Resources"].get(SLOT_RESOURCE, 0)),
                float(node["Resources"].get("CPU", 0)),
            )
            for node in self._ray.nodes()
            if node["Alive"]
        ]

    def watch(self, now: float | None = None) -> str | None:
        """Why the run cannot go on (a job node died, a placement group pending too long), or ``None``."""
        now = time.monotonic() if now is None else now
        alive = {node["NodeID"] for node in self._ray.nodes() if node["Alive"]}
        for group_id, group in self._ray.util.placement_group_table().items():
            if group_id in self._existing_groups or VERL_PLACEMENT_GROUP_MARK not in group.get("name", ""):
                continue
            self._job_nodes.update(node for node in group["bundles_to_node_id"].values() if node.strip("0"))  # placed
            if group["state"] == "PENDING":
                waited = now - self._pending_since.setdefault(group_id, now)
                if waited >= PENDING_PLACEMENT_TIMEOUT_S:
                    bundles = list(group["bundles"].values())
                    return (
                        f"verl's placement group {group['name']!r} ({len(bundles)} bundles of {bundles[0] if bundles else {}}) "
                        f"could not be placed for {waited:.0f} s: the cluster lacks the resources "
                        f"({', '.join(f'{n.address}: {n.slots:g} slots, {n.cpus:g} CPUs' for n in self.nodes())})"
                    )
        dead = sorted(self._job_nodes - alive)
        if dead:
            return f"Ray node(s) {', '.join(node[:12] for node in dead)} running this job's workers died"
        return None

    def close(self) -> None:
        """Disconnect (a local cluster is stopped with it)."""
        self._ray.shutdown()
