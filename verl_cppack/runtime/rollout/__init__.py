"""A Hugging Face rollout backend for verl 0.9.x on the host: token in, sampled tokens and their log-probs out.

verl 0.9.1 registers only GPU inference engines (vLLM, SGLang, TensorRT-LLM) for its async rollout; its
``hf_rollout.py`` is the retired synchronous API. The three pieces verl's async rollout protocol asks for, each
in its own module and registered through verl's own registries by ``cpu_fixes.py``:

- ``sampling``: ``HFTokenSampler``, one sequence at a time with a key/value cache and vLLM's sampling and
  log-probability rules, and the per-request seeding (torch only: testable without verl or Ray);
- ``server``: ``HFRolloutServer``, verl's server protocol over the sampler (what runs in the Ray actor);
- ``verl_adapter``: ``HFServerAdapter`` (the ``BaseRollout`` in each hybrid worker, which pushes the actor's weights
  to its server) and ``HFReplica`` (the trainer's ``RolloutReplica``, which launches the server actors).

Nothing here touches a GPU. Written for verl 0.9.x (checked by ``cpu_fixes.py``), transformers 5.x, Ray 2.x.
"""
