"""``verl-cppack verify-cp``: does context parallelism change nothing? CP=N against CP=1 on this machine.

Starts ``cp * tp`` gloo processes on 127.0.0.1. Every process first builds the tiny Megatron GPT at CP=1 and runs a
random rollout-shaped batch (left-padded prompts, right-padded responses, some very short) forward and backward; then
it rebuilds megatron's parallel state at CP=N, builds the same weights and runs the same batch. It compares per-token
log-probs, entropy and the CP-all-reduced (summed) weight gradients. The forward goes through verl's own
``gptmodel_forward_model_engine`` with verl_cppack's drop-ins installed where verl is installed, else through
``verl_cppack.logprobs.compute_logprobs`` (``used_verl_forward`` says which).

``grad_max_rel_diff`` is the largest, over parameters, of ``max|g_cpN - g_cp1| / max|g_cp1|``.
Exit status: 0 within tolerance, 1 past tolerance, 2 the check could not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import warnings
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import rollout_batch
from verl_cppack.cli import add_command, error
from verl_cppack.runtime.gloo_world import RankFailed, run_world

LOGPROB_TOLERANCE = 1e-5  # absolute, fp32
GRAD_TOLERANCE = 1e-4  # relative, fp32
VOCAB_SIZE = 97
TINY_GPT = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2}
LIMITS = {  # each compared figure: (its name among the report's tolerances, the tolerance)
    "logprob_max_abs_diff": ("logprob_abs", LOGPROB_TOLERANCE),
    "entropy_max_abs_diff": ("entropy_abs", LOGPROB_TOLERANCE),
    "grad_max_rel_diff": ("grad_rel", GRAD_TOLERANCE),
}


def verify_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked rollout batch ``[B, P+R]``; row 0 holds a 1-token prompt and a 1-token response (shorter than
    any CP chunk), every row at least one response token."""
    prompt = args.prompt_length
    length = prompt + args.response_length
    input_ids, mask = rollout_batch(
        args.batch_size, length, prompt_len=prompt, short_rows=0.3, vocab_size=VOCAB_SIZE, seed=args.seed
    )
    mask[0] = False
    mask[0, prompt - 1 : prompt + 1] = True
    return input_ids, mask


def verl_forward_available() -> bool:
    """verl installed (it is imported only in the workers)."""
    try:
        return importlib.util.find_spec("verl") is not None
    except ValueError:  # a ``verl`` module already imported without a spec (a stand-in): not verl's package
        return False


PerToken = tuple[torch.Tensor, torch.Tensor]  # (log_probs [N], entropy [N]) at the valid tokens, row order


def per_token_ours(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, ctx: Any, layout: str) -> PerToken:
    """(log_probs ``[N]``, entropy ``[N]``) at the valid tokens in row order, via ``compute_logprobs``."""
    from verl_cppack.logprobs import compute_logprobs

    log_probs, entropy = compute_logprobs(model, input_ids, mask, ctx, layout=layout, with_entropy=True)
    return log_probs[mask], entropy[mask]


def per_token_verl(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, ctx: Any, layout: str) -> PerToken:
    """Same through verl's ``gptmodel_forward_model_engine`` with the drop-ins; verl rolls labels within each
    sequence (``need_roll``), so a row's last token scores its first: CP=1 and CP=N compare exactly that."""
    from verl_cppack.integrations import verl as cppack_verl

    if not cppack_verl.install():
        raise RuntimeError(
            "verl_cppack.integrations.verl.install() is disabled (VERL_CPPACK_DISABLE); use --forward ours"
        )
    from verl.models.mcore import model_forward

    for name in ("preprocess_thd_engine", "postprocess_thd_engine"):
        if not getattr(model_forward, name).__module__.startswith("verl_cppack."):
            raise RuntimeError(f"verl's model_forward.{name} is not verl_cppack's drop-in after install()")
    offsets = torch.nn.functional.pad(torch.cumsum(mask.sum(dim=1), 0), (1, 0))
    nested = torch.nested.nested_tensor_from_jagged(input_ids[mask], offsets=offsets)

    def logits_processor(logits: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        log_softmax = torch.log_softmax(logits.float(), dim=-1)  # [1, T_local, V]
        return {
            "log_probs": log_softmax.gather(-1, label.long().unsqueeze(-1)).squeeze(-1),
            "entropy": -(log_softmax.exp() * log_softmax).sum(dim=-1),
        }

    output = model_forward.gptmodel_forward_model_engine(
        model, nested, {}, logits_processor=logits_processor, logits_processor_args={"label": nested}, cp_layout=layout
    )
    return output["log_probs"].values(), output["entropy"].values()


def _run_once(args: argparse.Namespace, cp_size: int, use_verl: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from verl_cppack.runtime.tiny_gpt import build_tiny_gpt, init_megatron_parallel

    ctx = init_megatron_parallel(tp_size=args.tp, cp_size=cp_size, seed=args.seed)
    model = build_tiny_gpt(vocab_size=VOCAB_SIZE, attention=args.attention, seed=args.seed, **TINY_GPT)
    input_ids, mask = verify_batch(args)
    forward = per_token_verl if use_verl else per_token_ours
    log_probs, entropy = forward(model, input_ids, mask, ctx, args.layout)  # [N] each
    weights = torch.randn(2, log_probs.numel(), generator=torch.Generator().manual_seed(args.seed + 1))
    loss = (log_probs * weights[0]).sum() + (entropy * weights[1]).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    if ctx.cp_size > 1:  # the gather-back contract: each rank holds its chunk's share; the sum is the whole
        for grad in grads.values():
            dist.all_reduce(grad, group=ctx.cp_group)
    return log_probs.detach(), entropy.detach(), grads


def _compare(rank: int, world_size: int, args: argparse.Namespace, use_verl: bool) -> dict[str, float]:
    """One gloo rank's figures, CP=N against CP=1."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")  # TE/Apex absent on CPU
    ref_log_probs, ref_entropy, ref_grads = _run_once(args, 1, use_verl)
    log_probs, entropy, grads = _run_once(args, args.cp, use_verl)
    if set(grads) != set(ref_grads):
        raise RuntimeError(f"parameters with gradients differ between CP=1 and CP={args.cp}")
    rel = max(
        ((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-30)).item() for n in ref_grads
    )
    return {
        "logprob_max_abs_diff": (log_probs - ref_log_probs).abs().max().item(),
        "entropy_max_abs_diff": (entropy - ref_entropy).abs().max().item(),
        "grad_max_rel_diff": rel,
        "num_tokens": int(ref_log_probs.numel()),
    }


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Run the ranks, return the JSON report (raises ``RankFailed``, a ``RuntimeError``, if a rank failed)."""
    use_verl = args.forward == "verl" or (args.forward == "auto" and verl_forward_available())
    metrics = run_world(_compare, args.cp * args.tp, args, use_verl, torch_threads=1)
    report: dict[str, Any] = {key: getattr(args, key) for key in ("cp", "tp", "layout", "attention")}
    report.update(used_verl_forward=use_verl, num_tokens=metrics[0]["num_tokens"])
    report.update({key: max(m[key] for m in metrics) for key in LIMITS})
    report["tolerances"] = dict(LIMITS.values())
    report["passed"] = all(report[key] <= tolerance for key, (_, tolerance) in LIMITS.items())
    return report


def _check_args(args: argparse.Namespace) -> str | None:
    if args.cp < 1 or args.tp < 1:
        return f"--cp and --tp must be >= 1, got --cp {args.cp} --tp {args.tp}"
    if args.tp != 1:
        return "--tp > 1 is not supported yet (the tiny GPT check needs a vocab-parallel log-softmax); use --tp 1"
    if args.attention == "ring" and args.layout != "zigzag":
        return "--attention ring needs --layout zigzag (a ring walks the zigzag chunks); use --attention allgather"
    if args.layout != "zigzag" and args.cp > 1 and not _megatron_knows_partition_mode():
        return (
            f"--layout {args.layout} with --cp > 1 needs PackedSeqParams.cp_partition_mode, which this "
            "megatron-core lacks (its THD RoPE and attention assume zigzag); use --layout zigzag"
        )
    if args.forward == "verl" and not verl_forward_available():
        return "--forward verl needs verl and verl_cppack.integrations.verl.install; use --forward auto or ours"
    if min(args.batch_size, args.prompt_length, args.response_length) < 1:
        return "--batch-size, --prompt-length and --response-length must be >= 1"
    return None


def _megatron_knows_partition_mode() -> bool:
    from verl_cppack.integrations.megatron import packed_seq_params_accepts, packed_seq_params_class

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return packed_seq_params_accepts(packed_seq_params_class(), "cp_partition_mode")


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        return error(problem)
    try:
        report = run_check(args)
    except RankFailed as failure:
        return error(f"verify-cp could not run the check: {failure}")
    print(
        f"verify-cp cp={report['cp']} layout={report['layout']} attention={report['attention']} "
        f"forward={'verl' if report['used_verl_forward'] else 'verl_cppack'} tokens={report['num_tokens']}\n"
        f"  log-prob max |diff| {report['logprob_max_abs_diff']:.3e} (tol {LOGPROB_TOLERANCE:.0e})\n"
        f"  entropy  max |diff| {report['entropy_max_abs_diff']:.3e} (tol {LOGPROB_TOLERANCE:.0e})\n"
        f"  grad max rel diff   {report['grad_max_rel_diff']:.3e} (tol {GRAD_TOLERANCE:.0e})\n"
        f"  {'PASSED' if report['passed'] else 'FAILED'}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["passed"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    help_text = "check that CP=N gives the CP=1 log-probs, entropy and gradients (tiny GPT, gloo, CPU)"
    parser = add_command(subparsers, "verify-cp", help_text, __doc__, run)
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size N to check (default 2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (only 1 for now)")
    for flag, choices, text in (  # the first choice is the default
        ("--layout", ("zigzag", "contiguous"), "CP layout: zigzag (ring / TE) or contiguous (contiguous needs a "
         "megatron-core with cp_partition_mode; 0.16.1 has none, so it is refused there)"),
        ("--attention", ("allgather", "ring"), "CP attention: all-gather K/V or zigzag ring (default allgather)"),
        ("--forward", ("auto", "verl", "ours"),
         "auto: verl's engine forward with verl_cppack installed when available, else verl_cppack's own"),
    ):  # fmt: skip
        parser.add_argument(flag, choices=choices, default=choices[0], help=text)
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    parser.add_argument("--batch-size", type=int, default=4, help="rollout rows (default 4)")
    parser.add_argument("--prompt-length", type=int, default=12, help="longest left-padded prompt (default 12)")
    parser.add_argument("--response-length", type=int, default=20, help="longest right-padded response (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch and the model's weights (default 0)")
