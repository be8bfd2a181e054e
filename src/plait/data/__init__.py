"""Data: tokenizers, corpus preparation into token shards, and the resumable DP-sharded loader."""

from plait.data.loader import TokenDataset, TokenLoader, read_manifest
from plait.data.prepare import bundled_corpus_path, ensure_prepared, expand_inputs, prepare, unigram_entropy
from plait.data.tokenizer import EOS, PAD, eos_id, load_tokenizer, train_bpe

__all__ = [
    "EOS",
    "PAD",
    "TokenDataset",
    "TokenLoader",
    "bundled_corpus_path",
    "ensure_prepared",
    "eos_id",
    "expand_inputs",
    "load_tokenizer",
    "prepare",
    "read_manifest",
    "train_bpe",
    "unigram_entropy",
]
