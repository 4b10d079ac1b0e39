"""The verl recipes compose into verl's own Hydra trainer config: every override names a real key.

Each recipe prints its exact overrides (after shell expansion) with VERL_CPPACK_PRINT_OVERRIDES=1; they are
composed onto the installed verl's ``ppo_megatron_trainer.yaml`` in strict mode (an unknown key fails), the
result is resolved, and verl's own ``validate_config`` (what ``main_ppo`` runs first) must accept it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
hydra = pytest.importorskip("hydra")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_SCRIPTS = sorted(RECIPES.glob("*.sh"))


def verl_config_dir() -> str:
    import verl

    return str(Path(verl.__file__).parent / "trainer" / "config")


def recipe_overrides(script: Path, **env: str) -> list[str]:
    result = subprocess.run(
        ["bash", str(script)],
        env={**os.environ, "VERL_CPPACK_PRINT_OVERRIDES": "1", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


def write_tiny_local_model(directory: Path) -> str:
    """A tiny Qwen2 config + word-level tokenizer on disk: verl's critic config loads both, and CI is offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    vocab = {token: index for index, token in enumerate(["<pad>", "<eos>", "<unk>", "####", *map(str, range(10))])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(directory)
    Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def local_model_path(tmp_path_factory) -> str:
    return write_tiny_local_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def plugin_state_restored():
    """verl imports a model config's ``external_lib`` (our plugin) while validating; undo what that installed."""
    from verl_cppack.integrations.verl import patching

    installed_before = patching.is_installed()
    yield
    if patching.is_installed() and not installed_before:
        patching.uninstall()
    elif installed_before and not patching.is_installed():
        patching.install()


def compose_trainer_config(overrides: list[str]):
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=overrides)


def test_there_is_a_gsm8k_grpo_megatron_recipe():
    assert RECIPES / "gsm8k_grpo_megatron_cp2.sh" in RECIPE_SCRIPTS


@pytest.mark.parametrize("script", RECIPE_SCRIPTS, ids=lambda path: path.name)
def test_every_recipe_override_is_a_known_verl_key_and_validates(script, local_model_path, plugin_state_restored):
    overrides = recipe_overrides(script, MODEL_PATH=local_model_path)  # a critic's model config loads it offline
    assert overrides and all("=" in line and not line.startswith("+") for line in overrides), overrides
    config = compose_trainer_config(overrides)
    resolved = OmegaConf.to_container(config, resolve=True)
    assert resolved["actor_rollout_ref"]["model"]["external_lib"] == "verl_cppack.verl_plugin"

    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def test_gsm8k_recipe_is_grpo_with_a_cp2_megatron_actor_and_vllm_rollout():
    config = compose_trainer_config(recipe_overrides(RECIPES / "gsm8k_grpo_megatron_cp2.sh"))
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    assert config.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    assert config.actor_rollout_ref.ref.megatron.context_parallel_size == 2  # the reference follows the actor
    assert config.actor_rollout_ref.rollout.name == "vllm"
    assert config.actor_rollout_ref.actor.use_kl_loss and config.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"


def test_the_composition_is_strict_a_misspelt_key_fails():
    overrides = recipe_overrides(RECIPES / "gsm8k_grpo_megatron_cp2.sh")
    with pytest.raises(ConfigCompositionException, match="context_paralel_size"):
        compose_trainer_config(overrides + ["actor_rollout_ref.actor.megatron.context_paralel_size=2"])


def test_recipe_passes_extra_command_line_overrides_through():
    overrides = recipe_overrides(RECIPES / "gsm8k_grpo_megatron_cp2.sh")
    # extra arguments land after the recipe's own, so hydra lets them win
    result = subprocess.run(
        ["bash", str(RECIPES / "gsm8k_grpo_megatron_cp2.sh"), "trainer.total_epochs=1"],
        env={**os.environ, "VERL_CPPACK_PRINT_OVERRIDES": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert result == overrides + ["trainer.total_epochs=1"]
    assert compose_trainer_config(result).trainer.total_epochs == 1


def load_prepare_gsm8k():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", RECIPES / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare_gsm8k"] = module
    spec.loader.exec_module(module)
    return module


def test_gsm8k_rows_follow_verl_schema_and_verl_scores_the_ground_truth():
    prepare = load_prepare_gsm8k()
    example = {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 1,072",
    }
    row = prepare.to_verl_row(example, 7, "train")
    assert row["data_source"] == "openai/gsm8k"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Natalia sold clips")
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1072"}
    assert row["extra_info"]["index"] == 7 and row["extra_info"]["split"] == "train"

    from verl.utils.reward_score import default_compute_score

    assert default_compute_score(row["data_source"], "so the answer is #### 1072", "1072") == 1.0
    assert default_compute_score(row["data_source"], "so the answer is #### 1071", "1072") == 0.0


def test_a_solution_without_a_final_answer_is_rejected():
    prepare = load_prepare_gsm8k()
    with pytest.raises(ValueError, match="####"):
        prepare.to_verl_row({"question": "q", "answer": "no final line"}, 0, "test")


def submit(*arguments: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RECIPES / "submit_multinode.sh"), *arguments],
        env={**os.environ, "VERL_CPPACK_PRINT_SUBMIT": "1", "RAY_ADDRESS": "http://10.0.0.1:8265", **env},
        capture_output=True,
        text=True,
    )


def test_the_multinode_submission_ships_verl_cppack_and_sets_the_shape():
    """``submit_multinode.sh`` builds ``ray job submit`` with verl_cppack in the job's runtime environment
    (``py_modules``: a package with the plugin), the recipes as working directory, the plugin turned on for every
    process, and an entrypoint that a shell parses back into the recipe, the shape and the user's overrides."""
    import json
    import shlex

    override = "trainer.logger=['console','wandb']"
    result = submit(
        "gsm8k_ppo_megatron_cp2.sh", override, NNODES="2", GPUS_PER_NODE="8", TP="2", PP="1", CP="2", DP="4"
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.splitlines()
    assert words[:5] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"] and words[-2] == "--"
    runtime_env = json.loads(words[words.index("--runtime-env-json") + 1])
    assert Path(runtime_env["working_dir"]) == RECIPES
    (package,) = runtime_env["py_modules"]
    assert (Path(package) / "verl_plugin.py").is_file() and Path(package).name == "verl_cppack"
    assert runtime_env["env_vars"] == {"VERL_USE_EXTERNAL_MODULES": "verl_cppack.verl_plugin"}
    entrypoint = shlex.split(words[-1])
    assert entrypoint[0] == "env" and entrypoint[-3:] == ["bash", "gsm8k_ppo_megatron_cp2.sh", override]
    settings = dict(word.split("=", 1) for word in entrypoint[1:-3])
    assert {key: settings[key] for key in ("NNODES", "GPUS_PER_NODE", "TP", "PP", "CP")} == {
        "NNODES": "2",
        "GPUS_PER_NODE": "8",
        "TP": "2",
        "PP": "1",
        "CP": "2",
    }
    # the recipe those settings run composes in verl's config at that shape (DP = 16 GPUs / (2 * 1 * 2) = 4)
    overrides = recipe_overrides(RECIPES / "gsm8k_ppo_megatron_cp2.sh", **settings)
    assert "trainer.nnodes=2" in overrides and "actor_rollout_ref.actor.megatron.context_parallel_size=2" in overrides


@pytest.mark.parametrize(
    "arguments, env, message",
    [
        ((), {"NNODES": "2", "TP": "2", "PP": "1", "CP": "2", "DP": "3"}, "TP*PP*CP*DP = 2*1*2*3 = 12 GPUs"),
        ((), {"NNODES": "1", "TP": "3", "PP": "1", "CP": "2"}, "must divide NNODES*GPUS_PER_NODE = 8"),
        (("no_such_recipe.sh",), {}, "is not a recipe"),
        (("submit_multinode.sh",), {}, "is not a recipe"),
    ],
)
def test_a_submission_whose_shape_does_not_fill_the_cluster_is_refused(arguments, env, message):
    result = submit(*arguments, **env)
    assert result.returncode == 2 and message in result.stderr and not result.stdout
