"""The counting task's reward, verl's ``custom_reward_function``; verl loads it by path: standard library only."""

SYMBOLS = "0123456789abcdef"
RESPONSE_LENGTH = 6


def successor(symbol: str) -> str | None:
    """The symbol after ``symbol`` in the alphabet (``f`` -> ``0``); ``None`` for a symbol outside it."""
    index = SYMBOLS.find(symbol) if len(symbol) == 1 else -1
    return SYMBOLS[(index + 1) % len(SYMBOLS)] if index >= 0 else None


def correct_positions(last_prompt_symbol: str, response: str) -> list[bool]:
    """For each of the first ``RESPONSE_LENGTH`` response symbols: is it its predecessor's successor."""
    previous, flags = last_prompt_symbol, []
    for symbol in response[:RESPONSE_LENGTH]:
        flags.append(successor(previous) == symbol)  # successor is None outside the alphabet
        previous = symbol
    return flags


def score_response(last_prompt_symbol: str, response: str) -> float:
    """Fraction of the ``RESPONSE_LENGTH`` positions whose symbol is its predecessor plus one (mod alphabet)."""
    return sum(correct_positions(last_prompt_symbol, response)) / RESPONSE_LENGTH


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature; ``ground_truth`` is the prompt's last symbol."""
    return score_response(str(ground_truth), str(solution_str))
