"""A Hugging Face rollout backend for verl 0.9.x on the host: ``sampling`` decodes with vLLM's rules, ``server``
speaks verl's server protocol (the Ray actor), ``verl_adapter`` holds verl's side."""
