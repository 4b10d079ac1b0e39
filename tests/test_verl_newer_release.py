"""A newer verl whose packing function takes a parameter the drop-in does not know keeps its own function.

The stand-in for that newer verl is verl 0.9.1's wheel (``tests.verl_releases``) with one change to
``verl/models/mcore/util.py``: ``preprocess_thd_engine`` takes ``return_position_ids: bool = False`` (a keyword
verl might add), and a new function ``pack_sequences_v2`` appears. With the plugin loaded, every module keeps
verl's ``preprocess_thd_engine`` — which runs — while the other ten packing functions are replaced;
``verl-cppack doctor`` lists both functions left to verl and why, without importing verl, and ``--verify``
exits 1.
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

SIGNATURE_LINE = (
    '    cp_layout: ContextParallelLayout = "zigzag",\n) -> tuple[torch.Tensor, PackedSeqParams, torch.Tensor | None]:'
)
REASON = "parameters the drop-in does not know: return_position_ids"


@pytest.fixture(scope="module")
def newer_verl(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("newer-verl")
    shutil.copytree(release_dir("0.9.1") / "verl", folder / "verl")
    util = folder / UTIL_PATH
    source = util.read_text()
    assert source.count(SIGNATURE_LINE) == 1, "verl 0.9.1's preprocess_thd_engine signature moved"
    source = source.replace(
        SIGNATURE_LINE, SIGNATURE_LINE.replace('"zigzag",\n)', '"zigzag",\n    return_position_ids: bool = False,\n)')
    )
    util.write_text(source + "\n\ndef pack_sequences_v2(input_ids):\n    return input_ids\n")
    return folder


def _python(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_CPPACK_DISABLE", "VERL_PLATFORM")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


RUN_SCRIPT = r"""
import json, os, torch, torch.distributed as dist
import verl_cppack.verl_plugin
from verl_cppack.integrations.verl import patching
from verl.models.mcore import model_forward, model_forward_fused, util
assert util.__file__.startswith(os.environ["PYTHONPATH"].split(os.pathsep)[0]), util.__file__
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("TEST_PORT", "29651"))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel()
nested = torch.nested.nested_tensor([torch.arange(1, 4), torch.arange(5, 7)], layout=torch.jagged)
packed, params, positions = model_forward.preprocess_thd_engine(nested, return_position_ids=True)  # verl's, running
mpu.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps({
    "kept": [m.__name__ for m in (util, model_forward, model_forward_fused)
             if m.preprocess_thd_engine.__module__ == "verl.models.mcore.util"],
    "ours_elsewhere": model_forward.postprocess_thd_engine.__module__,
    "replaced": sorted(patching.originals()),
    "left": patching.status()["left_to_verl"],
    "packed": packed.tolist(),
}))
"""


def test_a_function_with_an_unknown_parameter_stays_verls_and_runs(newer_verl):
    result = _python(newer_verl, "-c", RUN_SCRIPT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kept"] == [
        "verl.models.mcore.util",
        "verl.models.mcore.model_forward",
        "verl.models.mcore.model_forward_fused",
    ]
    assert report["left"] == {"preprocess_thd_engine": REASON}
    assert len(report["replaced"]) == 10 and "preprocess_thd_engine" not in report["replaced"]
    assert report["ours_elsewhere"].startswith("verl_cppack.")
    assert report["packed"] == [[1, 2, 3, 5, 6]]


def test_doctor_lists_the_function_left_to_verl(newer_verl):
    listing = _python(newer_verl, "-m", "verl_cppack.cli", "doctor", "--json")
    assert listing.returncode == 0, listing.stderr[-3000:]
    report = json.loads(listing.stdout)
    assert Path(report["verl_util"]["util"]).resolve() == (newer_verl / UTIL_PATH).resolve()
    assert report["verl_util"]["left_to_verl"] == {
        "pack_sequences_v2": "no drop-in knows this function",
        "preprocess_thd_engine": REASON,
    }
    assert len(report["verl_util"]["replaceable"]) == 10

    verified = _python(newer_verl, "-m", "verl_cppack.cli", "doctor", "--verify")
    assert verified.returncode == 1, verified.stdout[-3000:] + verified.stderr[-3000:]
    assert f"left to verl: preprocess_thd_engine ({REASON})" in verified.stdout
    assert "left to verl: pack_sequences_v2 (no drop-in knows this function)" in verified.stdout
    assert f"left to verl in this process: preprocess_thd_engine ({REASON})" in verified.stdout
