"""verl's side of the Hugging Face rollout: the server adapter in each hybrid worker and the trainer's replica
(registered by name by ``cpu_fixes.py``, rows 13 and 14)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterable, Iterable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from verl_cppack.runtime.rollout.server import HFRolloutServer, server_actor_name, server_address

logger = logging.getLogger(__name__)


class HFServerAdapter(BaseRollout):
    """verl's ``BaseRollout`` for the HF server: every rank iterates the weights (Megatron's export runs collectives),
    the replica's rank 0 sends them to its server in buckets."""

    def __init__(
        self, config: RolloutConfig, model_config: HFModelConfig, device_mesh: Any = None, replica_rank: int = -1
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        c = self.config
        replica_world_size = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        self.replica_rank = rank // replica_world_size if replica_rank == -1 else int(replica_rank)
        self.rollout_rank = rank % replica_world_size
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle: ray.actor.ActorHandle | None = None

    def _server(self) -> ray.actor.ActorHandle:
        if self.server_handle is None:  # the replica launches its server after the workers exist
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        """No-op: nothing was released."""

    async def release(self) -> None:
        """No-op: there is no device memory to release."""

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        """Load the actor's full weights (``(name, tensor)`` pairs, Hugging Face naming) into the replica's server."""
        if wire_format != "named_tensors":
            raise ValueError(f"HF rollout takes wire_format='named_tensors' (full tensors), got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("HF rollout loads full weights only; use model.lora.merge=True for LoRA")
        bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        loaded = 0
        async for name, tensor in _iterate(weights):
            if not self.is_leader_rank:
                continue  # iterated for the collectives only
            host_copy = tensor.detach().to("cpu", copy=True)  # the exporter may reuse its buffers
            bucket.append((name, host_copy))
            size += host_copy.numel() * host_copy.element_size()
            if size >= bucket_bytes:
                loaded += await self._server().load_weights.remote(bucket)
                bucket, size = [], 0
        if not self.is_leader_rank:
            return
        if bucket:
            loaded += await self._server().load_weights.remote(bucket)
        if loaded == 0:
            raise ValueError("update_weights received no tensors: the rollout would keep its old weights")
        await self._server().clear_kv_cache.remote()
        if global_steps is not None:
            await self._server().set_global_steps.remote(global_steps)
        logger.info("HF rollout replica %d: loaded %d tensors (step %s)", self.replica_rank, loaded, global_steps)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError("HF rollout is server mode only: generate through the agent loop")


async def _iterate(items: Iterable[Any] | AsyncIterable[Any]):
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class HFReplica(RolloutReplica):
    """verl's ``RolloutReplica`` for the HF rollout, hybrid mode only: one CPU server actor per replica on its first
    worker's node, asking Ray for nothing (the workers hold the logical GPUs and take turns with it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(HFRolloutServer)

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(
                f"HF rollout supports hybrid mode only (rollout in the training workers), not {self.rollout_mode}; "
                "colocated and standalone servers would need a checkpoint engine to receive weights"
            )
        if len(self.workers) != self.world_size:
            raise RuntimeError(
                f"replica {self.replica_rank} has {len(self.workers)} workers, expected {self.world_size}"
            )
        node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = self.server_class.options(
            name=name,
            num_cpus=0,
            num_gpus=0,
            max_concurrency=self.max_concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )
        await server.get_server_address.remote()  # the model is loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_address(self.replica_rank, self.name_suffix)
