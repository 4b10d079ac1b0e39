"""What a leaner plan build (compiled, or straight-line numpy) would buy: a measurement behind a design decision.

The drop-ins build a plan with numpy and Python on the host (mask scan, per-sequence tables, the layout's cut, the read
index: ~100 numpy calls and ~110 Python calls on the first call of a micro-batch). This probe builds the same packed
stream with one compiled call (numba, which vLLM installs) from the mask to this rank's read index — zigzag layout,
verl's default slot padding, rows whose tokens form one run, the rollouts' shape — then times, on a new rollout batch
every micro-batch, in one process per CP rank (``runtime.gloo_world``), each contender's first
``preprocess_packed_seqs`` call after its own postprocess (the state a training step leaves):

- ``verl``: verl's own function;
- ``drop-in``: verl_cppack's;
- ``straight-line numpy``: the same build as numpy calls in one function (no plan object, no cache, no checks but
  the rows' one-run check), then what ``compiled`` does after it: the least a host-built numpy plan can do;
- ``compiled``: the one compiled call, then the copies and a ``PackedSeqParams`` as verl fills it (no plan object,
  no cache, no checks);
- ``compiled + cache``: the same inside the drop-ins' plan cache (the copy of the mask it compares later) with the
  result attached to the ``PackedSeqParams``, the bookkeeping a drop-in cannot do without;
- ``copy alone``: the bench's preprocess floor for this call, its one ``index_select`` with the index given (built
  untimed): the second ratio printed, the copy's time over a contender's, is how much of a first call is the copy.

Before timing, every compiled and straight-line result is checked equal to the drop-in's (packed ids and padded offsets). Times are rank
0's medians in microseconds. Usage: ``python benchmarks/probe_compiled_plan.py [--batch-size 1] [--seq-len 8192]
[--cp 2] [--repeats 150]``. It prints a table and asserts nothing about speed (this is not a test).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from verl_cppack.bench.batches import micro_batch
from verl_cppack.bench.host_allocator import keep_freed_memory
from verl_cppack.bench.settings import parse_point
from verl_cppack.runtime.gloo_world import run_world

try:
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

CONTENDERS = ("verl", "drop-in", "straight-line numpy", "compiled", "compiled + cache", "copy alone")
WARMUP = 20


def _plan_kernel(mask, cp_size, cp_rank, slot_multiple):
    """mask [B, S] bool -> (every row one run of tokens, seqlens [B], cu_seqlens_padded [B+1] int32, this rank's read
    index [T/CP] int32, its positions without a token [Z] int64). Compiled by numba; plain Python runs it too."""
    rows, columns = mask.shape
    seqlens = np.zeros(rows, np.int64)
    first = np.zeros(rows, np.int64)
    one_run = True
    for row in range(rows):
        count, start, last = 0, -1, -1
        for column in range(columns):
            if mask[row, column]:
                if start < 0:
                    start = column
                last = column
                count += 1
        seqlens[row], first[row] = count, max(start, 0)
        one_run = one_run and (count == 0 or last - start + 1 == count)
    cu_padded = np.zeros(rows + 1, np.int32)
    for row in range(rows):
        cu_padded[row + 1] = cu_padded[row] + (seqlens[row] + slot_multiple - 1) // slot_multiple * slot_multiple
    local_length = cu_padded[rows] // cp_size
    index = np.empty(local_length, np.int32)
    zeros = np.empty(local_length, np.int64)
    num_zeros, position = 0, 0
    for row in range(rows):
        slot = cu_padded[row + 1] - cu_padded[row]
        chunk = slot // (2 * cp_size) if cp_size > 1 else slot
        for part in range(2 if cp_size > 1 else 1):
            chunk_id = cp_rank if part == 0 else 2 * cp_size - 1 - cp_rank
            for offset in range(chunk_id * chunk, (chunk_id + 1) * chunk):
                if offset < seqlens[row]:
                    index[position] = row * columns + first[row] + offset
                else:
                    index[position] = 0
                    zeros[num_zeros] = position
                    num_zeros += 1
                position += 1
    return one_run, seqlens, cu_padded, index, zeros[:num_zeros].copy()


def _straight_line_plan(mask, cp_size, cp_rank, slot_multiple):
    """``_plan_kernel``'s results from numpy calls in a straight line (no loop)."""
    rows, columns = mask.shape
    seqlens = mask.sum(axis=1)  # [B] int64
    first = mask.argmax(axis=1)
    last = (columns - 1) - mask[:, ::-1].argmax(axis=1)
    one_run = not ((last - first + 1 != seqlens) & (seqlens > 0)).any()
    slots = (seqlens + slot_multiple - 1) // slot_multiple * slot_multiple  # [B] padded lengths
    cu_padded = np.zeros(rows + 1, np.int64)
    np.cumsum(slots, out=cu_padded[1:])
    source = np.arange(rows) * columns + first  # [B] flat position of each row's first token
    if cp_size > 1:  # this rank's two zigzag chunks of every slot: runs [B, 2]
        chunk = slots // (2 * cp_size)
        offsets = np.stack([cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk], 1).reshape(-1)
        lengths, source = np.repeat(chunk, 2), np.repeat(source, 2) + offsets
        tokens = np.clip(np.repeat(seqlens, 2) - offsets, 0, lengths)  # [2B] real tokens of each run
    else:
        lengths, tokens = slots, seqlens
    starts = np.cumsum(lengths) - lengths
    index = np.repeat(source - starts, lengths) + np.arange(int(lengths.sum()))
    np.minimum(index, rows * columns - 1, out=index)  # padding reads an in-range row, zeroed after
    padding = lengths - tokens
    zeros = np.repeat(starts + tokens - (np.cumsum(padding) - padding), padding) + np.arange(int(padding.sum()))
    return one_run, seqlens, cu_padded.astype(np.int32), index, zeros


def _rank(rank: int, cp_size: int, settings: tuple[int, int, int]) -> dict[str, float]:
    batch_size, seq_len, repeats = settings
    keep_freed_memory()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from verl.models.mcore import util as verl_util

    from verl_cppack.integrations.megatron import megatron_context
    from verl_cppack.integrations.verl import dropins
    from verl_cppack.integrations.verl.plan_cache import TensorKeyedCache, attach_plan

    kernel = numba.njit(cache=True, nogil=True)(_plan_kernel)
    cache = TensorKeyedCache()

    def plan(attention_mask: torch.Tensor, build=kernel) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(longest sequence, cu_seqlens_padded [B+1] int32, read index [T/CP], zero positions or None)."""
        ctx = megatron_context()
        one_run, seqlens, cu_padded, index, zeros = build(
            attention_mask.numpy(), ctx.cp_size, ctx.cp_rank, ctx.default_slot_multiple
        )
        if not one_run:
            raise ValueError("the probe's kernel takes rows whose tokens form one run")
        zero_positions = torch.from_numpy(zeros) if zeros.size else None
        return int(seqlens.max()), torch.from_numpy(cu_padded), torch.from_numpy(index), zero_positions

    def apply(built, input_ids: torch.Tensor):
        longest, cu, index, zero_positions = built
        packed = input_ids.view(-1).index_select(0, index)
        if zero_positions is not None:
            packed.index_fill_(0, zero_positions, 0)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        return packed.unsqueeze(0), params

    def compiled(input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return apply(plan(attention_mask), input_ids)

    def straight_line(input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return apply(plan(attention_mask, _straight_line_plan), input_ids)

    def compiled_with_cache(input_ids: torch.Tensor, attention_mask: torch.Tensor):
        built, snapshot = cache.entry(attention_mask, "probe", lambda: plan(attention_mask))
        packed, params = apply(built, input_ids)
        return packed, attach_plan(params, built, snapshot)

    def copy_alone(input_ids: torch.Tensor, prepared):
        built, params = prepared  # made untimed: the index and what the postprocess needs
        return input_ids.view(-1).index_select(0, built[2]).unsqueeze(0), params

    calls = {
        "verl": (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs),
        "drop-in": (dropins.preprocess_packed_seqs, dropins.postprocess_packed_seqs),
        "straight-line numpy": (straight_line, verl_util.postprocess_packed_seqs),
        "compiled": (compiled, verl_util.postprocess_packed_seqs),
        "compiled + cache": (compiled_with_cache, verl_util.postprocess_packed_seqs),
        "copy alone": (copy_alone, verl_util.postprocess_packed_seqs),
    }
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    try:
        for step in range(WARMUP + repeats):
            if step < WARMUP:  # untimed: the compiled and straight-line builds must pack what the drop-in packs
                batch = micro_batch(batch_size, seq_len, seed=step)
                ours, our_params = dropins.preprocess_packed_seqs(batch.input_ids, batch.attention_mask)
                for build in (compiled, straight_line):
                    theirs, their_params = build(batch.input_ids, batch.attention_mask)
                    if not (
                        torch.equal(ours, theirs)
                        and torch.equal(our_params.cu_seqlens_q_padded, their_params.cu_seqlens_q_padded)
                    ):
                        raise AssertionError(f"{build.__name__} packs another stream than the drop-in (step {step})")
            for name in CONTENDERS[step % len(CONTENDERS) :] + CONTENDERS[: step % len(CONTENDERS)]:
                preprocess, postprocess = calls[name]
                batch = micro_batch(batch_size, seq_len, seed=step)  # new tensors for every contender
                given = batch.attention_mask
                if name == "copy alone":
                    built = plan(batch.attention_mask)
                    given = built, apply(built, batch.input_ids)[1]
                dist.barrier()
                start = time.perf_counter_ns()
                packed, params = preprocess(batch.input_ids, given)
                elapsed = time.perf_counter_ns() - start
                postprocess(packed.float(), params, batch.attention_mask, batch_size, seq_len)
                if step >= WARMUP:
                    times[name].append(elapsed / 1e3)
        return {name: statistics.median(values) for name, values in times.items()}
    finally:
        parallel_state.destroy_model_parallel()


def main() -> None:
    args = parse_point(__doc__.splitlines()[0], cp=2, repeats=150)
    if numba is None:
        print("error: this probe needs numba (pip install numba; vLLM installs it)", file=sys.stderr)
        sys.exit(2)
    medians = run_world(_rank, args.cp, (args.batch_size, args.seq_len, args.repeats), torch_threads=1)[0]
    print(
        f"B={args.batch_size} S={args.seq_len} CP={args.cp}: first preprocess call, median us "
        "(x: verl's / it; copy: copy alone / it)"
    )
    for name in CONTENDERS:
        medians_of = medians["verl"] / medians[name], medians["copy alone"] / medians[name]
        print(f"  {name:<19} {medians[name]:8.1f}  x{medians_of[0]:.2f}  copy {medians_of[1]:.0%}")


if __name__ == "__main__":
    main()
