"""Integrations with Megatron-core and verl: ``megatron`` (parallel context, ``PackedSeqParams``), ``verl`` (drop-ins
and the patch), ``megatron_bridge`` (Megatron-Bridge's packing copies), ``megatron_pipeline`` (pipeline
micro-batches), and the import hooks they share."""

from verl_cppack.integrations.import_hooks import after_import, around_import, cancel

__all__ = ["after_import", "around_import", "cancel"]
