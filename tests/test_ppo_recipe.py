"""The verl PPO recipe: a GAE run with a Megatron critic at CP=2, the plugin on for the actor and the critic.

Extends the recipe config test (``tests/test_recipes_config.py`` composes every ``recipes/*.sh`` onto verl's
trainer config in strict mode and runs verl's ``validate_config``); here: what makes the PPO recipe a PPO recipe.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from tests.test_recipes_config import (  # noqa: E402
    RECIPE_SCRIPTS,
    RECIPES,
    compose_trainer_config,
    local_model_path,  # noqa: F401 - fixture
    plugin_state_restored,  # noqa: F401 - fixture
    recipe_overrides,
)

PPO_RECIPE = RECIPES / "gsm8k_ppo_megatron_cp2.sh"


def test_the_ppo_recipe_is_one_of_the_recipes_the_config_test_composes():
    assert PPO_RECIPE in RECIPE_SCRIPTS


def test_ppo_recipe_runs_gae_with_a_megatron_critic_at_cp2_and_the_plugin_on_actor_and_critic():
    from verl.trainer.main_ppo import need_critic

    config = compose_trainer_config(recipe_overrides(PPO_RECIPE))
    assert config.algorithm.adv_estimator == "gae" and need_critic(config)
    assert config.critic.strategy == "megatron"
    assert config.critic.megatron.context_parallel_size == 2
    assert config.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    assert config.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    assert config.critic.model.external_lib == "verl_cppack.verl_plugin"
    assert config.actor_rollout_ref.model.external_lib == "verl_cppack.verl_plugin"
    assert config.critic.model.path == config.actor_rollout_ref.model.path  # the critic starts from the actor's model
    assert config.actor_rollout_ref.rollout.name == "vllm"


def test_ppo_recipe_critic_follows_the_actors_parallel_sizes_unless_told_otherwise():
    config = compose_trainer_config(recipe_overrides(PPO_RECIPE, CP="4", TP="1", PP="2"))
    assert (config.critic.megatron.context_parallel_size, config.critic.megatron.tensor_model_parallel_size) == (4, 1)
    assert config.critic.megatron.pipeline_model_parallel_size == 2
    config = compose_trainer_config(recipe_overrides(PPO_RECIPE, CRITIC_CP="1", CRITIC_MODEL_PATH="/models/rm"))
    assert config.critic.megatron.context_parallel_size == 1
    assert config.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    assert config.critic.model.path == "/models/rm"


def test_validating_the_ppo_recipe_imports_the_critics_external_lib(local_model_path, plugin_state_restored):  # noqa: F811
    from verl.trainer.main_ppo import need_reference_policy
    from verl.utils.config import validate_config

    from verl_cppack.integrations.verl import patching

    if patching.is_installed():
        patching.uninstall()
    sys.modules.pop("verl_cppack.verl_plugin", None)  # so that verl's import of it runs install() afresh
    config = compose_trainer_config(recipe_overrides(PPO_RECIPE, MODEL_PATH=local_model_path))
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=True)
    # verl builds the critic's model config, which imports critic.model.external_lib: the plugin is now on
    assert patching.is_installed()
