"""What the two engine-on-the-host tests share: the tiny model, the rollout samples and tolerances, and the runs.

``test_verl_engine_cpu.py`` (verl's policy engine) and ``test_verl_critic_engine_cpu.py`` (verl's critic engine)
build verl's Megatron engine in real gloo processes at CP=1 and CP=2 on the same tiny model and batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.distributed import run_gloo
from verl_cppack.jobs.counting_task import CountingAssets

TOLERANCE = 1e-5
GRAD_NORM_RELATIVE_TOLERANCE = 1e-4

# Small enough for two cores; 2 layers so layer-to-layer state (RoPE, attention) is exercised.
TINY = CountingAssets(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    train_prompts=4,
    test_prompts=4,
)

# (prompt, response) token ids; verl's rollout batch left-pads prompts to the longest (6) and right-pads responses
# to the longest (5). Responses of one and of full length, prompts of one and of full length, a two-token sequence.
PROMPT_LENGTH, RESPONSE_LENGTH = 6, 5
SAMPLES = (
    ([5, 6, 7], [8, 9, 10, 11]),
    ([2], [3, 4]),
    ([12, 13, 14, 15, 16, 17], [1]),
    ([4, 4, 9, 2], [7, 7, 7, 7, 7]),
    ([9], [10]),  # two tokens in all: shorter than one CP=2 slot (4)
)


def run_at_cp_1_and_2(worker: Callable[..., dict], model_path: str, count_root: Path) -> dict[int, dict]:
    """Per CP size: rank 0's results (the rank with outputs), every rank's results (``all_ranks``) and the drop-in
    call counts of every process, by function (``calls``) and by engine role (``roles``).

    ``worker(rank, world_size, model_path, context_parallel_size, count_dir)`` runs in each gloo process."""
    from verl_cppack.integrations.verl.call_counts import read_call_counts

    results = {}
    for context_parallel_size in (1, 2):
        count_dir = count_root / f"calls_cp{context_parallel_size}"
        count_dir.mkdir()
        ranks = run_gloo(worker, context_parallel_size, model_path, context_parallel_size, str(count_dir))
        results[context_parallel_size] = {
            **ranks[0],
            "all_ranks": ranks,
            "calls": read_call_counts(count_dir),
            "roles": read_call_counts(count_dir, "roles"),
        }
    return results
