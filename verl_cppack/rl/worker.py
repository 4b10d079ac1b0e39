"""One context-parallel worker: a gloo (CPU) or nccl (GPU) rank holding the policy and a frozen reference.

It samples responses, computes log-probs and runs the PPO update. The class is plain Python;
``cluster.WorkerGroup`` wraps it in a Ray actor. Every method except ``pid`` and ``shutdown`` is a collective: all CP ranks must call it with the same arguments. Results that are identical on
every rank (samples, gathered log-probs, metrics) are returned by CP rank 0 only; other ranks return ``None``.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.context import ParallelContext
from verl_cppack.rl.losses import clipped_policy_loss
from verl_cppack.rl.policy import (
    DEFAULT_MODEL_FACTORY,
    FORWARD_PATHS,
    describe_forward_path,
    model_kwargs,
    next_token_logits,
    prepare_forward_path,
    resolve_factory,
    sequence_log_probs,
)


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker needs to build its models and optimiser (picklable, sent to every actor)."""

    vocab_size: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    max_sequence_length: int = 64
    attention: str = "allgather"
    seed: int = 0
    model_factory: str = DEFAULT_MODEL_FACTORY
    device: str = "cpu"  # "cpu": gloo group; "cuda": nccl group, one GPU per actor (Ray assigns it)
    forward: str = "verl"  # log-prob path: verl's gptmodel_forward_model_engine patched by verl_cppack, or "cppack"
    learning_rate: float = 3e-3
    max_grad_norm: float = 1.0
    clip_ratio: float = 0.2
    kl_coef: float = 0.01
    collective_timeout_s: float = 60.0
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.forward not in FORWARD_PATHS:
            raise ValueError(f"forward must be one of {FORWARD_PATHS}, got {self.forward!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.attention not in ("allgather", "ring"):
            raise ValueError(f"attention must be 'allgather' or 'ring', got {self.attention!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")


class CPWorker:
    def __init__(self, rank: int, world_size: int, master_port: int, settings: WorkerSettings) -> None:
        self.rank = rank
        self.world_size = world_size
        self.master_port = master_port
        self.settings = settings
        self.ctx: ParallelContext | None = None
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.device = torch.device(settings.device)
        self.backend = "nccl" if settings.device == "cuda" else "gloo"
        torch.set_num_threads(settings.torch_threads)
        # Megatron/torch warn at import about missing GPU-only fused kernels; keep the driver's log readable.
        for module in ("megatron", "torch.fx", "torch.distributed"):
            warnings.filterwarnings("ignore", category=UserWarning, module=module)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

    # ------------------------------------------------------------------ set-up
    def pid(self) -> int:
        return os.getpid()

    def setup(self, with_policy: bool = True) -> dict[str, Any]:
        """Form the gloo/nccl group (bounded by ``collective_timeout_s``), init Megatron CP state, build the models."""
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.master_port))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo talks over loopback only
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray gives each actor one GPU through CUDA_VISIBLE_DEVICES
        dist.init_process_group(
            self.backend,
            init_method=f"tcp://127.0.0.1:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.settings.collective_timeout_s),
        )
        self.ctx = self._init_parallel_state()
        prepare_forward_path(self.settings.forward)
        factory = resolve_factory(self.settings.model_factory)
        reference = factory(**model_kwargs(self.settings)).to(self.device)
        self._broadcast_parameters(reference)  # every rank holds rank 0's weights, whatever the factory's RNG did
        reference.eval()
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        self.reference = reference
        if with_policy:
            # A second build, then the reference's weights (Megatron modules hold process groups: no deepcopy).
            self.policy = factory(**model_kwargs(self.settings)).to(self.device)
            self.policy.load_state_dict(reference.state_dict())
            self.policy.train()
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.settings.learning_rate)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "cp_size": self.ctx.cp_size,
            "forward": describe_forward_path(self.settings.forward),
            "settings": asdict(self.settings),
        }

    def _init_parallel_state(self) -> ParallelContext:
        from verl_cppack.integrations.megatron_model import init_megatron_parallel

        return init_megatron_parallel(tp_size=1, cp_size=self.world_size, backend=self.backend)

    def _broadcast_parameters(self, model: torch.nn.Module) -> None:
        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0)

    # ----------------------------------------------------------------- rollout
    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_length: int, temperature: float, seed: int
    ) -> torch.Tensor | None:
        """Sample ``response_length`` tokens per prompt from the policy: ``[N, R]`` int64 (rank 0), else None.

        prompt_ids/prompt_mask [N, P] are left-padded. Every step runs the packed CP forward on all ranks;
        rank 0 samples and broadcasts the tokens so all ranks continue from the same sequences.
        """
        assert self.ctx is not None and self.policy is not None, "call setup() first"
        self.policy.eval()
        generator = torch.Generator().manual_seed(seed)
        input_ids, attention_mask = prompt_ids.long().to(self.device), prompt_mask.bool().to(self.device)
        sampled = []
        for _ in range(response_length):
            logits = next_token_logits(self.policy, input_ids, attention_mask, self.ctx).float()  # [N, V]
            if self.rank == 0:
                probabilities = torch.softmax(logits.cpu() / temperature, dim=-1)
                token = torch.multinomial(probabilities, 1, generator=generator).to(self.device)  # [N, 1]
            else:
                token = torch.empty(input_ids.shape[0], 1, dtype=torch.long, device=self.device)
            if self.world_size > 1:
                dist.broadcast(token, src=0)
            sampled.append(token)
            input_ids = torch.cat([input_ids, token], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token, dtype=torch.bool)], dim=1)
        self.policy.train()
        return torch.cat(sampled, dim=1).cpu() if self.rank == 0 else None

    # --------------------------------------------------------------- log-probs
    @torch.no_grad()
    def log_probs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, which: str, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Reference (``which="reference"``) or current-policy (``"policy"``) log-probs ``[B, S]`` (+ entropy)."""
        model = {"reference": self.reference, "policy": self.policy}.get(which)
        if model is None:
            raise ValueError(f"which must be 'reference' or 'policy' (policy needs setup(with_policy=True)); got {which!r}")
        assert self.ctx is not None
        was_training = model.training
        model.eval()
        log_probs, entropy = sequence_log_probs(
            model,
            input_ids.to(self.device),
            attention_mask.to(self.device),
            self.ctx,
            with_entropy=with_entropy,
            forward=self.settings.forward,
        )
        model.train(was_training)
        if self.rank != 0:
            return None
        return log_probs.cpu(), (entropy.cpu() if entropy is not None else None)

    # ------------------------------------------------------------------ update
    def update(self, batch: dict[str, torch.Tensor], num_mini_batches: int) -> dict[str, float] | None:
        """One PPO epoch over ``num_mini_batches`` mini-batches; returns mean loss metrics (rank 0).

        batch: input_ids, attention_mask [B, S]; loss_mask [B, S] (positions whose next token is a response
        token); old_log_probs, ref_log_probs, advantages [B, S] in the same (next-token) alignment.
        Gradients under the gather-back contract only cover this rank's tokens; they are summed over the CP
        group before the optimiser step, which gives the full-sequence gradient.
        """
        assert self.ctx is not None and self.policy is not None and self.optimizer is not None

        def policy_loss(mini: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
            log_probs, _ = sequence_log_probs(
                self.policy,
                mini["input_ids"],
                mini["attention_mask"],
                self.ctx,
                with_entropy=False,
                forward=self.settings.forward,
            )
            out = clipped_policy_loss(
                log_probs,
                mini["old_log_probs"],
                mini["ref_log_probs"],
                mini["advantages"],
                mini["loss_mask"],
                clip_ratio=self.settings.clip_ratio,
                kl_coef=self.settings.kl_coef,
            )
            return out.loss, [out.pg_loss, out.kl, out.clip_fraction]

        return self._train_epoch(
            batch,
            num_mini_batches,
            self.policy,
            self.optimizer,
            self.settings.max_grad_norm,
            ("pg_loss", "kl", "clip_fraction", "grad_norm"),
            policy_loss,
        )

    def _train_epoch(
        self,
        batch: dict[str, torch.Tensor],
        num_mini_batches: int,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float,
        names: tuple[str, ...],
        loss_of: Any,
    ) -> dict[str, float] | None:
        """One epoch of optimiser steps over ``num_mini_batches`` row chunks of ``batch``.

        ``loss_of(mini) -> (loss, metrics)``; the gradient norm is appended to the metrics, which are summed
        on the device and read once at the end (rank 0 returns their means under ``names``). Gradients
        under the gather-back contract cover this rank's tokens; they are summed over the CP group before
        the step, which gives the full-sequence gradient.
        """
        batch_size = batch["input_ids"].shape[0]
        if batch_size % num_mini_batches != 0:
            raise ValueError(f"batch size {batch_size} is not divisible by num_mini_batches={num_mini_batches}")
        totals = torch.zeros(len(names), device=self.device)
        for rows in torch.arange(batch_size).chunk(num_mini_batches):
            mini = {name: tensor.index_select(0, rows).to(self.device) for name, tensor in batch.items()}
            optimizer.zero_grad(set_to_none=False)
            loss, metrics = loss_of(mini)
            loss.backward()
            self._all_reduce_gradients(module)
            grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_grad_norm)
            optimizer.step()
            totals += torch.stack([*metrics, grad_norm.to(totals)]).detach()
        if self.rank != 0:
            return None
        return dict(zip(names, (totals / num_mini_batches).tolist()))

    def _all_reduce_gradients(self, module: torch.nn.Module | None = None) -> None:
        """Sum the gradients of ``module`` (default: the policy) over the CP group, in one collective."""
        if self.world_size == 1:
            return
        module = self.policy if module is None else module
        parameters = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all gradients
        dist.all_reduce(flat, group=self.ctx.cp_group)
        offset = 0
        for parameter in parameters:
            count = parameter.numel()
            parameter.grad = flat[offset : offset + count].view_as(parameter).clone()
            offset += count

    # ------------------------------------------------------------ fault tests
    def collective_without_peers(self) -> None:
        """Enter an all-reduce the other ranks never join (used by the fault tests: a stuck collective)."""
        dist.all_reduce(torch.ones(1, device=self.device))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
