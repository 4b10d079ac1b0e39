"""``install()`` puts the drop-ins into every verl module that bound the util functions; verl's own forward
functions then call them and return what they returned before; ``uninstall()`` restores the originals.
Activation through ``VERL_USE_EXTERNAL_MODULES`` is checked in a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

CALLERS = (
    "verl.models.mcore.model_forward",
    "verl.models.mcore.model_forward_fused",
    "verl.models.mcore.model_forward_1f1b_overlap",
    "verl.utils.megatron.router_replay_utils",
    "verl.trainer.distillation.megatron.losses",
)
VOCAB, HIDDEN = 50, 6


class PositionWiseModel(torch.nn.Module):
    """Output depends only on the token (so CP slicing cannot change it): an embedding table."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_process, self.post_process = True, True
        self.config = SimpleNamespace(sequence_parallel=False, fp8=None)
        generator = torch.Generator().manual_seed(11)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **kwargs):
        return self.table[input_ids]  # [1, T_local, H] (THD) or [B, L, H] (BSHD)


def log_prob_processor(output, label, label_mask):
    """verl-style logits processor: per-token log-prob of the label, masked."""
    log_probs = torch.log_softmax(output.float(), dim=-1).gather(-1, (label % HIDDEN).unsqueeze(-1)).squeeze(-1)
    return {"log_probs": log_probs * label_mask, "entropy": output.float().sum(-1)}


def engine_processor(output, label):
    return {"logit_sum": output.sum(-1), "rolled_label": label.float()}


def _rollout(seed: int):
    from tests.verl_release_harness import random_batch, to_nested
    from verl_cppack.integrations.verl.comparison import last_token_marker

    data = random_batch(seed, padding="rollout")
    data["input_ids"] = data["input_ids"] % VOCAB
    data["label"] = data["label"] % VOCAB
    mask = data["mask"]
    nested_ids = to_nested(data["input_ids"], mask)
    nested_label = to_nested(data["label"], mask)
    return data, nested_ids, nested_label, last_token_marker(nested_ids).values() == 1


def _run_forwards(model_forward, model, seed: int) -> dict[str, torch.Tensor]:
    data, nested_ids, nested_label, _ = _rollout(seed)
    mask = data["mask"]
    position_ids = torch.cumsum(mask.long(), 1)
    forward = model_forward.model_forward_gen(vision_model=False)
    args = {"label": data["label"], "label_mask": data["label_mask"].float()}
    legacy = forward(
        model,
        data["input_ids"],
        mask,
        position_ids,
        {},
        logits_processor=log_prob_processor,
        logits_processor_args=dict(args),
    )
    results = {f"legacy.{k}": v.detach() for k, v in legacy.items()}
    results["legacy.plain"] = forward(model, data["input_ids"], mask, position_ids, {}).detach()
    for data_format in ("thd", "bshd"):
        engine = model_forward.gptmodel_forward_model_engine(
            model,
            nested_ids,
            {},
            logits_processor=engine_processor,
            logits_processor_args={"label": nested_label},
            data_format=data_format,
        )
        results.update({f"engine.{data_format}.{k}": v.values().detach() for k, v in engine.items()})
    from megatron.core import parallel_state as mpu

    if mpu.get_context_parallel_world_size() == 1:  # verl's BSHD legacy path needs CP=1
        bshd = forward(model, data["input_ids"], mask, position_ids, {}, data_format="bshd")
        results["legacy.bshd"] = bshd.detach()
    return results


def patch_checks() -> dict:
    """Run inside an initialised megatron parallel state (TP=1): verl's forwards before, with, after the patch."""
    import importlib

    from verl_cppack.integrations.verl import patching

    modules = {name: importlib.import_module(name) for name in CALLERS}  # bound verl's originals
    model_forward = modules["verl.models.mcore.model_forward"]
    model = PositionWiseModel()
    before = _run_forwards(model_forward, model, seed=3)

    calls: Counter = Counter()

    def counting(name, function):
        @functools.wraps(function)  # the signature the patch compares stays the drop-in's
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    saved = dict(patching.DROPINS)
    patching.DROPINS.update(
        {
            name: tuple(dataclasses.replace(dropin, function=counting(name, dropin.function)) for dropin in variants)
            for name, variants in saved.items()
        }
    )
    ours = [dropin.function for variants in patching.DROPINS.values() for dropin in variants]
    try:
        assert patching.install() and patching.install()  # idempotent
        covered = patching.status()["covered"]
        bound_to_ours = {
            name: sorted(attr for attr, value in vars(module).items() if any(value is f for f in ours))
            for name, module in modules.items()
        }
        patched = _run_forwards(model_forward, model, seed=3)
        calls_snapshot = dict(calls)
        patching.uninstall()
        patching.uninstall()  # idempotent
        util = importlib.import_module("verl.models.mcore.util")
        restored = all(
            getattr(module, attr) is getattr(util, attr) and getattr(util, attr).__module__ == "verl.models.mcore.util"
            for module in modules.values()
            for attr in patching.DROPINS
            if hasattr(module, attr)
        )
        after = _run_forwards(model_forward, model, seed=3)
    finally:
        patching.DROPINS.clear()
        patching.DROPINS.update(saved)
    _, _, _, last = _rollout(3)
    return {
        "before": before,
        "patched": patched,
        "after": after,
        "calls": calls_snapshot,
        "covered": covered,
        "bound_to_ours": bound_to_ours,
        "restored": restored,
        "last": last,
    }


@pytest.mark.slow  # reads test_verl_equality's gloo worlds (verl and Megatron imported in every rank)
@pytest.mark.parametrize("name", ["cp1", "cp2"])
def test_verl_forward_functions_call_the_dropins_and_return_the_same(name):
    from tests.test_verl_equality import world

    world_size = int(name[2:])
    for result in (rank_result["patching"] for rank_result in world(name)):
        # verl's own model_forward_gen / gptmodel_forward_model_engine went through our functions
        for name in (
            "preprocess_packed_seqs",
            "postprocess_packed_seqs",
            "preprocess_thd_engine",
            "postprocess_thd_engine",
            "preprocess_bshd_engine",
            "postprocess_bshd_engine",
        ):
            assert result["calls"].get(name, 0) > 0, (name, result["calls"])
        if world_size == 1:
            assert result["calls"]["preprocess_bshd"] > 0 and result["calls"]["postprocess_bshd"] > 0
        # every caller module that imported the functions before install now holds ours
        for module in (
            "verl.models.mcore.model_forward",
            "verl.models.mcore.model_forward_fused",
            "verl.models.mcore.model_forward_1f1b_overlap",
            "verl.utils.megatron.router_replay_utils",
            "verl.trainer.distillation.megatron.losses",
            "verl.models.mcore.util",
        ):
            assert module in result["covered"], (module, sorted(result["covered"]))
        assert result["bound_to_ours"]["verl.trainer.distillation.megatron.losses"] == [
            "preprocess_bshd_engine",
            "preprocess_thd_engine",
        ]
        assert result["restored"]
        # same results before, with and after the patch (need_roll labels: all but each sequence's last token)
        before, patched, after = result["before"], result["patched"], result["after"]
        assert before.keys() == patched.keys() == after.keys()
        for key in before:
            keep = ~result["last"] if "rolled_label" in key else slice(None)
            assert patched[key].dtype == before[key].dtype, key
            assert torch.equal(patched[key][keep], before[key][keep]), key
            assert torch.equal(after[key], before[key]), key


ENV_SCRIPT = """
import sys
import verl  # runs VERL_USE_EXTERNAL_MODULES while verl/__init__ imports
assert "verl.models.mcore.util" not in sys.modules, "the plugin must not import verl.models.mcore eagerly"
from verl.models.mcore import model_forward, util
from verl_cppack.integrations.verl import dropins, patching
assert model_forward.preprocess_thd_engine is dropins.preprocess_thd_engine
assert model_forward.postprocess_packed_seqs is dropins.postprocess_packed_seqs
assert util.preprocess_packed_seqs is dropins.preprocess_packed_seqs
assert patching.originals()["preprocess_packed_seqs"].__module__ == "verl.models.mcore.util"
print("generation", patching.status()["generation"])
import json
from verl_cppack.cli import main  # `verl-cppack doctor --verify --json` reports the patch and its coverage
main(["doctor", "--verify", "--json"])
"""


def _fresh_python(env_update: dict[str, str], script: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_CPPACK_DISABLE")}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # a fresh interpreter importing verl
def test_environment_variable_activates_the_plugin_in_a_fresh_interpreter():
    result = _fresh_python({"VERL_USE_EXTERNAL_MODULES": "verl_cppack.verl_plugin"}, ENV_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "generation engine"
    doctor = json.loads("\n".join(lines[1:]))  # --json: the report alone (what vLLM logs goes to stderr)
    assert doctor["patch"]["installed"] and doctor["verl_util"]["generation"] == "engine"
    assert doctor["versions"]["verl"] == importlib.metadata.version("verl") and doctor["versions"]["torch"]
    assert set(CALLERS) <= set(doctor["patch"]["covered"]), sorted(doctor["patch"]["covered"])


def test_disable_variable_leaves_verl_untouched():
    script = (
        "import sys\n"
        "import verl_cppack.verl_plugin as plugin\n"
        "from verl_cppack.integrations.verl import patching\n"
        "assert plugin.INSTALLED is False and not patching.is_installed()\n"
        "assert not any(type(f).__name__ == '_UtilImportHook' for f in sys.meta_path)\n"
    )
    result = _fresh_python({"VERL_CPPACK_DISABLE": "1"}, script)
    assert result.returncode == 0, result.stderr[-3000:]


def test_doctor_json_keeps_what_libraries_print_off_standard_output():
    # what `doctor --json` runs the report under: a library printing (vLLM logs to stdout), a logging handler bound to
    # sys.stdout inside the block, and C code writing to file descriptor 1 all land on stderr; the report alone on stdout
    script = (
        "import logging, os, sys\n"
        "from verl_cppack.cli.doctor import _stdout_to_stderr\n"
        "with _stdout_to_stderr():\n"
        "    print('library print')\n"
        "    handler = logging.StreamHandler(sys.stdout)\n"
        "    os.write(1, b'fd one\\n')\n"
        "handler.stream.write('handler line\\n'); handler.flush()\n"
        "print('{}')\n"
    )
    result = _fresh_python({}, script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "{}\n"
    assert "library print" in result.stderr and "fd one" in result.stderr and "handler line" in result.stderr
