"""``verl-cppack verify-gpu``: the acceptance checks that need a CUDA GPU, in one command, into one JSON report.

1. ``zigzag_vs_transformer_engine``: ``core.layouts.zigzag_indices`` index for index against Transformer Engine's
   ``thd_get_partitioned_indices`` on the GPU, random padded offsets, CP sizes 1-8, every rank (skipped without TE);
2. ``cuda_equals_cpu``: plans, ``pack`` (CP 1, 2, 4, every rank, ``shift=1`` too) and ``unpack`` (CP=1) of random
   masks on the GPU give the CPU's results exactly, for int64, bool, bf16 and fp32 with trailing dimensions;
3. ``host_syncs``: device-to-host synchronisations counted with ``torch.cuda.set_sync_debug_mode("warn")`` while a
   micro-batch is planned, packed (inputs, labels, a mask) and unpacked: the plan may sync once, a reuse never;
4. ``bad_input_errors``: masks with a 2, a -1, floats, no valid token or one dimension, a tensor of another batch,
   one on another device and a local output of the wrong length, all on the GPU: each a ``ValueError``/``TypeError``,
   never a device-side assertion (the device still works afterwards: a round trip equals its input);
5. ``bench``: ``verl-cppack bench --device cuda --quick`` on one CP size per available GPU (its ``results.json``);
6. ``verify_cp``: ``verl-cppack verify-cp --cp 2`` (CP=2 against CP=1 through verl's engine forward, its gloo ranks
   where that command puts them) and its JSON report.

Writes ``--output`` (default ``verify_gpu.json``). Exit status: 0 every check passed or was skipped, 1 a check
failed, 2 there is no CUDA device (one ``error:`` line) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_cppack.bench.batches import rollout_batch
from verl_cppack.cli import add_command, error

ZIGZAG_CASES = 64  # random offset tables per CP size
# torch's per-operation sync warning, not its one-time "does not yet detect all synchronizing operations" notice
SYNC_WARNING = "called a synchronizing CUDA operation"
RunCommand = Callable[[Sequence[str], float], subprocess.CompletedProcess]


def check_zigzag(device: torch.device, partitioned_indices: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    """``zigzag_indices`` against ``partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank)`` (TE's)."""
    from verl_cppack.core.layouts import zigzag_indices

    if partitioned_indices is None:
        return {"ok": None, "skipped": "transformer_engine_torch is not installed"}
    generator = torch.Generator().manual_seed(0)
    compared = 0
    for cp_size in (1, 2, 3, 4, 8):
        for _ in range(ZIGZAG_CASES):  # [B+1] int32 padded offsets, slots multiples of 2*cp_size (zero-length too)
            batch = int(torch.randint(1, 9, (1,), generator=generator))
            lengths = torch.randint(0, 9, (batch,), generator=generator) * 2 * cp_size
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
            total = int(offsets[-1])
            if total == 0:
                continue
            for cp_rank in range(cp_size):
                ours = zigzag_indices(offsets.to(device), cp_size, cp_rank)
                theirs = partitioned_indices(offsets.to(device), total, cp_size, cp_rank)
                compared += 1
                if ours.shape != theirs.shape or not torch.equal(ours.cpu().long(), theirs.cpu().long()):
                    case = {"cu_seqlens_padded": offsets.tolist(), "cp_size": cp_size, "cp_rank": cp_rank}
                    case.update(ours=ours.tolist(), transformer_engine=theirs.tolist())
                    return {"ok": False, "compared": compared, "first_difference": case}
    return {"ok": True, "compared": compared}


def _random_mask(generator: torch.Generator, batch: int = 6, seq_len: int = 24) -> torch.Tensor:
    """Rows of 1..S tokens anywhere (``bench.batches``), row 0 a 1-token row."""
    _, mask = rollout_batch(batch, seq_len, padding="anywhere", generator=generator)
    mask[0] = False
    mask[0, 3] = True
    return mask


def check_cuda_equals_cpu(device: torch.device) -> dict[str, Any]:
    """The same plans and packed tensors on ``device`` as on the CPU."""
    from verl_cppack import ParallelContext, plan_from_mask

    generator = torch.Generator().manual_seed(1)
    compared, differences = 0, []
    for trial in range(8):
        mask = _random_mask(generator)
        tensors = {
            "int64": torch.randint(0, 1000, mask.shape, generator=generator),
            "bool": torch.rand(mask.shape, generator=generator) < 0.5,
            "bf16": torch.randn((*mask.shape, 3), generator=generator).to(torch.bfloat16),
            "fp32": torch.randn((*mask.shape, 2, 2), generator=generator),
        }
        for cp_size in (1, 2, 4):
            for cp_rank in range(cp_size):
                ctx = ParallelContext(cp_size=cp_size, cp_rank=cp_rank)
                on_cpu, on_device = plan_from_mask(mask, ctx), plan_from_mask(mask.to(device), ctx)
                pairs = [("cu_seqlens_padded", on_cpu.cu_seqlens_padded, on_device.cu_seqlens_padded)]
                pairs += [("local_index", on_cpu.local_index, on_device.local_index)]
                for name, x in tensors.items():
                    for shift in (0, 1):
                        packed = on_cpu.pack(x, shift=shift), on_device.pack(x.to(device), shift=shift)
                        pairs.append((f"pack {name} shift={shift}", *packed))
                    if cp_size == 1:
                        packed = on_cpu.pack(x)
                        pairs.append((f"unpack {name}", on_cpu.unpack(packed), on_device.unpack(packed.to(device))))
                for name, a, b in pairs:
                    compared += 1
                    if b.device.type != device.type or a.dtype != b.dtype or not torch.equal(a, b.cpu()):
                        differences.append(f"trial {trial} CP={cp_size} rank {cp_rank}: {name}")
    return {"ok": not differences, "compared": compared, "differences": differences[:20]}


def count_host_syncs(step: Callable[[], Any], device: torch.device) -> int | None:
    """Synchronising CUDA operations ``step`` makes (None where they cannot be counted: not a CUDA device)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(SYNC_WARNING in str(warning.message) for warning in caught)


def check_host_syncs(device: torch.device, counter: Callable[..., int | None] = count_host_syncs) -> dict[str, Any]:
    """Host syncs of one micro-batch: planning (at most 1), then packing and unpacking with the plan (none)."""
    from verl_cppack import ParallelContext, plan_from_mask

    generator = torch.Generator().manual_seed(2)
    mask = _random_mask(generator, batch=16, seq_len=256).to(device)
    ids = torch.randint(0, 1000, mask.shape, generator=generator).to(device)
    output = torch.randn((*mask.shape, 8), generator=generator).to(device)
    ctx = ParallelContext()
    made: dict[str, Any] = {}

    def plan() -> None:
        made["plan"] = plan_from_mask(mask, ctx)

    def reuse() -> None:
        p = made["plan"]
        p.pack(ids)
        p.pack(ids, shift=1)
        p.pack(mask)
        p.unpack(p.pack(output))

    counts = {"plan": counter(plan, device), "pack_and_unpack": counter(reuse, device)}
    if counts["plan"] is None:
        return {"ok": None, "skipped": f"host syncs are counted on CUDA only (device {device})", "counts": counts}
    limits = {"plan": 1, "pack_and_unpack": 0}
    return {"ok": all(counts[k] <= limits[k] for k in limits), "counts": counts, "limits": limits}


def _bad_inputs(device: torch.device) -> dict[str, Callable[[], Any]]:
    """Calls on ``device`` tensors that must raise ``ValueError``/``TypeError`` before any work."""
    from verl_cppack import plan_from_mask

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], device=device)
    plan = plan_from_mask(mask)
    cases: dict[str, Callable[[], Any]] = {
        "mask holding a 2": lambda: plan_from_mask(torch.tensor([[1, 2, 0]], device=device)),
        "mask holding a -1": lambda: plan_from_mask(torch.tensor([[1, -1, 0]], device=device)),
        "float mask": lambda: plan_from_mask(torch.ones(2, 3, device=device)),
        "mask with no valid token": lambda: plan_from_mask(torch.zeros(2, 3, dtype=torch.bool, device=device)),
        "1-D mask": lambda: plan_from_mask(torch.ones(4, dtype=torch.bool, device=device)),
        "tensor of another batch": lambda: plan.pack(torch.ones(2, 5, device=device)),
        "local output of the wrong length": lambda: plan.unpack(torch.ones(1, plan.local_length - 1, device=device)),
    }
    if device.type != "cpu":
        cases["tensor on the CPU"] = lambda: plan.pack(torch.ones(2, 4))
    return cases


def check_bad_input_errors(device: torch.device, cases: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """Each bad input a Python ``ValueError``/``TypeError`` on ``device``, and the device still sound afterwards."""
    from verl_cppack import plan_from_mask

    raised: dict[str, str] = {}
    for name, call in (cases if cases is not None else _bad_inputs(device)).items():
        try:
            call()
            raised[name] = "nothing"
        except (ValueError, TypeError) as expected:
            raised[name] = type(expected).__name__
        except Exception as other:  # noqa: BLE001 - any other exception is what the check reports
            raised[name] = f"{type(other).__name__}: {other}"[:300]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a device-side assertion would surface here
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    values = torch.arange(1.0, 13.0).view(3, 4)
    plan = plan_from_mask(mask.to(device))
    sound = torch.equal(plan.unpack(plan.pack(values.to(device))).cpu(), values * mask)  # padding comes back zero
    errors_only = all(kind in ("ValueError", "TypeError") for kind in raised.values())
    return {"ok": errors_only and sound, "raised": raised, "device_sound_afterwards": sound}


def _run(command: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)


def run_bench(folder: Path, gpus: int, run_command: RunCommand = _run) -> dict[str, Any]:
    """``bench --device cuda --quick`` over the CP sizes the GPUs allow (1, 2, 4 up to ``gpus``)."""
    cp_sizes = ",".join(str(cp) for cp in (1, 2, 4) if cp <= max(gpus, 1))
    arguments = ["bench", "--device", "cuda", "--quick", "--cp-sizes", cp_sizes, "--output", str(folder)]
    return _run_cli(arguments, folder / "results.json", "results", run_command)


def run_verify_cp(folder: Path, run_command: RunCommand = _run) -> dict[str, Any]:
    """``verify-cp --cp 2`` with its JSON report."""
    path = folder / "verify_cp.json"
    return _run_cli(["verify-cp", "--cp", "2", "--json", str(path)], path, "report", run_command)


def _run_cli(arguments: list[str], written: Path, key: str, run_command: RunCommand) -> dict[str, Any]:
    """Run ``verl-cppack ARGUMENTS``: its exit status, the JSON it wrote (as ``key``), if it failed its stderr tail."""
    command = [sys.executable, "-m", "verl_cppack.cli", *arguments]
    result = run_command(command, 1800)
    report: dict[str, Any] = {"ok": result.returncode == 0, "command": command[2:], "returncode": result.returncode}
    if written.is_file():
        report[key] = json.loads(written.read_text())
    if result.returncode != 0:
        report["stderr_tail"] = result.stderr[-2000:]
    return report


def transformer_engine_indices() -> Callable[..., torch.Tensor] | None:
    """TE's ``thd_get_partitioned_indices`` when Transformer Engine's torch extension is installed."""
    try:
        import transformer_engine_torch as tex
    except ImportError:
        return None
    return getattr(tex, "thd_get_partitioned_indices", None)


def collect(
    device: torch.device,
    folder: Path,
    partitioned_indices: Callable[..., torch.Tensor] | None,
    gpus: int,
    run_command: RunCommand = _run,
    counter: Callable[..., int | None] = count_host_syncs,
) -> dict[str, Any]:
    """Every check's report (a check that raises is a failed check naming the exception) and ``ok``."""
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "zigzag_vs_transformer_engine": lambda: check_zigzag(device, partitioned_indices),
        "cuda_equals_cpu": lambda: check_cuda_equals_cpu(device),
        "host_syncs": lambda: check_host_syncs(device, counter),
        "bad_input_errors": lambda: check_bad_input_errors(device),
        "bench": lambda: run_bench(folder / "bench", gpus, run_command),
        "verify_cp": lambda: run_verify_cp(folder, run_command),
    }
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as failure:  # noqa: BLE001 - one failed check must not hide the others
            results[name] = {"ok": False, "error": f"{type(failure).__name__}: {failure}"}
    return {"ok": all(result.get("ok") is not False for result in results.values()), "checks": results}


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.is_dir():
        return error(f"--output {output} is a directory; give the path of the JSON file to write")
    if not torch.cuda.is_available():
        return error(
            "verify-gpu needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); run it on a GPU machine"
        )
    device, te_indices = torch.device("cuda", torch.cuda.current_device()), transformer_engine_indices()
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory(prefix="verl_cppack_verify_gpu_") as folder:
        report = collect(device, Path(folder), te_indices, gpus)
    report.update(device=torch.cuda.get_device_name(device), gpus=gpus, torch=torch.__version__)
    report.update(cuda=torch.version.cuda, transformer_engine=te_indices is not None)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    for name, result in report["checks"].items():
        state = {True: "ok", False: "FAILED", None: "skipped"}[result.get("ok")]
        print(f"{name:30s} {state}  {result.get('skipped') or result.get('error') or ''}".rstrip())
    print(f"report: {output}")
    return 0 if report["ok"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    help_text = (
        "the GPU acceptance checks (TE zigzag, CUDA = CPU, host syncs, bad input, bench, verify-cp) into one JSON"
    )
    parser = add_command(subparsers, "verify-gpu", help_text, __doc__, run)
    parser.add_argument("--output", default="verify_gpu.json", help="the JSON report (default verify_gpu.json)")
