"""Integrations with Megatron-core and verl: ``megatron`` (parallel context, ``PackedSeqParams``), ``verl`` (drop-ins
and the patch), ``megatron_pipeline`` (pipeline micro-batches), and the post-import hook they share."""

from verl_cppack.integrations.import_hooks import after_import, cancel

__all__ = ["after_import", "cancel"]
