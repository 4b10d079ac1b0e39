"""A drop-in stands in for one of verl's functions exactly when every call verl's function accepts binds the same
way to the drop-in (``patching.incompatibility``), and a signature read from source is the function's own.

The oracle is Python's own binding: random signatures and random calls, bound with ``inspect.Signature.bind``.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from verl_cppack.integrations.verl.patching import VerlFunction, incompatibility, signature_from_source

P = inspect.Parameter
NAMES = ("a", "b", "c", "d", "e")
DEFAULTS = (P.empty, None, False, True, 0, 1, "zigzag")


@st.composite
def signatures(draw) -> inspect.Signature:
    """A valid signature over a few of ``NAMES``: positional-or-keyword then keyword-only parameters, defaults
    after the first defaulted positional one, sometimes ``*args`` / ``**kwargs``."""
    names = draw(st.permutations(NAMES).map(lambda names: names[: draw(st.integers(0, len(NAMES)))]))
    split = draw(st.integers(0, len(names)))
    parameters, defaulted = [], False
    for name in names[:split]:
        default = draw(st.sampled_from(DEFAULTS))
        if defaulted and default is P.empty:
            default = None
        defaulted |= default is not P.empty
        parameters.append(P(name, P.POSITIONAL_OR_KEYWORD, default=default))
    if draw(st.booleans()) and draw(st.integers(0, 5)) == 0:
        parameters.append(P("args", P.VAR_POSITIONAL))
    parameters += [P(name, P.KEYWORD_ONLY, default=draw(st.sampled_from(DEFAULTS))) for name in names[split:]]
    if draw(st.integers(0, 5)) == 0:
        parameters.append(P("kwargs", P.VAR_KEYWORD))
    return inspect.Signature(parameters)


def calls(signature: inspect.Signature):
    """Every call shape over ``NAMES``: up to 5 positional values and any subset of names by keyword."""
    for count in range(len(NAMES) + 1):
        for keywords in itertools.chain.from_iterable(itertools.combinations(NAMES, k) for k in range(len(NAMES) + 1)):
            yield tuple(f"p{i}" for i in range(count)), {name: f"k_{name}" for name in keywords}


def bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    try:
        arguments = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    arguments.apply_defaults()
    return dict(arguments.arguments)


@st.composite
def extended(draw, verl: inspect.Signature) -> inspect.Signature:
    """``verl`` with parameters added after its own (positional or keyword-only, with a default or, rarely,
    without), one default perhaps changed: drop-ins that often do stand in, and near misses."""
    parameters = [p for p in verl.parameters.values() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    free = [name for name in NAMES if name not in verl.parameters]
    extra = draw(st.lists(st.sampled_from(free), unique=True, max_size=len(free))) if free else []
    positional = [p for p in parameters if p.kind is P.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in parameters if p.kind is P.KEYWORD_ONLY]
    for name in extra:
        default = draw(st.sampled_from(DEFAULTS if draw(st.integers(0, 9)) == 0 else DEFAULTS[1:]))
        if draw(st.booleans()) and (default is not P.empty or not any(p.default is not P.empty for p in positional)):
            positional.append(P(name, P.POSITIONAL_OR_KEYWORD, default=default))
        else:
            keyword.append(P(name, P.KEYWORD_ONLY, default=default))
    if parameters and draw(st.integers(0, 4)) == 0:
        changed = draw(st.sampled_from(parameters)).name
        positional = [
            p.replace(default=None) if p.name == changed and p.default is not P.empty else p for p in positional
        ]
        keyword = [p.replace(default=1) if p.name == changed and p.default is not P.empty else p for p in keyword]
    try:
        return inspect.Signature([*positional, *keyword])
    except ValueError:  # a non-default after a default: draw a plain one instead
        return draw(signatures())


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_drop_in_stands_in_exactly_when_every_call_binds_the_same(data):
    """None from ``incompatibility`` means: every call verl's signature binds, the drop-in's binds to the same
    values for verl's parameters and to its own defaults for the rest. (Signatures with ``*args``/``**kwargs`` on
    verl's side are never stood in for: what verl does with them is unknown.)"""
    verl = data.draw(signatures())
    dropin = data.draw(st.one_of(signatures(), extended(verl)))
    verdict = incompatibility(verl, dropin)
    same = True
    for args, kwargs in calls(verl):
        theirs = bound(verl, args, kwargs)
        if theirs is None:
            continue
        ours = bound(dropin, args, kwargs)
        expected = {
            **{n: p.default for n, p in dropin.parameters.items() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)},
            **theirs,
        }
        if ours is None or any(
            ours.get(name) != value or type(ours.get(name)) is not type(value)
            for name, value in expected.items()
            if name in dropin.parameters
        ):
            same = False
            break
    event(f"stands in: {verdict is None}")
    if verdict is None:
        assert same and not _variadic(verl), (verl, dropin)
    elif not _variadic(verl) and not _variadic(dropin):
        # a refusal is for a reason some call shows (a drop-in's own *args/**kwargs are not looked into)
        assert not same, (verl, dropin, verdict)


def _variadic(signature: inspect.Signature) -> bool:
    return any(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in signature.parameters.values())


def test_a_parameter_the_drop_in_does_not_know_is_named():
    verl = inspect.signature(lambda input_ids, pre_process=True, return_position_ids=False: None)
    ours = inspect.signature(lambda input_ids, pre_process=True, need_roll=False: None)
    assert incompatibility(verl, ours) == "parameters the drop-in does not know: return_position_ids"


def test_an_extra_drop_in_parameter_without_default_is_refused():
    verl = inspect.signature(lambda input_ids: None)
    assert "requires parameters" in incompatibility(verl, inspect.signature(lambda input_ids, batch_size: None))
    assert incompatibility(verl, inspect.signature(lambda input_ids, batch_size=None: None)) is None


def test_a_different_default_or_order_is_refused():
    verl = inspect.signature(lambda x, need_roll=False, use_fp8_padding=False: None)
    assert "defaults to False in verl, True" in incompatibility(
        verl, inspect.signature(lambda x, need_roll=True, use_fp8_padding=False: None)
    )
    assert "positional parameters differ" in incompatibility(
        verl, inspect.signature(lambda x, use_fp8_padding=False, need_roll=False: None)
    )


SOURCE = """
def preprocess_thd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    *,
    local_cp_size: int | None = None,
    cp_layout: ContextParallelLayout = "zigzag",
    bucket=math.inf,
):
    return mpu.get_context_parallel_world_size(), helper(input_ids)
"""


def test_a_signature_read_from_source_is_the_functions_own():
    """Names, kinds and literal defaults as ``inspect.signature`` gives them; a default that is no literal is
    unknown (never equal to a drop-in's); the names the body uses include attributes and globals."""
    node = ast.parse(textwrap.dedent(SOURCE)).body[0]
    namespace = {"torch": None, "math": __import__("math"), "ContextParallelLayout": str}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<source>", "exec"), namespace)
    read = signature_from_source(node)
    actual = inspect.signature(namespace["preprocess_thd_engine"])
    assert [(p.name, p.kind) for p in read.parameters.values()] == [
        (p.name, p.kind) for p in actual.parameters.values()
    ]
    assert [read.parameters[n].default for n in ("pre_process", "local_cp_size", "cp_layout")] == [True, None, "zigzag"]
    assert read.parameters["bucket"].default is not actual.parameters["bucket"].default
    ours = inspect.signature(
        lambda input_ids, pre_process=True, *, local_cp_size=None, cp_layout="zigzag", bucket=float("inf"): None
    )
    assert (
        incompatibility(read, ours)
        == f"bucket defaults to {read.parameters['bucket'].default!r} in verl, inf in the drop-in"
    )
    assert {"get_context_parallel_world_size", "mpu", "helper"} <= VerlFunction.from_source(node).names


@pytest.mark.parametrize("source", [SOURCE])
def test_the_names_of_a_function_and_of_its_source_agree(source):
    node = ast.parse(textwrap.dedent(source)).body[0]
    namespace = {"torch": None, "math": __import__("math"), "ContextParallelLayout": str}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<source>", "exec"), namespace)
    assert VerlFunction.of(namespace["preprocess_thd_engine"]).names <= VerlFunction.from_source(node).names
