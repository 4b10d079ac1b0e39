"""``verl-cppack bench``: verl's packing functions vs verl_cppack's drop-ins, in real CP groups."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path

from verl_cppack.bench.measure import run_benchmark
from verl_cppack.bench.report import (
    generated_section_text,
    markdown_table,
    performance_section,
    small_batch_table,
    summary_lines,
    update_generated_section,
    write_outputs,
)
from verl_cppack.bench.settings import FUNCTIONS, BenchSettings, int_list
from verl_cppack.bench.targets import missed_targets, stretch_missed
from verl_cppack.bench.vlm_masks import vlm_table


def run(args: argparse.Namespace) -> int:
    settings = (
        BenchSettings.quick()
        if args.quick
        else BenchSettings(threads=args.threads, repeats=args.repeats, runs=args.runs, warmup=args.warmup)
    )
    settings = dataclasses.replace(
        settings, device=args.device, functions=args.functions, keep_freed_host_memory=not args.system_malloc
    )
    try:
        for name in ("batch_sizes", "seq_lens", "cp_sizes"):
            if getattr(args, name) is not None:
                settings = dataclasses.replace(settings, **{name: int_list(name, getattr(args, name))})
        settings.check()
        if args.update_docs:
            generated_section_text(Path(args.doc), args.functions)  # before minutes of measuring, not after
        output = output_folder(args)
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--output {output} cannot be a results folder ({error.strerror})") from None
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    machine = {
        "cpu_count": os.cpu_count(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "load_before": _load(),
    }
    begin = time.monotonic()
    rows = run_benchmark(settings)
    machine.update(load_after=_load(), wall_s=round(time.monotonic() - begin, 1))
    print(small_batch_table(rows))
    print(markdown_table(rows))
    if any("vlm_masks" in row for row in rows):
        print(vlm_table(rows))
    print("\n".join(summary_lines(rows)))
    paths = write_outputs(rows, settings, output, machine)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if args.update_docs:
        document = Path(args.doc)
        plot_path, table_path = (
            os.path.relpath(Path(paths[kind]).resolve(), document.resolve().parent) if kind in paths else None
            for kind in ("plot", "table")
        )
        section = performance_section(rows, settings, plot_path, machine, table_path)
        update_generated_section(document, section, args.functions)
        print(f"updated the generated section of {document}")
    missed = missed_targets(rows)
    for line in missed:
        print(f"target missed: {line}")
    if not missed:
        print("every target met")
    for line in stretch_missed(rows):
        print(f"stretch target missed (not checked by --strict): {line}")
    return 1 if (missed and args.strict) else 0


def _load() -> float | None:
    """The 1-minute load average (``None`` where the system does not tell)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def output_folder(args: argparse.Namespace) -> Path:
    """``--output``; by default ``bench_out``, or with ``--update-docs`` ``benchmarks/`` beside the document
    (``benchmarks/engine/`` for ``--functions engine``), so the plot the document links to is committed with it."""
    if args.output is not None:
        return Path(args.output)
    if not args.update_docs:
        return Path("bench_out")
    folder = Path(args.doc).parent / "benchmarks"
    return folder / "engine" if args.functions == "engine" else folder


def _joined(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark verl's packing functions against verl_cppack's", description=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI smoke run)")
    parser.add_argument(
        "--output",
        help="folder for results.json, table.md, speedup.png (default bench_out; with --update-docs benchmarks/ beside "
        "--doc, benchmarks/engine/ with --functions engine)",
    )
    defaults = BenchSettings()
    parser.add_argument(
        "--threads", type=int, default=defaults.threads, help="torch threads per rank (default %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help="micro-batches timed per point; medians (default %(default)s)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=defaults.runs,
        help="fresh process groups per CP size; medians (default %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        help="untimed micro-batches per point first (default %(default)s)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per CP rank, nccl")
    parser.add_argument(
        "--functions",
        default="legacy",
        choices=FUNCTIONS,
        help="legacy: preprocess/postprocess_packed_seqs (padded [B, S]); engine: preprocess/postprocess_thd_engine "
        "(jagged, verl's engine forward); default %(default)s",
    )
    parser.add_argument("--batch-sizes", help=f"comma-separated B values (default {_joined(defaults.batch_sizes)})")
    parser.add_argument("--seq-lens", help=f"comma-separated S values (default {_joined(defaults.seq_lens)})")
    parser.add_argument(
        "--cp-sizes",
        help=f"comma-separated CP sizes (default {_joined(defaults.cp_sizes)}; one GPU per rank with cuda)",
    )
    parser.add_argument(
        "--system-malloc", action="store_true", help="CPU: leave glibc's defaults (freed buffers go back to the OS)"
    )
    parser.add_argument(
        "--update-docs", action="store_true", help="rewrite the generated section of --doc (one per --functions)"
    )
    parser.add_argument("--doc", default="docs/performance.md", help="document to update (default docs/performance.md)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a performance target is missed (each missed one is printed; targets: bench/targets.py)",
    )
    parser.set_defaults(func=run)
