"""verl's Megatron engine on the host, without Ray, and the batches verl's trainer sends it.

Needs ``VERL_PLATFORM=cpu``, ``verl_cppack.verl_plugin`` imported and a process group (importing this module imports
nothing of verl); batches take the reference worker's path, ``left_right_2_no_padding`` -> ``infer_batch``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # verl is imported only where it runs
    from tensordict import TensorDict

# The fusions and kernels Megatron would take from Transformer Engine / apex / CUDA are off on the host.
FUSIONS_OFF = dict.fromkeys(
    ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion")
    + ("gradient_accumulation_fusion", "persist_layer_norm"),
    False,
)
HOST_TRANSFORMER_CONFIG = {
    "use_cpu_initialization": True,
    **FUSIONS_OFF,
    "attention_backend": "auto",
    "sequence_parallel": False,  # Megatron's local (torch) norms refuse it; TP still splits every layer
}


def uses_megatron_bridge() -> bool:
    """Whether verl builds models with Megatron-Bridge (if installed: ``vanilla_mbridge=False``) or with mbridge."""
    from verl_cppack.runtime.checked_fix import installed_version

    return installed_version("megatron-bridge") is not None


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


Pair = tuple[list[int], list[int]]  # (prompt token ids, response token ids)
MODEL_TYPES = ("language_model", "value_model")  # verl's EngineRegistry keys: actor/reference, critic


@dataclass(frozen=True)
class EngineSettings:
    """What differs between the engines this project builds; everything else is verl's default."""

    model_path: str
    context_parallel_size: int = 1
    tensor_model_parallel_size: int = 1  # data parallelism is what the world size leaves, as in verl
    micro_batch_size: int = 8  # verl's micro_batch_size_per_gpu and infer_micro_batch_size_per_gpu
    forward_only: bool = False  # True: verl's reference engine (no DDP wrap, no optimizer)
    learning_rate: float = 1e-2
    clip_grad: float = 1.0
    total_training_steps: int = 1
    seed: int = 42  # verl's McoreEngineConfig default
    model_type: str = "language_model"  # "value_model": verl's critic engine (scalar value head)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"EngineSettings.model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        for name in ("context_parallel_size", "tensor_model_parallel_size", "micro_batch_size", "total_training_steps"):
            _require_positive(f"EngineSettings.{name}", getattr(self, name))


@dataclass
class BuiltEngine:
    """verl's engine plus the configs it was built from (an actor config needs the engine and optimizer ones)."""

    engine: Any  # verl's MegatronEngineWithLMHead (language model) or MegatronEngineWithValueHead (value model)
    model_config: Any  # verl.workers.config.HFModelConfig
    engine_config: Any  # verl.workers.config.McoreEngineConfig
    optimizer_config: Any  # verl.workers.config.McoreOptimizerConfig

    @property
    def has_outputs(self) -> bool:
        """Whether this rank receives the batch's outputs (TP rank 0, last PP stage, CP rank 0)."""
        return bool(self.engine.is_mp_src_rank_with_outputs())


def build_megatron_engine(settings: EngineSettings) -> BuiltEngine:
    """verl's float32 Megatron engine for the HF checkpoint ``settings.model_path``, built as ``TrainingWorker``."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=settings.model_path, use_remove_padding=True)
    engine_config = McoreEngineConfig(
        strategy="megatron",
        dtype="float32",
        use_mbridge=True,
        vanilla_mbridge=not uses_megatron_bridge(),
        use_distributed_optimizer=False,
        context_parallel_size=settings.context_parallel_size,
        tensor_model_parallel_size=settings.tensor_model_parallel_size,
        sequence_parallel=False,  # HOST_TRANSFORMER_CONFIG: the local norms refuse it
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=settings.micro_batch_size,
        infer_micro_batch_size_per_gpu=settings.micro_batch_size,
        forward_only=settings.forward_only,
        seed=settings.seed,
        override_transformer_config=dict(HOST_TRANSFORMER_CONFIG),
    )
    optimizer_config = McoreOptimizerConfig(
        lr=settings.learning_rate, clip_grad=settings.clip_grad, total_training_steps=settings.total_training_steps
    )
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    model_config.model_type = settings.model_type
    engine = EngineRegistry.new(
        model_type=settings.model_type,
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return BuiltEngine(engine, model_config, engine_config, optimizer_config)


def check_pairs(pairs: Sequence[Pair], vocab_size: int | None = None) -> None:
    """Raise unless each pair is a non-empty prompt and response of int ids in ``[0, vocab_size)`` (when given)."""
    if not pairs:
        raise ValueError("no prompt/response pairs to score")
    for index, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"row {index} must be (prompt_ids, response_ids), got {type(pair).__name__}")
        for name, ids in zip(("prompt_ids", "response_ids"), pair, strict=True):
            if not isinstance(ids, (list, tuple)):
                raise TypeError(f"row {index} {name} must be a list of ints, got {type(ids).__name__}")
            if not ids:
                raise ValueError(f"row {index} has an empty {name}; prompts and responses need at least one token")
            wrong = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)), None)
            if wrong is not None:
                raise TypeError(
                    f"row {index} {name} holds {wrong!r} ({type(wrong).__name__}); token ids must be integers"
                )
            outside = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
            if outside is not None:
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"row {index} {name} holds token id {outside}, outside the vocabulary {bound}")


def rollout_tensors(pairs: Sequence[Pair], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """verl's rollout batch (``DataProto.batch``) of ``pairs``: ``prompts`` [B, P] left-padded, ``responses``
    [B, R] right-padded, ``input_ids`` / ``attention_mask`` (int64, 1 at real tokens) / ``position_ids`` (real tokens
    counted from 0) [B, P+R], ``response_mask`` [B, R]."""
    check_pairs(pairs)
    batch = len(pairs)
    prompt_width = max(len(prompt) for prompt, _ in pairs)
    response_width = max(len(response) for _, response in pairs)
    prompt_lengths = torch.tensor([len(prompt) for prompt, _ in pairs])  # [B]
    response_lengths = torch.tensor([len(response) for _, response in pairs])  # [B]
    columns = torch.arange(prompt_width + response_width)  # [P+R]
    prompt_part = (columns < prompt_width) & (columns >= prompt_width - prompt_lengths[:, None])  # [B, P+R]
    response_part = (columns >= prompt_width) & (columns < prompt_width + response_lengths[:, None])  # [B, P+R]
    attention_mask = (prompt_part | response_part).to(torch.int64)  # [B, P+R]
    input_ids = torch.full((batch, prompt_width + response_width), pad_id, dtype=torch.int64)
    flat_ids = torch.tensor([token for prompt, response in pairs for token in (*prompt, *response)], dtype=torch.int64)
    input_ids[attention_mask.bool()] = flat_ids  # row-major order = prompt then response of each row (input assembly)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P+R]
    return {
        "prompts": input_ids[:, :prompt_width].clone(),
        "responses": input_ids[:, prompt_width:].clone(),
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, prompt_width:].clone(),
    }


def engine_batch(tensors: dict[str, torch.Tensor], micro_batch_size: int, **meta: Any) -> TensorDict:
    """``tensors`` (:func:`rollout_tensors` plus per-token extras) through verl's ``left_right_2_no_padding``, with the
    meta the trainer and ``TrainingWorker`` attach (temperature 1, batching settings) and ``meta``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(tu.get_tensordict(dict(tensors)))
    settings = dict(
        temperature=1.0,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=None,
        use_fused_kernels=False,
    )
    tu.assign_non_tensor(data, **{**settings, **meta})
    return data


def _infer_response_output(
    built: BuiltEngine, tensors: dict[str, torch.Tensor], micro_batch_size: int, name: str, **meta: Any
) -> torch.Tensor | None:
    """The engine's per-token output ``name`` at the response tokens, ``[B, R]`` float32, zero at response padding,
    on the rank with outputs (``None`` elsewhere); every rank calls it with the same ``tensors``."""
    from verl.workers.utils.padding import no_padding_2_padding

    _require_positive("micro_batch_size", micro_batch_size)
    rows = tensors["input_ids"].shape[0]
    chunks: list[torch.Tensor] = []  # [m, R] each
    with built.engine.eval_mode():
        for start in range(0, rows, micro_batch_size):
            part = {key: tensor[start : start + micro_batch_size] for key, tensor in tensors.items()}
            part_rows = part["input_ids"].shape[0]  # the last micro-batch may be short; verl wants rows % size == 0
            data = engine_batch(part, part_rows, compute_loss=False, **meta)
            output = built.engine.infer_batch(data, loss_function=None)
            if built.has_outputs:
                chunks.append(no_padding_2_padding(output["model_output"][name], data).float())
    return torch.cat(chunks, dim=0) if built.has_outputs else None


def response_log_probs(
    built: BuiltEngine, tensors: dict[str, torch.Tensor], micro_batch_size: int
) -> torch.Tensor | None:
    """Log-probs of the response tokens (``_infer_response_output``), as ``compute_ref_log_prob`` computes them."""
    return _infer_response_output(built, tensors, micro_batch_size, "log_probs", calculate_entropy=False)


def response_values(built: BuiltEngine, tensors: dict[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor | None:
    """The critic's values at the response tokens, as the trainer's ``_compute_values`` (a ``value_model`` engine)."""
    if built.model_config.model_type != "value_model":
        raise ValueError(f"response_values needs a value_model engine, got {built.model_config.model_type!r}")
    return _infer_response_output(built, tensors, micro_batch_size, "values")
