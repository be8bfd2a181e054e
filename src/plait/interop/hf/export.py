"""Export: a plait model as a Hugging Face directory (config, safetensors shards, tokenizer files) or a plain
safetensors file, tensor by tensor."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from plait.core.errors import ConfigError, PlaitError
from plait.core.publish import staged_dir
from plait.data.chat import load_chat_template
from plait.interop.hf.config import hf_config, hf_family
from plait.interop.hf.names import (
    BOS_TOKENS,
    DTYPE_NAMES,
    PAD_TOKENS,
    SAFETENSORS_FORMAT,
    check_tensors,
    hf_pieces,
    param_shapes,
    saved_tensors,
)
from plait.interop.shards import DEFAULT_MAX_SHARD_SIZE, SafetensorsShards, parse_shard_size
from plait.model.llama import ModelArgs, Transformer


def model_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """One full tensor per parameter and persistent buffer (`saved_tensors`), plait names (tied weights once,
    as tok_embeddings.weight).

    Sharded (DTensor) parameters are gathered: with FSDP / TP every rank must call this.
    """
    tensors = {}
    for name, param in saved_tensors(model):
        t = param.detach()
        tensors[name] = t.full_tensor() if isinstance(t, DTensor) else t
    check_tensors({k: v.shape for k, v in tensors.items()}, param_shapes(model.args), "the model")
    return tensors


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    *,
    tokenizer_path: Path | None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a Hugging Face directory (of the ``hf_family`` of the model's shape): config.json, the weights
    (``model.safetensors``, or shards of at most ``max_shard_size`` with their index), generation_config.json
    and, given a tokenizer.json, the tokenizer (tokenizer.json + tokenizer_config.json).

    One parameter at a time is gathered (DTensors: every rank must call this), converted and written.
    Written to a temporary sibling directory and renamed into place; an existing non-empty ``out_dir`` is
    replaced only with ``overwrite=True``.
    """
    hf_family(model.args)  # refuses what no transformers family computes
    found = {name: tuple(p.shape) for name, p in saved_tensors(model)}  # a DTensor's shape is the full one
    check_tensors(found, param_shapes(model.args), "the model")
    with hf_export(
        out_dir,
        model.args,
        order=list(found),
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_size=max_shard_size,
    ) as write:
        for name, param in saved_tensors(model):
            t = param.detach()
            write(name, t.full_tensor() if isinstance(t, DTensor) else t)
    return Path(out_dir)


@contextlib.contextmanager
def hf_export(
    out_dir: str | Path,
    args: ModelArgs,
    *,
    order: Sequence[str],
    tokenizer_path: Path | None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Iterator[Callable[[str, torch.Tensor], None]]:
    """Stage a Hugging Face directory for a model of shape ``args`` and yield ``write(name, tensor)``, which
    takes every parameter (plait names), one at a time in any order, and writes it at once. ``order`` is the
    order the shards are cut in (transformers cuts its state dict's order). On a clean exit the config,
    generation config and tokenizer files are added and the directory is renamed into place."""
    family = hf_family(args)  # refuses what no transformers family computes, before anything is staged
    if dtype not in DTYPE_NAMES:
        raise PlaitError(f"dtype {dtype} is not supported for export; use torch.float32 or torch.bfloat16")
    max_bytes = parse_shard_size(max_shard_size)
    shapes = param_shapes(args)
    if sorted(order) != sorted(shapes):
        raise PlaitError(f"the export order names {sorted(set(order) ^ set(shapes))[:4]}, not the model's tensors")
    out = Path(out_dir)
    special = _special_tokens(Path(tokenizer_path)) if tokenizer_path is not None else {}
    with _staged_dir(out, overwrite) as tmp:
        pieces = {n: hf_pieces(n, shapes[n], family) for n in order}
        writer = SafetensorsShards(
            tmp,
            {p: tuple(shapes[n][1:]) if i is not None else shapes[n] for n in order for p, i in pieces[n]},
            dtype,
            max_bytes,
        )

        def write(name: str, tensor: torch.Tensor) -> None:
            if not pieces[name] and tensor.any():
                raise PlaitError(
                    f"{name} is not zero: this model balanced its experts with routing biases "
                    "(model.moe_bias_rate), which Mixtral's format cannot hold; the export would route differently"
                )
            for piece, index in pieces[name]:
                writer.add(piece, tensor if index is None else tensor[index])

        yield write
        writer.finish()
        _write_hf_files(tmp, args, special, tokenizer_path, dtype)


def _write_hf_files(
    tmp: Path, args: ModelArgs, special: dict[str, tuple[str, int]], tokenizer_path: Path | None, dtype: torch.dtype
) -> None:
    """config.json, generation_config.json and the tokenizer files of an export."""
    bos, eos, pad = special.get("bos_token"), special.get("eos_token"), special.get("pad_token")
    config = hf_config(args, dtype=dtype, bos_id=bos[1] if bos else None, eos_id=eos[1] if eos else None)
    if pad:
        config["pad_token_id"] = pad[1]
    _write_json(tmp / "config.json", config)
    generation = {  # greedy, as transformers' own default: sampling is the caller's choice
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        **({"pad_token_id": pad[1]} if pad else {}),
        "do_sample": False,
    }
    _write_json(tmp / "generation_config.json", generation)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": args.max_seq_len,
            "clean_up_tokenization_spaces": False,
            **{key: token for key, (token, _) in special.items()},
        }
        chat = load_chat_template(tokenizer_path)
        if chat is not None:  # served with the template it was fine-tuned with
            tok_config["chat_template"] = chat.text
        _write_json(tmp / "tokenizer_config.json", tok_config)


def _special_tokens(tokenizer_path: Path) -> dict[str, tuple[str, int]]:
    """{'eos_token' / 'bos_token' / 'pad_token': (text, id)} for those the tokenizer has."""
    from plait.data import eos_id, load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    found = {}
    with contextlib.suppress(ConfigError):
        eos = eos_id(tok)
        found["eos_token"] = (cast(str, tok.id_to_token(eos)), eos)  # eos_id found it by its text
    for key, candidates in (("bos_token", BOS_TOKENS), ("pad_token", PAD_TOKENS)):
        for text in candidates:
            if (idx := tok.token_to_id(text)) is not None:
                found[key] = (text, idx)
                break
    if "bos_token" not in found and "eos_token" in found:
        # No dedicated BOS (plait's own byte-level BPE, GPT-2's): plait's data puts EOS between documents, so
        # EOS is what precedes every document; GPT-2's config names <|endoftext|> as both, likewise.
        found["bos_token"] = found["eos_token"]
    return found


def export_safetensors(
    model: Transformer, path: str | Path, *, dtype: torch.dtype = torch.float32, overwrite: bool = False
) -> Path:
    """One safetensors file with plait's parameter names; the ModelArgs travel as JSON in its metadata."""
    path = Path(path)
    if path.is_dir():
        raise PlaitError(f"{path} is a directory; give a file path such as {path / 'model.safetensors'}")
    if path.exists() and not overwrite:
        raise PlaitError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in model_tensors(model).items()}
    metadata = {
        "format": "pt",
        "plait_format": SAFETENSORS_FORMAT,
        "model_args": json.dumps(dataclasses.asdict(model.args)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _staged_dir(out: Path, overwrite: bool):
    exists = PlaitError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    return staged_dir(out, overwrite=overwrite, exists_error=exists)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
