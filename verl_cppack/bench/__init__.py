"""``verl-cppack bench``: verl's packing functions against verl_cppack's drop-ins and against the floor, per
micro-batch, in real CP process groups (``measure`` times, ``targets`` is what ``--strict`` checks)."""
