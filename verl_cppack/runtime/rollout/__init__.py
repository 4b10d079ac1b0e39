"""A Hugging Face rollout backend for verl 0.9.x on the host: token in, sampled tokens and their log-probs out.

verl 0.9.1 registers only GPU inference engines for its async rollout. ``sampling`` decodes with vLLM's sampling
rules and per-request seeds (torch only), ``server`` puts verl's server protocol over it (the Ray actor), and
``verl_adapter`` holds verl's side, ``HFServerAdapter`` and ``HFReplica``, registered by ``cpu_fixes.py``.
"""
