"""``verl-cppack bench``: verl's packing functions against verl_cppack's drop-ins and against the floor, per
micro-batch, in real CP process groups.

``settings`` (the grid), ``batches`` (a new rollout batch every micro-batch), ``floors`` (the copies and
all-gathers alone), ``measure`` (timing, counting, fresh process groups), ``counters`` (ATen ops, host syncs,
peak extra memory; also used by the cost tests), ``vlm_masks`` (verl's VLM mask builders), ``ratios``,
``targets`` (what ``--strict`` checks) and ``report`` (tables, plot, docs/performance.md's generated section).
"""
