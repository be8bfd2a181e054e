"""Byte-level BPE tokenizers: train one on a corpus, or load any Hugging Face `tokenizer.json`."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.core.errors import ConfigError

EOS = "<|endoftext|>"
PAD = "<|pad|>"

# End-of-document tokens used by common pretrained tokenizers, tried when EOS is absent.
_FALLBACK_EOS = ("</s>", "<|end_of_text|>", "<eos>")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with EOS at id 0 and PAD at id 1.

    The full byte alphabet is seeded so any input encodes without unknown tokens.
    """
    num_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < num_bytes + 2:
        raise ConfigError(f"vocab_size={vocab_size} is too small: byte-level BPE needs >= {num_bytes + 2}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],  # order fixes their ids: EOS=0, PAD=1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json` (a file, or a directory containing one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer file {path} does not exist: give the path of a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ConfigError(f"tokenizer file {path} is not a valid tokenizer.json: {e}") from e


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token, trying common spellings used by pretrained tokenizers."""
    for name in (EOS, *_FALLBACK_EOS):
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    tried = ", ".join((EOS, *_FALLBACK_EOS))
    raise ConfigError(f"tokenizer has no end-of-document token (tried {tried}); add one to its vocabulary")
