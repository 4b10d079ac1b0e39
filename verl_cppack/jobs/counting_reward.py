"""The counting task's reward, verl's ``custom_reward_function`` (``reward.custom_reward_function.path`` = this file).

verl loads this file by path, outside any package, so it imports nothing but the standard library. A response
earns, for each of its first ``RESPONSE_LENGTH`` symbols, 1 / ``RESPONSE_LENGTH`` when the symbol is its
predecessor plus one modulo the alphabet (the predecessor of the first is the prompt's last symbol); a response
that stops early forfeits the missing positions.
"""

SYMBOLS = "0123456789abcdef"
RESPONSE_LENGTH = 6


def score_response(last_prompt_symbol: str, response: str) -> float:
    """Fraction of the ``RESPONSE_LENGTH`` positions whose symbol is its predecessor plus one (mod alphabet)."""
    position = {symbol: index for index, symbol in enumerate(SYMBOLS)}
    previous, correct = last_prompt_symbol, 0
    for symbol in response[:RESPONSE_LENGTH]:
        if previous in position and symbol in position and position[symbol] == (position[previous] + 1) % len(SYMBOLS):
            correct += 1
        previous = symbol
    return correct / RESPONSE_LENGTH


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature; ``ground_truth`` is the prompt's last symbol."""
    return score_response(str(ground_truth), str(solution_str))
