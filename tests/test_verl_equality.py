"""The drop-ins equal verl 0.9.1's own util functions, run side by side in real gloo processes.

Megatron's ``parallel_state.initialize_model_parallel`` works on CPU under gloo unchanged (no tweak needed
with megatron-core 0.16.1): initialise torch.distributed with the gloo backend, then call it.

Each world runs one worker that checks every path (padded THD, padded BSHD, nested THD, nested BSHD) on a
random rollout-shaped batch (left-padded prompts, right-padded responses, some 1-3 token sequences) and on
the tensors verl sends through them: token ids, labels, bool label masks, ``[B,S,3]`` position ids,
``[B,S,L,k]`` uint8 router indices, ``[B,S,H]`` bf16 embeddings. The gather-back is compared in values,
dtype and the local gradient. Differences are collected as strings so one run reports all of them.

The intended differences (docs/design.md, "Intended differences") are left out of the comparison: ``need_roll``
labels are compared at every position whose target is not the wrapped one, position ids at real tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_gloo

H = 4  # hidden size of embeddings / outputs
LAYERS, TOPK = 2, 3  # router replay indices [.., L, k]


def rollout_mask(generator: torch.Generator, batch: int, prompt: int, response: int) -> torch.Tensor:
    """[B, P+R] bool: left-padded prompts then right-padded responses; a few rows are 1-3 tokens long."""
    prompt_lengths = torch.randint(1, prompt + 1, (batch,), generator=generator)
    response_lengths = torch.randint(0, response + 1, (batch,), generator=generator)
    short = torch.rand(batch, generator=generator) < 0.3
    prompt_lengths = torch.where(short, 1, prompt_lengths)
    response_lengths = torch.where(short, torch.randint(0, 3, (batch,), generator=generator), response_lengths)
    columns = torch.arange(prompt + response)
    in_prompt = (columns < prompt) & (columns >= prompt - prompt_lengths.unsqueeze(1))
    in_response = (columns >= prompt) & (columns < prompt + response_lengths.unsqueeze(1))
    return in_prompt | in_response


def batch_tensors(seed: int, batch: int = 7, prompt: int = 6, response: int = 9) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = rollout_mask(generator, batch, prompt, response)
    shape = mask.shape
    input_ids = torch.randint(1, 1000, shape, generator=generator)
    return {
        "mask": mask,
        "input_ids": input_ids,
        "label": torch.roll(input_ids, -1, 1),
        "label_mask": torch.rand(shape, generator=generator) < 0.7,
        "position_ids3": torch.randint(0, 50, (*shape, 3), generator=generator),
        "router": torch.randint(0, 255, (*shape, LAYERS, TOPK), generator=generator, dtype=torch.uint8),
        "embeddings": torch.randn((*shape, H), generator=generator).to(torch.bfloat16),
    }


def to_nested(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The real tokens of every row as a jagged nested tensor [B, j, *] (verl's no-padding batches)."""
    return torch.nested.nested_tensor([row[keep] for row, keep in zip(x, mask)], layout=torch.jagged)


def last_token_mask(nested: torch.Tensor) -> torch.Tensor:
    """[N] bool: True at the last token of each sequence of a nested tensor."""
    ends = nested.offsets()[1:] - 1
    out = torch.zeros(nested.values().shape[0], dtype=torch.bool)
    out[ends[ends >= 0]] = True
    return out


def leaf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf copy of ``x`` that collects its own gradient (stands for a model output)."""
    return x.detach().to(dtype).clone().requires_grad_(True)


class Report:
    def __init__(self, prefix: str) -> None:
        self.prefix, self.failures, self.checks = prefix, [], 0

    def equal(self, name: str, ours, theirs, required: bool = False) -> None:
        """Record a failure unless equal (tensors: dtype, shape and every value). ``required``: None fails."""
        self.checks += 1
        if ours is None or theirs is None:
            if required or (ours is None) != (theirs is None):
                self.failures.append(f"{self.prefix} {name}: got None (ours {ours is None}, verl {theirs is None})")
            return
        if isinstance(ours, torch.Tensor) and ours.is_nested:
            ours_parts, theirs_parts = ours.unbind(), theirs.unbind()
            if len(ours_parts) != len(theirs_parts):
                self.failures.append(f"{self.prefix} {name}: {len(ours_parts)} vs {len(theirs_parts)} sequences")
                return
            for i, (a, b) in enumerate(zip(ours_parts, theirs_parts)):
                self.equal(f"{name}[{i}]", a, b)
            self.checks -= len(ours_parts)
            return
        if isinstance(ours, torch.Tensor):
            ok = ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
            if not ok:
                self.failures.append(
                    f"{self.prefix} {name}: ours {ours.dtype}{tuple(ours.shape)} vs verl {theirs.dtype}{tuple(theirs.shape)}"
                    + (
                        ""
                        if ours.shape != theirs.shape
                        else f" max diff {(ours.double() - theirs.double()).abs().max()}"
                    )
                )
        elif ours != theirs:
            self.failures.append(f"{self.prefix} {name}: ours {ours!r} vs verl {theirs!r}")


PSP_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "local_cp_size",
    "cp_group",
)


def compare_params(report: Report, name: str, ours, theirs) -> None:
    for field in PSP_FIELDS:
        report.equal(f"{name}.{field}", getattr(ours, field), getattr(theirs, field))


def _legacy_thd(report, ours, verl, data, cp_rank, seed):
    mask = data["mask"]
    batch, seq_len = mask.shape
    for fp8 in (False, True):
        for key in ("input_ids", "label", "label_mask", "position_ids3", "router", "embeddings"):
            mine = ours.preprocess_packed_seqs(data[key], mask, pre_process=True, use_fp8_padding=fp8)
            theirs = verl.preprocess_packed_seqs(data[key], mask, pre_process=True, use_fp8_padding=fp8)
            report.equal(f"preprocess_packed_seqs[{key}, fp8={fp8}]", mine[0], theirs[0])
            compare_params(report, f"psp[{key}, fp8={fp8}]", mine[1], theirs[1])
        _, psp_mine = ours.preprocess_packed_seqs(data["input_ids"], mask, use_fp8_padding=fp8)
        _, psp_theirs = verl.preprocess_packed_seqs(data["input_ids"], mask, use_fp8_padding=fp8)
        generator = torch.Generator().manual_seed(seed + 100 + cp_rank)
        local = torch.randn((1, psp_mine.cu_seqlens_q_padded[-1].item() // report.cp_size, H), generator=generator)
        weights = torch.randn((batch, seq_len, H), generator=torch.Generator().manual_seed(seed + 7))
        for dtype in (torch.float32, torch.bfloat16):
            y_mine, y_theirs = leaf(local, dtype), leaf(local, dtype)
            full_mine = ours.postprocess_packed_seqs(y_mine, psp_mine, mask, batch, seq_len)
            full_theirs = verl.postprocess_packed_seqs(y_theirs, psp_theirs, mask, batch, seq_len)
            report.equal(f"postprocess_packed_seqs[{dtype}, fp8={fp8}]", full_mine, full_theirs)
            (full_mine.float() * weights).sum().backward()
            (full_theirs.float() * weights).sum().backward()
            report.equal(f"postprocess_packed_seqs grad[{dtype}, fp8={fp8}]", y_mine.grad, y_theirs.grad, required=True)
        # not post_process: returned untouched
        report.equal(
            "postprocess_packed_seqs(post_process=False)",
            ours.postprocess_packed_seqs(local, psp_mine, mask, batch, seq_len, post_process=False) is local,
            True,
        )
    # pre_process=False returns input_ids itself
    report.equal(
        "preprocess_packed_seqs(pre_process=False)",
        ours.preprocess_packed_seqs(data["input_ids"], mask, pre_process=False)[0] is data["input_ids"],
        True,
    )


def _fused_dict(report, ours, verl, data, cp_rank, seed):
    from verl.utils.model import CausalLMOutputForPPO

    mask = data["mask"]
    batch, seq_len = mask.shape
    labels_mask_mine, psp_mine = ours.preprocess_packed_seqs(data["label_mask"], mask)
    labels_mask_theirs, psp_theirs = verl.preprocess_packed_seqs(data["label_mask"], mask)
    local_length = labels_mask_mine.shape[1]
    generator = torch.Generator().manual_seed(seed + 200 + cp_rank)
    entropy, log_probs = torch.rand(local_length, generator=generator), -torch.rand(local_length, generator=generator)
    mine = ours.postprocess_packed_seqs_for_dict_output(
        labels_mask_mine,
        CausalLMOutputForPPO(log_probs=log_probs.clone(), entropy=entropy.clone()),
        psp_mine,
        mask,
        batch,
        seq_len,
    )
    theirs = verl.postprocess_packed_seqs_for_dict_output(
        labels_mask_theirs,
        CausalLMOutputForPPO(log_probs=log_probs.clone(), entropy=entropy.clone()),
        psp_theirs,
        mask,
        batch,
        seq_len,
    )
    for key in ("entropy", "log_probs"):
        report.equal(f"postprocess_packed_seqs_for_dict_output[{key}]", mine[key], theirs[key])


def _legacy_bshd(report, ours, verl, data):
    mask = data["mask"]
    positions = torch.cumsum(mask.long(), 1) - 1
    for sequence_parallel in (False, True):
        for key in ("input_ids", "router", "embeddings"):
            mine = ours.preprocess_bshd(data[key], mask, positions, sequence_parallel=sequence_parallel)
            theirs = verl.preprocess_bshd(data[key], mask, positions, sequence_parallel=sequence_parallel)
            for name, a, b in zip(("input_ids", "attention_mask", "position_ids"), mine, theirs):
                report.equal(f"preprocess_bshd[{key}, sp={sequence_parallel}].{name}", a, b)
        new_ids, new_mask, _ = ours.preprocess_bshd(data["input_ids"], mask, positions, sequence_parallel)
        _, new_mask_theirs, _ = verl.preprocess_bshd(data["input_ids"], mask, positions, sequence_parallel)
        result = torch.randn((*new_mask.shape, H), generator=torch.Generator().manual_seed(3))
        y_mine, y_theirs = leaf(result, result.dtype), leaf(result, result.dtype)
        back_mine = ours.postprocess_bshd(y_mine, new_mask, mask, mask.shape[1])
        back_theirs = verl.postprocess_bshd(y_theirs, new_mask_theirs, mask, mask.shape[1])
        report.equal(f"postprocess_bshd[sp={sequence_parallel}]", back_mine, back_theirs)
        back_mine.sum().backward()
        back_theirs.sum().backward()
        report.equal(f"postprocess_bshd grad[sp={sequence_parallel}]", y_mine.grad, y_theirs.grad, required=True)
        # a mask we did not make (verl's) goes through the general path
        report.equal(
            "postprocess_bshd[foreign mask]",
            ours.postprocess_bshd(result, new_mask_theirs, mask, mask.shape[1]),
            verl.postprocess_bshd(result, new_mask_theirs, mask, mask.shape[1]),
        )


def _engine_thd(report, ours, verl, data, cp_rank, seed, options):
    mask = data["mask"]
    keys = ("input_ids", "label", "label_mask", "position_ids3", "router", "embeddings")
    nested = {key: to_nested(data[key], mask) for key in keys}
    last = last_token_mask(nested["input_ids"])
    for option in options:
        tag = ",".join(f"{k}={v}" for k, v in option.items())
        for key, x in nested.items():
            mine = ours.preprocess_thd_engine(x, pre_process=True, **option)
            theirs = verl.preprocess_thd_engine(x, pre_process=True, **option)
            report.equal(f"preprocess_thd_engine[{key}; {tag}]", mine[0], theirs[0])
            compare_params(report, f"thd psp[{key}; {tag}]", mine[1], theirs[1])
            if key == "input_ids":  # position ids: equal at real tokens
                real = mine[0] != 0  # ids are >= 1 at real tokens, 0 at padding
                report.equal(f"position_ids[{tag}] at real tokens", mine[2][real], theirs[2][real])
        # need_roll: equal everywhere except at the last real token of each sequence
        for key in ("label", "label_mask"):
            x = nested[key]
            marker = torch.nested.nested_tensor_from_jagged(~last, offsets=x.offsets())
            target_is_not_wrapped = ours.preprocess_thd_engine(marker, **option)[0]  # [1, T_local]
            mine = ours.preprocess_thd_engine(x, need_roll=True, **option)[0]
            theirs = verl.preprocess_thd_engine(x, need_roll=True, **option)[0]
            keep = target_is_not_wrapped[0]
            report.equal(f"preprocess_thd_engine need_roll[{key}; {tag}]", mine[0][keep], theirs[0][keep])
        # gather-back
        _, psp_mine, _ = ours.preprocess_thd_engine(nested["input_ids"], **option)
        _, psp_theirs, _ = verl.preprocess_thd_engine(nested["input_ids"], **option)
        local_length = psp_mine.cu_seqlens_q_padded[-1].item() // report.cp_size
        local = torch.randn((1, local_length, H), generator=torch.Generator().manual_seed(seed + 300 + cp_rank))
        for dtype in (torch.float32, torch.bfloat16):
            y_mine, y_theirs = leaf(local, dtype), leaf(local, dtype)
            out_mine = ours.postprocess_thd_engine(
                y_mine, psp_mine, nested["input_ids"], mask.shape[0], **_post(option)
            )
            out_theirs = verl.postprocess_thd_engine(
                y_theirs, psp_theirs, nested["input_ids"], mask.shape[0], **_post(option)
            )
            report.equal(f"postprocess_thd_engine[{dtype}; {tag}]", out_mine, out_theirs)
            weights = torch.randn(out_mine.values().shape, generator=torch.Generator().manual_seed(seed + 8))
            (out_mine.values().float() * weights).sum().backward()
            (out_theirs.values().float() * weights).sum().backward()
            report.equal(f"postprocess_thd_engine grad[{dtype}; {tag}]", y_mine.grad, y_theirs.grad, required=True)


def _post(option: dict) -> dict:
    return {k: v for k, v in option.items() if k in ("local_cp_size", "cp_layout")}


def _engine_bshd(report, ours, verl, data, cp_rank, seed):
    mask = data["mask"]
    nested = {
        key: to_nested(data[key], mask) for key in ("input_ids", "label", "position_ids3", "router", "embeddings")
    }
    last = last_token_mask(nested["input_ids"])
    for option in ({}, {"use_fp8_padding": True}, {"forced_max_seqlen": mask.shape[1] + 3}):
        tag = ",".join(f"{k}={v}" for k, v in option.items())
        for key, x in nested.items():
            mine = ours.preprocess_bshd_engine(x, **option)
            theirs = verl.preprocess_bshd_engine(x, **option)
            for name, a, b in zip(("input_ids", "attention_mask", "position_ids"), mine, theirs):
                report.equal(f"preprocess_bshd_engine[{key}; {tag}].{name}", a, b)
        marker = torch.nested.nested_tensor_from_jagged(~last, offsets=nested["label"].offsets())
        keep = ours.preprocess_bshd_engine(marker, **option)[0]
        mine = ours.preprocess_bshd_engine(nested["label"], need_roll=True, **option)[0]
        theirs = verl.preprocess_bshd_engine(nested["label"], need_roll=True, **option)[0]
        report.equal(f"preprocess_bshd_engine need_roll[{tag}]", mine[keep], theirs[keep])
        _, mask_mine, _ = ours.preprocess_bshd_engine(nested["input_ids"], **option)
        _, mask_theirs, _ = verl.preprocess_bshd_engine(nested["input_ids"], **option)
        local = torch.randn((*mask_mine.shape, H), generator=torch.Generator().manual_seed(seed + 400 + cp_rank))
        for dtype in (torch.float32, torch.bfloat16):
            y_mine, y_theirs = leaf(local, dtype), leaf(local, dtype)
            out_mine = ours.postprocess_bshd_engine(y_mine, mask_mine)
            out_theirs = verl.postprocess_bshd_engine(y_theirs, mask_theirs)
            report.equal(f"postprocess_bshd_engine[{dtype}; {tag}]", out_mine, out_theirs)
            weights = torch.randn(out_mine.values().shape, generator=torch.Generator().manual_seed(seed + 9))
            (out_mine.values().float() * weights).sum().backward()
            (out_theirs.values().float() * weights).sum().backward()
            report.equal(f"postprocess_bshd_engine grad[{dtype}; {tag}]", y_mine.grad, y_theirs.grad, required=True)
        # verl's own mask (not made by us) goes through the rebuild path
        report.equal(
            f"postprocess_bshd_engine[foreign mask; {tag}]",
            ours.postprocess_bshd_engine(local, mask_theirs),
            verl.postprocess_bshd_engine(local, mask_theirs),
        )


def equality_checks(tp_size: int, cp_size: int, cp_rank: int, seeds: tuple[int, ...]) -> tuple[int, list[str]]:
    """Every drop-in against verl's own function, inside an initialised megatron parallel state."""
    import verl.models.mcore.util as verl_util

    from verl_cppack.integrations import verl as ours

    checks, failures = 0, []
    engine_options = [{}, {"use_fp8_padding": True}, {"min_local_rows": 40}, {"pad_to_length_bucket": 64}]
    if cp_size == 1:
        engine_options.append({"cp_layout": "contiguous"})
    for seed in seeds:
        data = batch_tensors(seed)
        report = Report(f"tp={tp_size} cp={cp_size} rank={cp_rank} seed={seed}")
        report.cp_size = cp_size
        _legacy_thd(report, ours, verl_util, data, cp_rank, seed)
        _fused_dict(report, ours, verl_util, data, cp_rank, seed)
        _engine_thd(report, ours, verl_util, data, cp_rank, seed, engine_options)
        _engine_bshd(report, ours, verl_util, data, cp_rank, seed)
        if cp_size == 1:
            _legacy_bshd(report, ours, verl_util, data)
        checks += report.checks
        failures += report.failures
    return checks, failures


def world_worker(rank: int, world_size: int, tp_size: int, seeds: tuple[int, ...]) -> dict:
    """One gloo world runs every check of the verl test files (process start and imports dominate the cost)."""
    from megatron.core import parallel_state as mpu

    from tests import test_verl_cost, test_verl_fixes, test_verl_patching

    cp_size = world_size // tp_size
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size, context_parallel_size=cp_size)
    try:
        cp_rank = mpu.get_context_parallel_rank()
        results = {"equality": equality_checks(tp_size, cp_size, cp_rank, seeds)}
        results["op_counts"] = test_verl_cost.op_count_checks()
        if tp_size == 1:
            results["fixes"] = test_verl_fixes.fixes_checks(cp_size, cp_rank)
        if tp_size == 1 and cp_size <= 2:  # last: it installs and uninstalls the patch
            results["patching"] = test_verl_patching.patch_checks()
        return results
    finally:
        mpu.destroy_model_parallel()


WORLDS = {"cp1": (1, 1, (0, 1)), "cp2": (2, 1, (0, 1)), "cp4": (4, 1, (2,)), "tp2-cp2": (4, 2, (3,))}


@functools.cache
def world(name: str) -> list[dict]:
    """Per-rank results of ``world_worker`` for one of ``WORLDS`` (run once per pytest session)."""
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")
    world_size, tp_size, seeds = WORLDS[name]
    return run_gloo(world_worker, world_size, tp_size, seeds)


@pytest.mark.slow  # gloo worlds with verl and Megatron imported in every rank
@pytest.mark.stacks
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow, pytest.mark.stacks] if name in ("cp4", "tp2-cp2") else [])
        for name in WORLDS
    ],
)
def test_dropins_equal_verl_util(name):
    results = world(name)
    failures = [failure for result in results for failure in result["equality"][1]]
    assert all(result["equality"][0] > 300 for result in results), [result["equality"][0] for result in results]
    assert not failures, "\n".join(failures[:40])
