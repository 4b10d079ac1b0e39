"""A newer verl whose packing functions keep their signatures but change their results gets its own functions back.

The stand-in "verl 0.10.0" is verl 0.9.1's wheel (``tests.verl_releases``) with its version file saying 0.10.0 and
two changes to ``verl/models/mcore/util.py`` that no signature shows: ``preprocess_packed_seqs`` aligns every slot
to ``TP*CP*4`` and ``preprocess_thd_engine`` returns position ids counted from 1. 0.10.0 is no release the matrix
tests, so the drop-ins check themselves (``runtime_check``): after the first micro-batch every function verl's
forward calls returns that release's own results, one warning names each function put back and the difference,
``status()`` lists them, and ``verl-cppack doctor --verify`` lists them too and exits 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.verl_releases import UTIL_PATH, release_dir

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow  # a stand-in verl release in subprocesses

ALIGN_LINE = "    align_size = tp_size * cp_size * 2 if cp_size > 1 else tp_size\n"
PACKED_SEQS_DEF = "def preprocess_packed_seqs("
THD_RETURN = "        return input_ids_rmpad.unsqueeze(0), packed_seq_params, position_ids_rmpad.unsqueeze(0)\n"


@pytest.fixture(scope="module")
def changed_verl(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("verl-0.10.0")
    shutil.copytree(release_dir("0.9.1") / "verl", folder / "verl")
    (folder / "verl" / "version" / "version").write_text("0.10.0\n")
    util = folder / UTIL_PATH
    source = util.read_text()
    head, packed_seqs = source.split(PACKED_SEQS_DEF, 1)
    assert packed_seqs.index(ALIGN_LINE) < packed_seqs.index("\ndef "), "0.9.1's preprocess_packed_seqs moved"
    packed_seqs = packed_seqs.replace(ALIGN_LINE, "    align_size = tp_size * cp_size * 4\n", 1)
    source = head + PACKED_SEQS_DEF + packed_seqs
    assert source.count(THD_RETURN) == 1, "0.9.1's preprocess_thd_engine return moved"
    source = source.replace(
        THD_RETURN, THD_RETURN.replace("position_ids_rmpad.unsqueeze(0)\n", "position_ids_rmpad.unsqueeze(0) + 1\n")
    )
    util.write_text(source)
    return folder


def _python(folder: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_CPPACK_DISABLE", "VERL_PLATFORM", "VERL_CPPACK_VERIFY")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    env.update(extra)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


# One process, one rank: the first micro-batch through model_forward's names, then a second one whose every call is
# compared with the release's own function (verl's results, intended differences of the newest release excused).
RUN_SCRIPT = r"""
import inspect, json, os, sys, time, warnings, torch, torch.distributed as dist
import verl_cppack.verl_plugin
from verl_cppack.integrations.verl import comparison, patching, runtime_check
from tests.verl_release_harness import random_batch, to_nested
from verl.models.mcore import model_forward as mf, model_forward_fused as mff, util
from verl.utils.model import CausalLMOutputForPPO
assert util.__file__.startswith(os.environ["PYTHONPATH"].split(os.pathsep)[0]), util.__file__
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel()
own = dict(patching.originals())  # the release's own functions

def micro_batch(seed, record):
    d = random_batch(seed)
    mask = d["mask"]
    batch, seq_len = mask.shape
    nested = to_nested(d["input_ids"], mask)
    labels = to_nested(d["label"], mask)
    calls = []
    def call(name, *args, **kwargs):
        result = getattr(mf if hasattr(mf, name) else mff, name)(*args, **kwargs)
        calls.append((name, args, kwargs, result))
        return result
    packed, psp = call("preprocess_packed_seqs", d["input_ids"], mask)
    call("postprocess_packed_seqs", torch.randn(1, packed.shape[1], 4), psp, mask, batch, seq_len)
    label_mask, psp_l = call("preprocess_packed_seqs", d["label_mask"], mask)
    n = label_mask.shape[1]
    call("postprocess_packed_seqs_for_dict_output", label_mask,
         CausalLMOutputForPPO(log_probs=-torch.rand(n), entropy=torch.rand(n)), psp_l, mask, batch, seq_len)
    thd, psp_t, _ = call("preprocess_thd_engine", nested)
    call("preprocess_thd_engine", labels, need_roll=True)
    call("postprocess_thd_engine", torch.randn(1, thd.shape[1], 4), psp_t, nested, batch)
    positions = torch.cumsum(mask.long(), 1) - 1
    rows, row_mask, _ = call("preprocess_bshd", d["input_ids"], mask, positions, False)
    call("postprocess_bshd", torch.randn(*row_mask.shape, 4), row_mask, mask, seq_len)
    rows, row_mask, _ = call("preprocess_bshd_engine", nested)
    call("preprocess_bshd_engine", labels, need_roll=True)
    call("postprocess_bshd_engine", torch.randn(*row_mask.shape, 4), row_mask)
    call("build_vlm_attn_mask_thd", nested, 0)
    call("build_vlm_attn_mask_bshd", nested, batch, 0)
    return calls

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    micro_batch(1, True)
    first = time.perf_counter() - start
    second = micro_batch(2, False)
differences = {}
for name, args, kwargs, result in second:
    bound = inspect.signature(own[name]).bind(*runtime_check.copy_argument(args), **kwargs)
    theirs = own[name](*bound.args, **bound.kwargs)
    findings = comparison.compare_call(name, own[name], bound, theirs, result)
    unexcused = [f.describe() for f in comparison.unexcused(findings, "0.10.0", 1)]
    if unexcused:
        differences[name] = unexcused
status = patching.status()
mpu.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps({
    "called": sorted({name for name, *_ in second}), "replaced": sorted(own), "first_micro_batch_s": first,
    "release": status["release"], "verifying": status["verifying"], "put_back": status["put_back"],
    "warnings": [str(w.message) for w in caught if "verl_cppack" in str(w.message)],
    "differences_after_first": differences,
    "verls_in_util": sorted(n for n in own if getattr(util, n) is own[n]),
    "modules_holding_ours": sorted(  # a function put back, still the drop-in somewhere in verl
        f"{m}.{n}" for m, module in list(sys.modules.items()) if m.startswith("verl.")
        for n in status["put_back"] if n in vars(module) and vars(module)[n] is not own[n]
    ),
    "modules_holding_verls": sorted(  # a function kept, verl's somewhere
        f"{m}.{n}" for m, module in list(sys.modules.items()) if m.startswith("verl.")
        for n in own if n not in status["put_back"] and vars(module).get(n) is own[n]
    ),
}))
"""


def test_after_the_first_micro_batch_every_function_returns_the_releases_own_results(changed_verl, tmp_path):
    result = _python(changed_verl, "-c", RUN_SCRIPT, STORE=str(tmp_path / "store"))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["release"] == "0.10.0" and report["verifying"] is True
    put_back = report["put_back"]
    # the two changed functions, and the gather-backs that cannot undo the changed alignment (ours refuses verl's
    # PackedSeqParams: they describe no padding ours makes); postprocess_thd_engine stays ours, and equal
    assert sorted(put_back) == [
        "postprocess_packed_seqs",
        "postprocess_packed_seqs_for_dict_output",
        "preprocess_packed_seqs",
        "preprocess_thd_engine",
    ]
    assert put_back["preprocess_packed_seqs"].startswith("result[0]:shape: verl (1, ")
    assert put_back["preprocess_thd_engine"].startswith("positions-real")
    for name in ("postprocess_packed_seqs", "postprocess_packed_seqs_for_dict_output"):
        assert put_back[name].startswith("ours raised where verl's did not (ValueError: packed_seq_params does not")
    assert report["differences_after_first"] == {}
    assert report["called"] == report["replaced"] and len(report["replaced"]) == 11  # every replaced function
    assert report["verls_in_util"] == sorted(put_back)
    assert report["modules_holding_ours"] == [] and report["modules_holding_verls"] == []
    assert len(report["warnings"]) == 4
    for name, reason in put_back.items():
        [warning] = [w for w in report["warnings"] if f"'s {name} gives" in w]
        assert warning.startswith(f"verl_cppack: verl 0.10.0's {name} gives other results than its drop-in")
        assert reason[:60] in warning and "put back for the rest of this process" in warning


def test_doctor_lists_what_it_put_back(changed_verl):
    verified = _python(changed_verl, "-m", "verl_cppack.cli", "doctor", "--verify")
    assert verified.returncode == 1, verified.stdout[-3000:] + verified.stderr[-3000:]
    lines = [line for line in verified.stdout.splitlines() if "put back to verl's own" in line]
    assert [line.split(": ", 1)[1].split(" (")[0] for line in lines] == [
        "postprocess_packed_seqs",  # verl's dict-output gather-back calls it with verl's PackedSeqParams
        "postprocess_packed_seqs_for_dict_output",
        "preprocess_packed_seqs",
        "preprocess_thd_engine",
    ], verified.stdout
    assert "the drop-ins verify themselves on their first calls (verl 0.10.0)" in verified.stdout
