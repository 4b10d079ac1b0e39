"""Every packing function of one verl release side by side with the drop-ins the plugin picks for it, on random
batches, in one process (a rank of an initialised megatron parallel state).

``compare_release`` runs each of verl's functions and ours on the same random batch (``random_batch``: padding
anywhere or rollout-shaped, 1-token and empty rows) with every option the release takes, then the gather-backs and
their local gradients, and records *where* they differ (``comparison.Finding``, keyed by ``difference_key``). The
release matrix (``test_verl_release_matrix.py``) holds every tested release to its intended differences; the
multi-rank equality test (``test_verl_equality.py``) holds the installed verl to them at CP 1/2/4 and TP2xCP2.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import rollout_batch
from verl_cppack.integrations.verl.comparison import Comparison, last_token_marker, ones_like_nested

H = 4  # hidden size of embeddings / outputs


def random_batch(seed: int, shortest: int = 1, padding: str = "anywhere") -> dict[str, torch.Tensor]:
    """``bench.batches.rollout_batch``'s ids and mask (``[6, 14]`` padded anywhere, or ``[7, 15]`` rollout-shaped:
    left-padded prompts of up to 6 tokens, right-padded responses; a third of the rows 3 tokens or fewer), and the
    tensors verl packs with them: labels, a bool label mask, ``[B,S,3]`` positions, ``[B,S,2,3]`` uint8 router
    indices, ``[B,S,H]`` bf16 embeddings, drawn from the same generator."""
    generator = torch.Generator().manual_seed(seed)
    shape, prompt = ((6, 14), None) if padding == "anywhere" else ((7, 15), 6)
    ids, mask = rollout_batch(
        *shape,
        padding=padding,
        prompt_len=prompt,
        shortest=shortest,
        short_rows=0.3,
        vocab_size=1000,
        generator=generator,
    )
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


def accepts(function: Callable, name: str) -> bool:
    return name in inspect.signature(function).parameters


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


def _tag(option: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in option.items()) or "default"


class SideBySide(Comparison):
    """A ``Comparison`` that runs both functions itself, every rank of the world skipping together. ``strict``: both
    raising is a finding too (``both-raised``), not agreement on bad input."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def run(
        self,
        function: str,
        case: str,
        verl_call: Callable[[], Any],
        our_call: Callable[[], Any],
        **variants: Callable[[], Any] | None,
    ) -> tuple[Any, Any] | None:
        """Both results, or None after recording which side raised. Every rank gets None when a call raised on any
        rank, so all skip what follows together. ``variants``: verl's call without one feature of the case
        (``trailing_dims``, ``dtype``: a float32 output, ``option``); where verl fails and succeeds without it, the
        finding names it (``verl-raised-trailing_dims``, ...)."""
        where = "verl-raised"
        try:
            theirs = verl_call()
        except Exception as error:  # noqa: BLE001 - verl's failures are findings
            theirs = error
            for feature, variant in variants.items():
                try:
                    if variant is not None:
                        variant()
                        where = f"verl-raised-{feature}"
                        break
                except Exception:  # noqa: BLE001 - fails without the feature too: not this feature
                    continue
        try:
            ours = our_call()
        except Exception as error:  # noqa: BLE001
            ours = error
        raised = torch.tensor([isinstance(theirs, Exception), isinstance(ours, Exception)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(raised, op=dist.ReduceOp.MAX)
        if isinstance(theirs, Exception) and isinstance(ours, Exception):
            if self.strict:
                self.add(function, case, "both-raised", f"{type(ours).__name__}: {str(ours)[:300]}")
        elif isinstance(theirs, Exception):
            self.add(function, case, where, f"{type(theirs).__name__}: {str(theirs)[:160]}")
        elif isinstance(ours, Exception):
            self.add(function, case, "ours-raised", f"{type(ours).__name__}: {str(ours)[:300]}")
        elif not raised.any():
            self.count(function)
            return theirs, ours
        return None  # raised here or on another rank

    def gather_back(
        self,
        function: str,
        tag: str,
        local: torch.Tensor,
        verl_post: Callable[[torch.Tensor], Any],
        our_post: Callable[[torch.Tensor], Any],
        seed: int,
        dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    ) -> None:
        """The gather-back of ``local`` (a model output, per dtype), then the gradient of a weighted sum of it."""
        for dtype in dtypes:
            y_verl, y_ours, case = leaf(local, dtype), leaf(local, dtype), f"{tag} {dtype}"
            pair = self.run(
                function, case, lambda: verl_post(y_verl), lambda: our_post(y_ours), dtype=lambda: verl_post(local)
            )
            if pair is None:
                continue
            self.tensors(function, case, *pair)
            values = [part.values() if part.is_nested else part for part in pair]
            weights = torch.randn(values[1].shape, generator=torch.Generator().manual_seed(seed))
            for part in values:
                (part.float() * weights).sum().backward()
            if y_verl.grad is None or y_ours.grad is None:
                self.add(function, case, "grad:missing", f"verl {y_verl.grad is None}, ours {y_ours.grad is None}")
            else:
                self.tensors(function, case, y_verl.grad, y_ours.grad, prefix="grad:")

    def pass_through(self, function: str, case: str, given: Any, pair: tuple[Any, Any] | None) -> None:
        """Where verl returns ``given`` itself (``pre_process`` / ``post_process`` False), ours must too."""
        if pair is not None and (pair[0] is given) != (pair[1] is given):
            self.add(function, case, "identity", f"verl returns its argument: {pair[0] is given}")


# ------------------------------------------------------------------------------------------------ procedures
def legacy_thd(c: SideBySide, pre: str, post: str, verl: Any, ours: dict, data: dict, cp: tuple[int, int], seed: int):
    """``preprocess_packed_seqs`` / ``postprocess_packed_seqs`` (padded ``[B, S]`` batches)."""
    mask, (batch, seq_len) = data["mask"], data["mask"].shape
    verl_pre, our_pre, verl_post, our_post = getattr(verl, pre), ours[pre], getattr(verl, post), ours[post]
    ids = data["input_ids"]
    pair = c.run(
        pre, "pre_process=False", lambda: verl_pre(ids, mask, pre_process=False), lambda: our_pre(ids, mask, False)
    )
    c.pass_through(pre, "pre_process=False", ids, pair and (pair[0][0], pair[1][0]))
    for fp8 in (False, True) if accepts(verl_pre, "use_fp8_padding") else (False,):
        options, tag = ({"use_fp8_padding": True} if fp8 else {}), f"fp8={fp8}"
        for key in ("input_ids", "label", "label_mask", "position_ids3", "router", "embeddings"):
            pair = c.run(
                pre,
                f"{tag} {key}",
                lambda: verl_pre(data[key], mask, True, **options),
                lambda: our_pre(data[key], mask, True, **options),
                trailing_dims=lambda: verl_pre(_first(data[key], 2), mask, True, **options),
                option=(lambda: verl_pre(data[key], mask, True)) if options else None,
            )
            if pair is not None:
                c.tensors(pre, f"{tag} {key}", pair[0][0], pair[1][0])
                c.params(pre, f"{tag} {key}", pair[0][1], pair[1][1])
        pair = c.run(
            pre,
            f"{tag} params",
            lambda: verl_pre(ids, mask, **options),
            lambda: our_pre(ids, mask, **options),
            option=(lambda: verl_pre(ids, mask)) if options else None,
        )
        if pair is None:
            continue
        (_, psp_verl), (_, psp_ours) = pair
        local = torch.randn(
            (1, int(psp_verl.cu_seqlens_q_padded[-1]) // cp[0], H),
            generator=torch.Generator().manual_seed(seed * 10 + cp[1]),
        )
        c.gather_back(
            post,
            tag,
            local,
            lambda y: verl_post(y, psp_verl, mask, batch, seq_len),
            lambda y: our_post(y, psp_ours, mask, batch, seq_len),
            seed,
        )
        case = f"{tag} post_process=False"
        pair = c.run(
            post,
            case,
            lambda: verl_post(local, psp_verl, mask, batch, seq_len, post_process=False),
            lambda: our_post(local, psp_ours, mask, batch, seq_len, post_process=False),
        )
        c.pass_through(post, case, local, pair)


def dict_output(c: SideBySide, verl: Any, ours: dict, data: dict, cp_rank: int, seed: int) -> None:
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
    entropy = torch.rand(labels_verl.shape[1], generator=generator)
    log_probs = -torch.rand(labels_verl.shape[1], generator=generator)

    def output():
        return CausalLMOutputForPPO(log_probs=log_probs.clone(), entropy=entropy.clone())

    pair = c.run(
        name,
        "dict",
        lambda: getattr(verl, name)(labels_verl, output(), psp_verl, mask, batch, seq_len),
        lambda: ours[name](labels_ours, output(), psp_ours, mask, batch, seq_len),
    )
    if pair is not None:
        c.results(name, "dict", *pair, regions={})


def legacy_bshd(c: SideBySide, pre: str, post: str, verl: Any, ours: dict, data: dict, seed: int) -> None:
    """``preprocess_bshd`` / ``postprocess_bshd`` (0.6: ``remove_left_padding`` / ``recover_left_padding``)."""
    mask, seq_len = data["mask"], data["mask"].shape[1]
    positions = torch.cumsum(mask.long(), 1) - 1
    verl_pre, our_pre, verl_post, our_post = getattr(verl, pre), ours[pre], getattr(verl, post), ours[post]
    for sequence_parallel in (False, True):
        tag = f"sp={sequence_parallel}"
        for key in ("input_ids", "router", "embeddings"):
            pair = c.run(
                pre,
                f"{tag} {key}",
                lambda: verl_pre(data[key], mask, positions, sequence_parallel),
                lambda: our_pre(data[key], mask, positions, sequence_parallel),
                trailing_dims=lambda: verl_pre(_first(data[key], 2), mask, positions, sequence_parallel),
            )
            if pair is not None:
                c.results(pre, f"{tag} {key}", *pair, regions={})
        pair = c.run(
            pre,
            tag,
            lambda: verl_pre(data["input_ids"], mask, positions, sequence_parallel),
            lambda: our_pre(data["input_ids"], mask, positions, sequence_parallel),
        )
        if pair is None:
            continue
        mask_verl, mask_ours = pair[0][1], pair[1][1]
        result = torch.randn((*mask_verl.shape, H), generator=torch.Generator().manual_seed(3))
        c.gather_back(
            post,
            tag,
            result,
            lambda y: verl_post(y, mask_verl, mask, seq_len),
            lambda y: our_post(y, mask_ours, mask, seq_len),
            seed,
            dtypes=(torch.float32,),
        )
        pair = c.run(  # a mask ours did not make (verl's)
            post,
            f"{tag} verl's mask",
            lambda: verl_post(result, mask_verl, mask, seq_len),
            lambda: our_post(result, mask_verl, mask, seq_len),
        )
        if pair is not None:
            c.tensors(post, f"{tag} verl's mask", *pair)


def _thd_options(verl_pre: Callable, cp_size: int) -> list[dict]:
    options = [{}]
    for name, value in (("use_fp8_padding", True), ("min_local_rows", 40), ("pad_to_length_bucket", 64)):
        if accepts(verl_pre, name):
            options.append({name: value})
    if accepts(verl_pre, "cp_layout") and cp_size == 1:
        options.append({"cp_layout": "contiguous"})
    return options


def _run_pre(c, pre: str, case: str, verl_pre: Callable, our_pre: Callable, x: torch.Tensor, option: dict):
    """One nested preprocess, verl's beside ours under ``option`` (with its trailing-dims and no-option variants)."""
    return c.run(
        pre,
        case,
        lambda: verl_pre(x, **option),
        lambda: our_pre(x, **option),
        trailing_dims=lambda: verl_pre(_first(x, 2), **option),
        option=(lambda: verl_pre(x)) if option else None,
    )


def engine_thd(c: SideBySide, pre: str, post: str, verl: Any, ours: dict, data: dict, cp: tuple[int, int], seed: int):
    """The nested THD pair: 0.6 ``*_packed_seqs_no_padding``, 0.7 ``*_thd_no_padding``, 0.8+ ``*_thd_engine``."""
    mask = data["mask"]
    verl_pre, our_pre, verl_post, our_post = getattr(verl, pre), ours[pre], getattr(verl, post), ours[post]
    keys = ("input_ids", "label", "label_mask", "position_ids3", "router", "embeddings")
    nested = {key: to_nested(data[key], mask) for key in keys}
    ids = nested["input_ids"]
    for option in _thd_options(verl_pre, cp[0]):
        tag = _tag(option)
        marker = c.run(
            pre,
            f"{tag} marker",
            lambda: verl_pre(ones_like_nested(ids), **option),
            lambda: our_pre(ones_like_nested(ids), **option),
            option=(lambda: verl_pre(ones_like_nested(ids))) if option else None,
        )
        if marker is None:
            continue
        real = marker[0][0][0] == 1  # [T_local] verl's packing of ones: real tokens
        for key, x in nested.items():
            pair = _run_pre(c, pre, f"{tag} {key}", verl_pre, our_pre, x, option)
            if pair is None:
                continue
            c.tensors(pre, f"{tag} {key}", pair[0][0], pair[1][0])
            c.params(pre, f"{tag} {key}", pair[0][1], pair[1][1])
            if len(pair[0]) > 2 and key in ("input_ids", "embeddings"):  # position ids
                regions = {"positions-real": real[None], "positions-padding": ~real[None]}
                c.tensors(pre, f"{tag} {key}", pair[0][2], pair[1][2], regions=regions, prefix="positions:")
        if accepts(verl_pre, "need_roll"):
            last = c.run(
                pre,
                f"{tag} last marker",
                lambda: verl_pre(last_token_marker(ids), **option),
                lambda: our_pre(last_token_marker(ids), **option),
            )
            if last is None:
                continue
            regions = {"roll-last-token": last[0][0][0] == 1, "roll-padding": ~real}
            for key in ("label", "label_mask", "embeddings"):
                case = f"{tag} need_roll {key}"
                pair = c.run(
                    pre,
                    case,
                    lambda: verl_pre(nested[key], need_roll=True, **option),
                    lambda: our_pre(nested[key], need_roll=True, **option),
                    trailing_dims=lambda: verl_pre(_first(nested[key], 2), need_roll=True, **option),
                    option=(lambda: verl_pre(nested[key], need_roll=True)) if option else None,
                )
                if pair is None:
                    continue
                c.tensors(pre, case, pair[0][0][0], pair[1][0][0], regions=regions)
                if len(pair[0]) > 2 and not torch.equal(pair[0][2], pair[1][2]):
                    c.add(pre, case, "positions-roll")
        pair = c.run(pre, f"{tag} params", lambda: verl_pre(ids, **option), lambda: our_pre(ids, **option))
        if pair is None:
            continue
        psp_verl, psp_ours = pair[0][1], pair[1][1]
        post_options = {k: v for k, v in option.items() if k in ("local_cp_size", "cp_layout")}
        local = torch.randn(
            (1, int(psp_verl.cu_seqlens_q_padded[-1]) // cp[0], H),
            generator=torch.Generator().manual_seed(seed * 10 + 5 + cp[1]),
        )
        c.gather_back(
            post,
            tag,
            local,
            lambda y: verl_post(y, psp_verl, ids, ids.size(0), **post_options),
            lambda y: our_post(y, psp_ours, ids, ids.size(0), **post_options),
            seed,
        )


def engine_bshd(c: SideBySide, pre: str, post: str, verl: Any, ours: dict, data: dict, cp_rank: int, seed: int):
    """The nested BSHD pair: 0.7 ``*_bshd_no_padding``, 0.8+ ``*_bshd_engine``."""
    mask = data["mask"]
    verl_pre, our_pre, verl_post, our_post = getattr(verl, pre), ours[pre], getattr(verl, post), ours[post]
    keys = ("input_ids", "label", "position_ids3", "router", "embeddings")
    nested = {key: to_nested(data[key], mask) for key in keys}
    ids = nested["input_ids"]
    options = [{}]
    if accepts(verl_pre, "use_fp8_padding"):
        options.append({"use_fp8_padding": True})
    if accepts(verl_pre, "forced_max_seqlen"):
        options.append({"forced_max_seqlen": mask.shape[1] + 3})
    for option in options:
        tag = _tag(option)
        for key, x in nested.items():
            pair = _run_pre(c, pre, f"{tag} {key}", verl_pre, our_pre, x, option)
            if pair is not None:
                c.results(pre, f"{tag} {key}", *pair, regions={})
        marker = c.run(
            pre,
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
                pre,
                f"{tag} need_roll {key}",
                lambda: verl_pre(nested[key], need_roll=True, **option),
                lambda: our_pre(nested[key], need_roll=True, **option),
                trailing_dims=lambda: verl_pre(_first(nested[key], 2), need_roll=True, **option),
            )
            if pair is not None:
                c.tensors(pre, f"{tag} need_roll {key}", pair[0][0], pair[1][0], regions=regions)
        pair = c.run(pre, f"{tag} mask", lambda: verl_pre(ids, **option), lambda: our_pre(ids, **option))
        if pair is None:
            continue
        mask_verl, mask_ours = pair[0][1], pair[1][1]
        local = torch.randn((*mask_verl.shape, H), generator=torch.Generator().manual_seed(seed * 10 + 7 + cp_rank))
        c.gather_back(post, tag, local, lambda y: verl_post(y, mask_verl), lambda y: our_post(y, mask_ours), seed)
        pair = c.run(  # a mask ours did not make (verl's)
            post, f"{tag} verl's mask", lambda: verl_post(local, mask_verl), lambda: our_post(local, mask_verl)
        )
        if pair is not None:
            c.tensors(post, f"{tag} verl's mask", *pair)


def vlm_masks(c: SideBySide, verl: Any, ours: dict, data: dict) -> None:
    """``build_vlm_attn_mask_thd`` / ``_bshd`` (0.8+)."""
    ids = to_nested(data["input_ids"], data["mask"])
    for pad in (0, 7):
        calls = []
        if "build_vlm_attn_mask_thd" in ours:
            calls.append(("build_vlm_attn_mask_thd", f"pad={pad}", (ids, pad), {}))
        if "build_vlm_attn_mask_bshd" in ours:
            function = verl.build_vlm_attn_mask_bshd
            forced = [None, data["mask"].shape[1] + 3] if accepts(function, "forced_max_seqlen") else [None]
            for value in forced:
                options = {} if value is None else {"forced_max_seqlen": value}
                calls.append(("build_vlm_attn_mask_bshd", f"pad={pad} {options}", (ids, ids.size(0), pad), options))
        for name, case, args, options in calls:
            pair = c.run(
                name, case, lambda: getattr(verl, name)(*args, **options), lambda: ours[name](*args, **options)
            )
            if pair is not None:
                c.results(name, case, *pair, regions={})


PAIRS = (  # (procedure, preprocess name, postprocess name): every packing pair any release 0.6.1-0.9.1 defines
    (legacy_thd, "preprocess_packed_seqs", "postprocess_packed_seqs"),
    (legacy_bshd, "preprocess_bshd", "postprocess_bshd"),
    (legacy_bshd, "remove_left_padding", "recover_left_padding"),
    (engine_thd, "preprocess_packed_seqs_no_padding", "postprocess_packed_seqs_no_padding"),
    (engine_thd, "preprocess_thd_no_padding", "postprocess_thd_no_padding"),
    (engine_thd, "preprocess_thd_engine", "postprocess_thd_engine"),
    (engine_bshd, "preprocess_bshd_no_padding", "postprocess_bshd_no_padding"),
    (engine_bshd, "preprocess_bshd_engine", "postprocess_bshd_engine"),
)


def compare_release(
    verl: Any, ours: dict[str, Callable], cp_size: int, cp_rank: int, batches: tuple, strict: bool = False
) -> SideBySide:
    """Every packing function ``verl`` (a release's util module) defines against ``ours`` (verl name -> the drop-in
    the plugin chose), on random batches given as ``(seed, shortest sequence[, padding])``."""
    c = SideBySide(strict)
    for seed, shortest, *padding in batches:
        data = random_batch(seed, shortest, *padding)
        for procedure, pre, post in PAIRS:
            if pre not in ours or post not in ours:
                continue
            if procedure is legacy_bshd:
                legacy_bshd(c, pre, post, verl, ours, data, seed)
            elif procedure is engine_bshd:
                engine_bshd(c, pre, post, verl, ours, data, cp_rank, seed)
            else:
                procedure(c, pre, post, verl, ours, data, (cp_size, cp_rank), seed)
        if "postprocess_packed_seqs_for_dict_output" in ours:
            dict_output(c, verl, ours, data, cp_rank, seed)
        vlm_masks(c, verl, ours, data)
    return c
