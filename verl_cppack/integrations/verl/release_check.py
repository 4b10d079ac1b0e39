"""Every packing function of one verl release side by side with the drop-ins the plugin picks for it, on random
batches, in one process (a rank of an initialised megatron parallel state).

``compare_release`` runs each of verl's functions and ours on the same random batch (padding anywhere: left, right,
middle, gaps; 1-token and empty sequences) with every option the release takes, then the gather-backs and their
local gradients, and records *where* they differ (``compare.Finding``; the keys are those of ``compare``). The
release matrix (``tests/test_verl_release_matrix.py``) holds every tested release to the intended differences
with it; ``verl-cppack doctor --verify`` runs it at CP=1 on the installed verl (``verification.self_check``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.integrations.verl.compare import (
    Comparison,
    Finding,
    accepts,
    last_token_marker,
    ones_like_nested,
)

H = 4  # hidden size of embeddings / outputs


# ------------------------------------------------------------------------------------------------ batches
def random_batch(seed: int, shortest: int = 1, batch: int = 6, seq_len: int = 14) -> dict[str, torch.Tensor]:
    """A padded batch ``[B, S]`` whose rows hold ``shortest``..S real tokens anywhere (left, right, middle padding,
    gaps; about a third of them 3 tokens or fewer), and the tensors verl packs with it: ids, labels, a bool label
    mask, ``[B,S,3]`` positions, ``[B,S,2,3]`` uint8 router indices, ``[B,S,H]`` bf16 embeddings."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, seq_len + 1, (batch,), generator=generator)
    short = torch.randint(shortest, max(shortest, 3) + 1, (batch,), generator=generator)
    lengths = torch.where(torch.rand(batch, generator=generator) < 0.3, short, lengths)
    scores = torch.rand(batch, seq_len, generator=generator)  # a row's real tokens: its `length` highest scores
    gapped = torch.rand(batch, generator=generator) < 0.5  # the other rows: one run, placed anywhere
    starts = (torch.rand(batch, generator=generator) * (seq_len - lengths + 1)).long()
    columns = torch.arange(seq_len)
    run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    ranks = scores.argsort(dim=1, descending=True).argsort(dim=1)
    mask = torch.where(gapped[:, None], ranks < lengths[:, None], run)
    shape = mask.shape
    ids = torch.randint(1, 1000, shape, generator=generator)
    return {
        "mask": mask,
        "input_ids": ids,
        "label": torch.roll(ids, -1, 1),
        "label_mask": torch.rand(shape, generator=generator) < 0.7,
        "position_ids3": torch.randint(0, 50, (*shape, 3), generator=generator),
        "router": torch.randint(0, 255, (*shape, 2, 3), generator=generator, dtype=torch.uint8),
        "embeddings": torch.randn((*shape, H), generator=generator).to(torch.bfloat16),
    }


def to_nested(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor([row[keep] for row, keep in zip(x, mask)], layout=torch.jagged)


def _first(x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` without its trailing dimensions beyond the first ``dims`` (their first entry), nested or not."""
    if x.is_nested:
        values = x.values()
        while values.dim() > dims - 1:
            values = values[..., 0]
        return torch.nested.nested_tensor_from_jagged(values.contiguous(), offsets=x.offsets())
    while x.dim() > dims:
        x = x[..., 0]
    return x.contiguous()


def leaf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.detach().to(dtype).clone().requires_grad_(True)


# ------------------------------------------------------------------------------------------------ comparing
class SideBySide(Comparison):
    """A ``Comparison`` that runs both functions itself, every rank of the world skipping together."""

    def run(
        self,
        function: str,
        case: str,
        verl_call: Callable[[], Any],
        our_call: Callable[[], Any],
        **variants: Callable[[], Any] | None,
    ) -> tuple[Any, Any] | None:
        """Both results, or None after recording which side raised (both raising is agreement: bad input). Every
        rank of the world gets None when a call raised on any rank, so all skip what follows together (a
        gather-back on one rank only would wait for the others forever). ``variants``: verl's call without one
        feature of the case (``trailing_dims``: the tensor without its trailing dimensions; ``dtype``: a float32
        output; ``option``: without the padding option); where verl fails and succeeds without the feature, the
        finding names it (``verl-raised-trailing_dims``, ...)."""
        where = "verl-raised"
        try:
            theirs = verl_call()
        except Exception as error:  # noqa: BLE001 - verl's failures are findings
            theirs = error
            for feature, variant in variants.items():
                if variant is None:
                    continue
                try:
                    variant()
                except Exception:  # noqa: BLE001 - fails without the feature too: not this feature
                    continue
                where = f"verl-raised-{feature}"
                break
        try:
            ours = our_call()
        except Exception as error:  # noqa: BLE001
            ours = error
        raised = torch.tensor([isinstance(theirs, Exception), isinstance(ours, Exception)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(raised, op=dist.ReduceOp.MAX)
        if raised.any() and not isinstance(theirs, Exception) and not isinstance(ours, Exception):
            return None  # another rank raised
        if isinstance(theirs, Exception) and isinstance(ours, Exception):
            return None
        if isinstance(theirs, Exception):
            self.findings.append(Finding(function, case, where, f"{type(theirs).__name__}: {str(theirs)[:160]}"))
            return None
        if isinstance(ours, Exception):
            self.findings.append(Finding(function, case, "ours-raised", f"{type(ours).__name__}: {str(ours)[:300]}"))
            return None
        self.count(function)
        return theirs, ours


# ------------------------------------------------------------------------------------------------ procedures
def legacy_thd(
    c: SideBySide,
    name_pre: str,
    name_post: str,
    verl: Any,
    ours: dict[str, Callable],
    data: dict,
    cp_size: int,
    cp_rank: int,
    seed: int,
) -> None:
    """``preprocess_packed_seqs`` / ``postprocess_packed_seqs`` (padded ``[B, S]`` batches)."""
    mask, (batch, seq_len) = data["mask"], data["mask"].shape
    verl_pre, our_pre, verl_post, our_post = (
        getattr(verl, name_pre),
        ours[name_pre],
        getattr(verl, name_post),
        ours[name_post],
    )
    for fp8 in (False, True) if accepts(verl_pre, "use_fp8_padding") else (False,):
        options = {"use_fp8_padding": True} if fp8 else {}
        tag = f"fp8={fp8}"
        for key in ("input_ids", "label_mask", "position_ids3", "router", "embeddings"):
            pair = c.run(
                name_pre,
                f"{tag} {key}",
                lambda: verl_pre(data[key], mask, True, **options),
                lambda: our_pre(data[key], mask, True, **options),
                trailing_dims=lambda: verl_pre(_first(data[key], 2), mask, True, **options),
                option=(lambda: verl_pre(data[key], mask, True)) if options else None,
            )
            if pair is not None:
                c.tensors(name_pre, f"{tag} {key}", pair[0][0], pair[1][0])
                c.params(name_pre, f"{tag} {key}", pair[0][1], pair[1][1])
        pair = c.run(
            name_pre,
            f"{tag} params",
            lambda: verl_pre(data["input_ids"], mask, **options),
            lambda: our_pre(data["input_ids"], mask, **options),
            option=(lambda: verl_pre(data["input_ids"], mask)) if options else None,
        )
        if pair is None:
            continue
        (_, psp_verl), (_, psp_ours) = pair
        local = torch.randn(
            (1, int(psp_verl.cu_seqlens_q_padded[-1]) // cp_size, H),
            generator=torch.Generator().manual_seed(seed * 10 + cp_rank),
        )
        weights = torch.randn((batch, seq_len, H), generator=torch.Generator().manual_seed(seed))
        for dtype in (torch.float32, torch.bfloat16):
            y_verl, y_ours = leaf(local, dtype), leaf(local, dtype)
            case = f"{tag} {dtype}"
            pair = c.run(
                name_post,
                case,
                lambda: verl_post(y_verl, psp_verl, mask, batch, seq_len),
                lambda: our_post(y_ours, psp_ours, mask, batch, seq_len),
                dtype=lambda: verl_post(local.clone(), psp_verl, mask, batch, seq_len),
            )
            if pair is None:
                continue
            c.tensors(name_post, case, *pair)
            (pair[0].float() * weights).sum().backward()
            (pair[1].float() * weights).sum().backward()
            c.tensors(name_post, case, y_verl.grad, y_ours.grad, prefix="grad:")


def dict_output(c: SideBySide, verl: Any, ours: dict[str, Callable], data: dict, cp_rank: int, seed: int) -> None:
    from verl.utils.model import CausalLMOutputForPPO

    name = "postprocess_packed_seqs_for_dict_output"
    mask, (batch, seq_len) = data["mask"], data["mask"].shape
    pair = c.run(
        name,
        "pack",
        lambda: verl.preprocess_packed_seqs(data["label_mask"], mask),
        lambda: ours["preprocess_packed_seqs"](data["label_mask"], mask),
    )
    if pair is None:
        return
    (labels_verl, psp_verl), (labels_ours, psp_ours) = pair
    generator = torch.Generator().manual_seed(seed * 10 + 3 + cp_rank)
    entropy, log_probs = (
        torch.rand(labels_verl.shape[1], generator=generator),
        -torch.rand(labels_verl.shape[1], generator=generator),
    )

    def output():
        return CausalLMOutputForPPO(log_probs=log_probs.clone(), entropy=entropy.clone())

    pair = c.run(
        name,
        "dict",
        lambda: getattr(verl, name)(labels_verl, output(), psp_verl, mask, batch, seq_len),
        lambda: ours[name](labels_ours, output(), psp_ours, mask, batch, seq_len),
    )
    if pair is not None:
        for key in ("entropy", "log_probs"):
            c.tensors(name, key, pair[0][key], pair[1][key])


def legacy_bshd(c: SideBySide, name_pre: str, name_post: str, verl: Any, ours: dict[str, Callable], data: dict) -> None:
    """``preprocess_bshd`` / ``postprocess_bshd`` (0.6: ``remove_left_padding`` / ``recover_left_padding``)."""
    mask = data["mask"]
    positions = torch.cumsum(mask.long(), 1) - 1
    verl_pre, our_pre, verl_post, our_post = (
        getattr(verl, name_pre),
        ours[name_pre],
        getattr(verl, name_post),
        ours[name_post],
    )
    for sequence_parallel in (False, True):
        for key in ("input_ids", "router", "embeddings"):
            case = f"sp={sequence_parallel} {key}"
            pair = c.run(
                name_pre,
                case,
                lambda: verl_pre(data[key], mask, positions, sequence_parallel),
                lambda: our_pre(data[key], mask, positions, sequence_parallel),
                trailing_dims=lambda: verl_pre(_first(data[key], 2), mask, positions, sequence_parallel),
            )
            if pair is not None:
                for index, part in enumerate(("input_ids", "attention_mask", "position_ids")):
                    c.tensors(name_pre, case, pair[0][index], pair[1][index], prefix=f"{part}:")
        pair = c.run(
            name_pre,
            f"sp={sequence_parallel}",
            lambda: verl_pre(data["input_ids"], mask, positions, sequence_parallel),
            lambda: our_pre(data["input_ids"], mask, positions, sequence_parallel),
        )
        if pair is None:
            continue
        mask_verl, mask_ours = pair[0][1], pair[1][1]
        result = torch.randn((*mask_verl.shape, H), generator=torch.Generator().manual_seed(3))
        y_verl, y_ours = leaf(result, torch.float32), leaf(result, torch.float32)
        pair = c.run(
            name_post,
            f"sp={sequence_parallel}",
            lambda: verl_post(y_verl, mask_verl, mask, mask.shape[1]),
            lambda: our_post(y_ours, mask_ours, mask, mask.shape[1]),
        )
        if pair is not None:
            c.tensors(name_post, f"sp={sequence_parallel}", *pair)
            pair[0].sum().backward()
            pair[1].sum().backward()
            c.tensors(name_post, f"sp={sequence_parallel}", y_verl.grad, y_ours.grad, prefix="grad:")


def _thd_options(verl_pre: Callable, cp_size: int) -> list[dict]:
    options = [{}]
    if accepts(verl_pre, "use_fp8_padding"):
        options.append({"use_fp8_padding": True})
    if accepts(verl_pre, "min_local_rows"):
        options.append({"min_local_rows": 40})
    if accepts(verl_pre, "pad_to_length_bucket"):
        options.append({"pad_to_length_bucket": 64})
    if accepts(verl_pre, "cp_layout") and cp_size == 1:
        options.append({"cp_layout": "contiguous"})
    return options


def engine_thd(
    c: SideBySide,
    name_pre: str,
    name_post: str,
    verl: Any,
    ours: dict[str, Callable],
    data: dict,
    cp_size: int,
    cp_rank: int,
    seed: int,
) -> None:
    """The nested THD pair of every release: 0.6 ``*_packed_seqs_no_padding``, 0.7 ``*_thd_no_padding``, 0.8+
    ``*_thd_engine``."""
    mask = data["mask"]
    verl_pre, our_pre, verl_post, our_post = (
        getattr(verl, name_pre),
        ours[name_pre],
        getattr(verl, name_post),
        ours[name_post],
    )
    nested = {
        key: to_nested(data[key], mask)
        for key in ("input_ids", "label", "label_mask", "position_ids3", "router", "embeddings")
    }
    ids = nested["input_ids"]
    rolls = accepts(verl_pre, "need_roll")
    for option in _thd_options(verl_pre, cp_size):
        tag = ",".join(f"{k}={v}" for k, v in option.items()) or "default"
        marker = c.run(
            name_pre,
            f"{tag} marker",
            lambda: verl_pre(ones_like_nested(ids), **option),
            lambda: our_pre(ones_like_nested(ids), **option),
            option=(lambda: verl_pre(ones_like_nested(ids))) if option else None,
        )
        if marker is None:
            continue
        real = marker[0][0][0] == 1  # [T_local] verl's packing of ones: real tokens
        for key, x in nested.items():
            pair = c.run(
                name_pre,
                f"{tag} {key}",
                lambda: verl_pre(x, **option),
                lambda: our_pre(x, **option),
                trailing_dims=lambda: verl_pre(_first(x, 2), **option),
                option=(lambda: verl_pre(x)) if option else None,
            )
            if pair is None:
                continue
            c.tensors(name_pre, f"{tag} {key}", pair[0][0], pair[1][0])
            c.params(name_pre, f"{tag} {key}", pair[0][1], pair[1][1])
            if len(pair[0]) > 2 and key in ("input_ids", "embeddings"):  # position ids
                regions = {"positions-real": real[None], "positions-padding": ~real[None]}
                c.tensors(name_pre, f"{tag} {key}", pair[0][2], pair[1][2], regions=regions, prefix="positions:")
        if rolls:
            last = c.run(
                name_pre,
                f"{tag} last marker",
                lambda: verl_pre(last_token_marker(ids), **option),
                lambda: our_pre(last_token_marker(ids), **option),
            )
            if last is None:
                continue
            last_token = last[0][0][0] == 1
            regions = {"roll-last-token": last_token, "roll-padding": ~real}
            for key in ("label", "label_mask", "embeddings"):
                pair = c.run(
                    name_pre,
                    f"{tag} need_roll {key}",
                    lambda: verl_pre(nested[key], need_roll=True, **option),
                    lambda: our_pre(nested[key], need_roll=True, **option),
                    trailing_dims=lambda: verl_pre(_first(nested[key], 2), need_roll=True, **option),
                    option=(lambda: verl_pre(nested[key], need_roll=True)) if option else None,
                )
                if pair is None:
                    continue
                c.tensors(name_pre, f"{tag} need_roll {key}", pair[0][0][0], pair[1][0][0], regions=regions)
                if len(pair[0]) > 2:
                    differs = not torch.equal(pair[0][2], pair[1][2])
                    if differs:
                        c.findings.append(Finding(name_pre, f"{tag} need_roll {key}", "positions-roll"))
        pair = c.run(name_pre, f"{tag} params", lambda: verl_pre(ids, **option), lambda: our_pre(ids, **option))
        if pair is None:
            continue
        psp_verl, psp_ours = pair[0][1], pair[1][1]
        post_options = {k: v for k, v in option.items() if k in ("local_cp_size", "cp_layout")}
        local = torch.randn(
            (1, int(psp_verl.cu_seqlens_q_padded[-1]) // cp_size, H),
            generator=torch.Generator().manual_seed(seed * 10 + 5 + cp_rank),
        )
        for dtype in (torch.float32, torch.bfloat16):
            y_verl, y_ours = leaf(local, dtype), leaf(local, dtype)
            case = f"{tag} {dtype}"
            pair = c.run(
                name_post,
                case,
                lambda: verl_post(y_verl, psp_verl, ids, ids.size(0), **post_options),
                lambda: our_post(y_ours, psp_ours, ids, ids.size(0), **post_options),
                dtype=lambda: verl_post(local.clone(), psp_verl, ids, ids.size(0), **post_options),
            )
            if pair is None:
                continue
            c.tensors(name_post, case, *pair)
            weights = torch.randn(pair[1].values().shape, generator=torch.Generator().manual_seed(seed))
            (pair[0].values().float() * weights).sum().backward()
            (pair[1].values().float() * weights).sum().backward()
            c.tensors(name_post, case, y_verl.grad, y_ours.grad, prefix="grad:")


def engine_bshd(
    c: SideBySide,
    name_pre: str,
    name_post: str,
    verl: Any,
    ours: dict[str, Callable],
    data: dict,
    cp_rank: int,
    seed: int,
) -> None:
    """The nested BSHD pair: 0.7 ``*_bshd_no_padding``, 0.8+ ``*_bshd_engine``."""
    mask = data["mask"]
    verl_pre, our_pre, verl_post, our_post = (
        getattr(verl, name_pre),
        ours[name_pre],
        getattr(verl, name_post),
        ours[name_post],
    )
    nested = {
        key: to_nested(data[key], mask) for key in ("input_ids", "label", "position_ids3", "router", "embeddings")
    }
    ids = nested["input_ids"]
    options = [{}]
    if accepts(verl_pre, "use_fp8_padding"):
        options.append({"use_fp8_padding": True})
    if accepts(verl_pre, "forced_max_seqlen"):
        options.append({"forced_max_seqlen": mask.shape[1] + 3})
    for option in options:
        tag = ",".join(f"{k}={v}" for k, v in option.items()) or "default"
        for key, x in nested.items():
            pair = c.run(
                name_pre,
                f"{tag} {key}",
                lambda: verl_pre(x, **option),
                lambda: our_pre(x, **option),
                trailing_dims=lambda: verl_pre(_first(x, 2), **option),
                option=(lambda: verl_pre(x)) if option else None,
            )
            if pair is not None:
                for index, part in enumerate(("input_ids", "attention_mask", "position_ids")):
                    c.tensors(name_pre, f"{tag} {key}", pair[0][index], pair[1][index], prefix=f"{part}:")
        marker = c.run(
            name_pre,
            f"{tag} last marker",
            lambda: verl_pre(last_token_marker(ids), **option),
            lambda: our_pre(last_token_marker(ids), **option),
        )
        if marker is None:
            continue
        real, last_token = marker[0][1].bool(), marker[0][0] == 1  # [B, L] verl's mask; its packing of the marker
        regions = {"roll-last-token": last_token, "roll-padding": ~real}
        for key in ("label", "embeddings"):
            pair = c.run(
                name_pre,
                f"{tag} need_roll {key}",
                lambda: verl_pre(nested[key], need_roll=True, **option),
                lambda: our_pre(nested[key], need_roll=True, **option),
                trailing_dims=lambda: verl_pre(_first(nested[key], 2), need_roll=True, **option),
            )
            if pair is not None:
                c.tensors(name_pre, f"{tag} need_roll {key}", pair[0][0], pair[1][0], regions=regions)
        pair = c.run(name_pre, f"{tag} mask", lambda: verl_pre(ids, **option), lambda: our_pre(ids, **option))
        if pair is None:
            continue
        mask_verl, mask_ours = pair[0][1], pair[1][1]
        local = torch.randn((*mask_verl.shape, H), generator=torch.Generator().manual_seed(seed * 10 + 7 + cp_rank))
        for dtype in (torch.float32, torch.bfloat16):
            y_verl, y_ours = leaf(local, dtype), leaf(local, dtype)
            case = f"{tag} {dtype}"
            pair = c.run(
                name_post,
                case,
                lambda: verl_post(y_verl, mask_verl),
                lambda: our_post(y_ours, mask_ours),
                dtype=lambda: verl_post(local.clone(), mask_verl),
            )
            if pair is None:
                continue
            c.tensors(name_post, case, *pair)
            weights = torch.randn(pair[1].values().shape, generator=torch.Generator().manual_seed(seed))
            (pair[0].values().float() * weights).sum().backward()
            (pair[1].values().float() * weights).sum().backward()
            c.tensors(name_post, case, y_verl.grad, y_ours.grad, prefix="grad:")


def vlm_masks(c: SideBySide, verl: Any, ours: dict[str, Callable], data: dict) -> None:
    """``build_vlm_attn_mask_thd`` / ``_bshd`` (0.8+)."""
    mask = data["mask"]
    ids = to_nested(data["input_ids"], mask)
    for pad in (0, 7):
        if "build_vlm_attn_mask_thd" in ours:
            pair = c.run(
                "build_vlm_attn_mask_thd",
                f"pad={pad}",
                lambda: verl.build_vlm_attn_mask_thd(ids, pad),
                lambda: ours["build_vlm_attn_mask_thd"](ids, pad),
            )
            if pair is not None:
                for index, part in enumerate(("input_ids", "attention_mask")):
                    c.tensors(
                        "build_vlm_attn_mask_thd", f"pad={pad}", pair[0][index], pair[1][index], prefix=f"{part}:"
                    )
        if "build_vlm_attn_mask_bshd" in ours:
            function = verl.build_vlm_attn_mask_bshd
            forced = [None, mask.shape[1] + 3] if accepts(function, "forced_max_seqlen") else [None]
            for value in forced:
                options = {} if value is None else {"forced_max_seqlen": value}
                case = f"pad={pad} {options}"
                pair = c.run(
                    "build_vlm_attn_mask_bshd",
                    case,
                    lambda: function(ids, ids.size(0), pad, **options),
                    lambda: ours["build_vlm_attn_mask_bshd"](ids, ids.size(0), pad, **options),
                )
                if pair is not None:
                    for index, part in enumerate(("input_ids", "attention_mask")):
                        c.tensors("build_vlm_attn_mask_bshd", case, pair[0][index], pair[1][index], prefix=f"{part}:")


PAIRS = (  # (procedure, preprocess name, postprocess name): every packing pair any release 0.6.1-0.9.1 defines
    ("legacy_thd", "preprocess_packed_seqs", "postprocess_packed_seqs"),
    ("legacy_bshd", "preprocess_bshd", "postprocess_bshd"),
    ("legacy_bshd", "remove_left_padding", "recover_left_padding"),
    ("engine_thd", "preprocess_packed_seqs_no_padding", "postprocess_packed_seqs_no_padding"),
    ("engine_thd", "preprocess_thd_no_padding", "postprocess_thd_no_padding"),
    ("engine_thd", "preprocess_thd_engine", "postprocess_thd_engine"),
    ("engine_bshd", "preprocess_bshd_no_padding", "postprocess_bshd_no_padding"),
    ("engine_bshd", "preprocess_bshd_engine", "postprocess_bshd_engine"),
)


def compare_release(
    verl: Any, ours: dict[str, Callable], cp_size: int, cp_rank: int, batches: tuple[tuple[int, int], ...]
) -> SideBySide:
    """Every packing function ``verl`` (a release's util module) defines against ``ours`` (verl name -> the drop-in
    the plugin chose), on random batches given as ``(seed, shortest sequence)``."""
    c = SideBySide()
    for seed, shortest in batches:
        data = random_batch(seed, shortest)
        for procedure, name_pre, name_post in PAIRS:
            if name_pre not in ours or name_post not in ours:
                continue
            if procedure == "legacy_thd":
                legacy_thd(c, name_pre, name_post, verl, ours, data, cp_size, cp_rank, seed)
            elif procedure == "legacy_bshd":
                legacy_bshd(c, name_pre, name_post, verl, ours, data)
            elif procedure == "engine_thd":
                engine_thd(c, name_pre, name_post, verl, ours, data, cp_size, cp_rank, seed)
            else:
                engine_bshd(c, name_pre, name_post, verl, ours, data, cp_rank, seed)
        if "postprocess_packed_seqs_for_dict_output" in ours:
            dict_output(c, verl, ours, data, cp_rank, seed)
        vlm_masks(c, verl, ours, data)
    return c
