"""Integrations with Megatron-core, Megatron-Bridge and verl (``megatron``, ``megatron_bridge``, ``megatron_pipeline``,
``verl``), and the import hooks they share."""

from verl_cppack.integrations.import_hooks import after_import, around_import, cancel

__all__ = ["after_import", "around_import", "cancel"]
