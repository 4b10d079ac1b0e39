"""Ray plumbing: start or join a cluster, launch the CP worker actors, call them with a deadline.

A worker that dies or a collective that never completes surfaces as ``WorkerError`` within
``call_timeout_s`` (the first failed actor is reported at once, without waiting for its stuck peers);
``WorkerGroup.shutdown`` kills every actor, and ``ray_session`` shuts down a cluster it started.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from verl_cppack.rl.worker import CPWorker, WorkerSettings


class WorkerError(RuntimeError):
    """A CP worker died, raised, or did not answer in time; the run cannot continue."""


def _require_ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError("the Ray runner needs ray: pip install 'verl-cppack[ray]'") from error
    return ray


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int) -> Iterator[bool]:
    """Join ``address`` (or ``RAY_ADDRESS``) if given, else start a local CPU cluster; yields whether we started it.

    A cluster this function started is shut down on exit, including on Ctrl-C. An already initialised Ray
    (e.g. a test fixture) is reused and left running.
    """
    ray = _require_ray()
    if ray.is_initialized():
        yield False
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    try:
        yield address is None
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerGroup:
    """``cp_size`` actors on one node forming a gloo (CPU) or nccl (one GPU each) group over 127.0.0.1.

    ``worker_class`` is ``CPWorker`` or a subclass (e.g. one that also holds a critic); its ``setup`` must
    return a dict with ``pid``.
    """

    def __init__(
        self,
        cp_size: int,
        settings: WorkerSettings,
        *,
        call_timeout_s: float = 120.0,
        num_cpus_per_worker: float = 1.0,
        worker_class: type = CPWorker,
    ):
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        ray = _require_ray()
        self.cp_size = cp_size
        self.call_timeout_s = call_timeout_s
        port = _free_port()
        num_gpus = 1 if settings.device == "cuda" else 0
        actor_class = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus, max_restarts=0)(worker_class)
        self.actors = [actor_class.remote(rank, cp_size, port, settings) for rank in range(cp_size)]
        self.pids: list[int] = []
        self.infos: list[dict[str, Any]] = []  # what each actor's setup() returned, once started

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None) -> list[Any]:
        """Run ``method(*args)`` on the chosen ranks (default all) and return their results in rank order.

        Raises ``WorkerError`` naming the rank as soon as one actor fails, or when the deadline passes.
        """
        ray = _require_ray()
        ranks = list(range(self.cp_size)) if ranks is None else list(ranks)
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        refs = [getattr(self.actors[rank], method).remote(*args) for rank in ranks]
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = sorted(rank_of[ref] for ref in pending)
                raise WorkerError(
                    f"CP worker(s) {waiting} did not finish {method}() within {timeout_s:.0f}s (a stuck collective "
                    "or a hung worker); the run was stopped"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    raise WorkerError(
                        f"CP worker rank {rank_of[ref]} died during {method}() ({type(error).__name__}); "
                        "the run was stopped"
                    ) from error
                except ray.exceptions.RayTaskError as error:
                    raise WorkerError(f"CP worker rank {rank_of[ref]} failed in {method}():\n{error}") from error
        return ray.get(refs)

    def start(self, with_policy: bool = True, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        """Start the actors' processes, form the gloo group and build the models (slow on a busy machine)."""
        infos = self.call("setup", with_policy, timeout_s=timeout_s)
        self.pids = [info["pid"] for info in infos]
        self.infos = infos
        return infos

    def shutdown(self) -> None:
        """Kill every actor (no graceful collective: a peer may be dead or stuck)."""
        ray = _require_ray()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []
