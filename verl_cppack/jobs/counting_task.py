"""The counting task, made locally for verl's trainer: a tiny Llama, a character tokenizer, parquet data, a reward.

Every asset is made once (nothing can be downloaded) into one cached directory, every Ray worker's working
directory. A prompt is 2..6 symbols; a correct response counts on from it (``"3a"`` -> ``"bcdef0"``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_cppack.jobs import counting_reward
from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, SYMBOLS, score_response

PAD, EOS = "<pad>", "</s>"
MIN_PROMPT_SYMBOLS, MAX_PROMPT_SYMBOLS = 2, 6
DATA_SOURCE = "verl_cppack/counting"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
CACHE_ENV = "VERL_CPPACK_CACHE"


@dataclass(frozen=True)
class CountingAssets:
    """Sizes of what is made; every field is part of the cache key."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 2  # head size 32: vLLM's CPU attention runs head sizes 32, 64, 80, ... only
    num_key_value_heads: int = 2
    train_prompts: int = 2048
    test_prompts: int = 64
    seed: int = 0
    version: int = 3  # bump when what is made changes (2: the reward file is part of the task directory)


def dataclass_key(value) -> str:
    """A short hash of a dataclass's fields: the name of what was made from them."""
    return hashlib.sha256(json.dumps(asdict(value), sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    """``$VERL_CPPACK_CACHE`` or ``~/.cache/verl_cppack``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "verl_cppack")


@dataclass(frozen=True)
class CountingPaths:
    root: Path

    model = property(lambda self: self.root / "model")
    train = property(lambda self: self.root / "train.parquet")
    test = property(lambda self: self.root / "test.parquet")
    reward = property(lambda self: self.root / "counting_reward.py")  # a copy of counting_reward.py, verl loads by path

    def relative(self, path: Path) -> str:
        """``path`` relative to the task directory: what a Ray worker whose working directory it is opens."""
        return str(path.relative_to(self.root))


def ensure_counting_assets(assets: CountingAssets = CountingAssets(), root: Path | None = None) -> CountingPaths:
    """Make the model, tokenizer and data under ``root`` (default: the cache) unless a complete copy exists."""

    def make(staging: Path) -> None:
        made = CountingPaths(staging)
        build_tokenizer().save_pretrained(made.model)
        save_tiny_llama(made.model, assets)
        write_dataset(made.train, assets.train_prompts, seed=assets.seed)
        write_dataset(made.test, assets.test_prompts, seed=assets.seed + 1)
        made.reward.write_text(Path(counting_reward.__file__).read_text())  # standard library only: it runs anywhere
        (staging / "assets.json").write_text(json.dumps(asdict(assets), indent=2, sort_keys=True))
        (staging / "complete").write_text("")

    return CountingPaths(made_once((root or cache_root()) / f"counting-{dataclass_key(assets)}", "complete", make))


def made_once(directory: Path, done: str, make: Callable[[Path], None]) -> Path:
    """``directory``, made by ``make(staging)`` unless ``directory/done`` exists; staged, so a crash leaves no copy."""
    if (directory / done).is_file():
        return directory
    staging = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        make(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(directory)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def build_tokenizer():
    """A character-level fast tokenizer: ``<pad>`` = 0, ``</s>`` = 1, then one id per symbol."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {PAD: 0, EOS: 1, **{symbol: index + 2 for index, symbol in enumerate(SYMBOLS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, unk_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_llama(directory: Path, assets: CountingAssets) -> None:
    """A randomly initialised ``LlamaForCausalLM`` (seeded), float32, sized by ``assets``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(SYMBOLS) + 2,
        hidden_size=assets.hidden_size,
        intermediate_size=assets.intermediate_size,
        num_hidden_layers=assets.num_layers,
        num_attention_heads=assets.num_attention_heads,
        num_key_value_heads=assets.num_key_value_heads,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(assets.seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)


def sample_prompt(rng: random.Random) -> str:
    length = rng.randint(MIN_PROMPT_SYMBOLS, MAX_PROMPT_SYMBOLS)
    return "".join(rng.choice(SYMBOLS) for _ in range(length))


def write_dataset(path: Path, num_prompts: int, seed: int) -> None:
    """``num_prompts`` rows in verl's RL dataset format (what ``RLHFDataset`` reads)."""
    import pandas as pd

    rng = random.Random(seed)
    prompts = [sample_prompt(rng) for _ in range(num_prompts)]
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "counting",
            "reward_model": {"style": "rule", "ground_truth": prompt[-1]},
            "extra_info": {"index": index},
        }
        for index, prompt in enumerate(prompts)
    ]
    pd.DataFrame(rows).to_parquet(path)


__all__ = ["RESPONSE_LENGTH", "SYMBOLS", "CountingAssets", "CountingPaths", "ensure_counting_assets", "score_response"]
