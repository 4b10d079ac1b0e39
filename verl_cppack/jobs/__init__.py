"""Jobs that run verl's own trainer (``verl.trainer.main_ppo``) with verl_cppack on: the task they train on,
the composed trainer configuration, and the launcher that collects verl's metrics."""
