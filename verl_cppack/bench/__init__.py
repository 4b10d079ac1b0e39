"""Measurement tools: op/sync/memory counters and the verl-vs-verl_cppack benchmark (``verl-cppack bench``)."""
