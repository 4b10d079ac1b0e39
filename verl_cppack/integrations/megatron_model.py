"""Moved: the tiny Megatron GPT that runs on the host is part of the CPU runtime, ``verl_cppack.runtime.tiny_gpt``."""

raise ImportError(
    "verl_cppack.integrations.megatron_model moved to verl_cppack.runtime.tiny_gpt: "
    "from verl_cppack.runtime.tiny_gpt import build_tiny_gpt, init_megatron_parallel"
)
