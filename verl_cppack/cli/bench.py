"""``verl-cppack bench``: verl's packing functions vs verl_cppack's drop-ins, in real CP groups."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
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
from verl_cppack.cli import add_command, error


def run(args: argparse.Namespace) -> int:
    sizes = {name: getattr(args, name) for name in ("threads", "repeats", "runs", "warmup")}
    settings = BenchSettings.quick() if args.quick else BenchSettings(**sizes)
    options = {"device": args.device, "functions": args.functions, "keep_freed_host_memory": not args.system_malloc}
    try:
        lists = ("batch_sizes", "seq_lens", "cp_sizes")
        options.update({name: int_list(name, getattr(args, name)) for name in lists if getattr(args, name) is not None})
        settings = dataclasses.replace(settings, **options)
        settings.check()
        if args.update_docs:
            generated_section_text(Path(args.doc), args.functions)  # before minutes of measuring, not after
        output = output_folder(args)
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as failure:
            raise ValueError(f"--output {output} cannot be a results folder ({failure.strerror})") from None
    except (TypeError, ValueError) as problem:
        return error(str(problem))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    machine = {"cpu_count": os.cpu_count(), "started_utc": started, "load_before": _load()}
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
    print("\n".join([f"target missed: {line}" for line in missed] or ["every target met"]))
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "bench", "benchmark verl's packing functions against verl_cppack's", __doc__, run)
    parser.add_argument(
        "--output",
        help="folder for results.json, table.md, speedup.png (default bench_out; with --update-docs benchmarks/ beside "
        "--doc, benchmarks/engine/ with --functions engine)",
    )
    defaults = BenchSettings()
    for flag, text in (
        ("--threads", "torch threads per rank"),
        ("--repeats", "micro-batches timed per point; medians"),
        ("--runs", "fresh process groups per CP size; medians"),
        ("--warmup", "untimed micro-batches per point first"),
    ):
        default = getattr(defaults, flag[2:])
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per CP rank, nccl")
    parser.add_argument(
        "--functions",
        default="legacy",
        choices=FUNCTIONS,
        help="legacy: preprocess/postprocess_packed_seqs (padded [B, S]); engine: preprocess/postprocess_thd_engine "
        "(jagged, verl's engine forward); default %(default)s",
    )
    for flag, text in (("--batch-sizes", "B values"), ("--seq-lens", "S values"), ("--cp-sizes", "CP sizes")):
        default = ",".join(map(str, getattr(defaults, flag[2:].replace("-", "_"))))
        gpus = "; one GPU per rank with cuda" if flag == "--cp-sizes" else ""
        parser.add_argument(flag, help=f"comma-separated {text} (default {default}{gpus})")
    parser.add_argument("--doc", default="docs/performance.md", help="document to update (default docs/performance.md)")
    for flag, text in (
        ("--quick", "small sizes, one repeat (CI smoke run)"),
        ("--system-malloc", "CPU: leave glibc's defaults (freed buffers go back to the OS)"),
        ("--update-docs", "rewrite the generated section of --doc (one per --functions)"),
        ("--strict", "exit 1 when a performance target is missed (each one is printed; targets: bench/targets.py)"),
    ):
        parser.add_argument(flag, action="store_true", help=text)
