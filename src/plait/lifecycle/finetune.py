"""Fine-tuning: start from any plait checkpoint or Hugging Face directory, full or with LoRA adapters, on plain
or instruction data.

- ``apply_finetune`` (the ``Finetune`` callback's ``on_model``, before the optimizers exist): it loads
  ``finetune.init_from`` into the freshly built model parts (any layout), then, with ``finetune.lora_rank``,
  adds adapters and freezes the base, so the optimizer only ever sees the adapters.
- ``prepare_instructions`` turns JSONL records ``{"prompt": ..., "response": ...}`` into token shards plus a
  per-token loss mask (0 on the prompt), which the loader turns into targets of -100: only the response is
  learned. Continued pre-training needs nothing special: ``init_from`` plus a new ``data.source``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from plait.config import Config
from plait.core.errors import ConfigError, PlaitError
from plait.core.publish import staged_dir
from plait.core.storage import Location
from plait.data.chat import (
    ChatTemplate,
    chat_files,
    chat_tokens,
    check_messages,
    load_chat_template,
    missing_markers,
    named_chat_template,
)
from plait.data.inputs import jsonl_records
from plait.engine.callbacks import Callback, RunState
from plait.engine.checkpoint import list_checkpoints, load_model_weights, read_meta, resolve_checkpoint
from plait.interop.peft import PeftAdapter, is_peft_adapter, read_peft_adapter
from plait.lifecycle.lora import apply_lora_config, is_lora_param, parse_targets
from plait.model.llama import ModelArgs, canonical_name

DEFAULT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


# --------------------------------------------------------------------------------------------- the trainer


def apply_finetune(cfg: Config, parts: list[nn.Module], meshes=None) -> None:
    """Load ``finetune.init_from`` (unless the run resumes from its own checkpoint) and add LoRA adapters.

    Works on the parts as built by any layout: the weights are loaded by parameter name, each rank keeping its
    shard. With adapters under data parallelism the base stays sharded (FSDP2) and frozen, while the small
    adapters are replicated plain tensors whose gradients are averaged by ``_sync_adapter_grads``.
    """
    f = cfg.finetune
    if not f.init_from and not f.lora_rank:
        return
    ckpts = list_checkpoints(cfg.run_dir / "checkpoints")
    if f.lora_rank and ckpts and read_meta(ckpts[-1]).get("weights_only"):
        raise ConfigError(
            f"{cfg.run_dir} holds an imported (weights-only) checkpoint; a LoRA fine-tune writes a run of its own: "
            f"pass --finetune.init_from={cfg.run_dir} --run.name=<a new name>"
        )
    peft = read_peft_adapter(f.init_from) if f.init_from and is_peft_adapter(f.init_from) else None
    if peft is not None:
        _check_peft_settings(peft, f)
    if f.init_from and not ckpts:  # with checkpoints the trainer resumes them instead
        load_init_weights(parts, peft.base if peft is not None else f.init_from, cfg.model)
    if f.lora_rank:
        for part in parts:
            apply_lora_config(part, f, cfg.run.seed)
            if peft is not None and not ckpts:  # continue the adapter trained elsewhere
                _load_peft_tensors(part, peft, f.init_from)
        if meshes is not None and meshes.dims.dp_cp > 1:
            _sync_adapter_grads(parts, meshes.loss.get_group(), meshes.dims.dp_cp)


def base_weights_ref(init_from: str) -> str:
    """The weights a fine-tune starts from: finetune.init_from, or a PEFT adapter's base."""
    return read_peft_adapter(init_from).base if is_peft_adapter(init_from) else init_from


def _check_peft_settings(peft: PeftAdapter, f) -> None:
    """A PEFT adapter continues with its own rank, scale and targets, and from a base on this machine."""
    targets = ",".join(peft.targets)
    if (f.lora_rank, f.lora_alpha, sorted(parse_targets(f.lora_targets))) != (
        peft.rank, peft.alpha, sorted(peft.targets)
    ):  # fmt: skip
        raise ConfigError(
            f"finetune.init_from={f.init_from} is a PEFT adapter of rank {peft.rank}, lora_alpha {peft.alpha:g} on "
            f"{targets}: continue it with finetune.lora_rank={peft.rank} finetune.lora_alpha={peft.alpha:g} "
            f"finetune.lora_targets={targets}"
        )
    if not peft.base or not Path(peft.base).exists():
        raise ConfigError(
            f"the PEFT adapter {f.init_from} names its base as {peft.base!r} (adapter_config.json's "
            "base_model_name_or_path), which is not a directory here: set it to the base's transformers "
            "directory (or plait run)"
        )


def _load_peft_tensors(part: nn.Module, peft: PeftAdapter, where: str) -> None:
    params = {canonical_name(n): p for n, p in part.named_parameters() if is_lora_param(n)}
    if set(params) != set(peft.tensors):
        missing, extra = sorted(set(params) - set(peft.tensors))[:3], sorted(set(peft.tensors) - set(params))[:3]
        raise ConfigError(f"the PEFT adapter {where} does not fit this model (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for name, param in params.items():
            value = peft.tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(
                    f"the PEFT adapter {where}: {name} is {tuple(value.shape)}, the model's {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))


class Finetune(Callback):
    """apply_finetune on the built model, before its optimizers exist (finetune.init_from, LoRA)."""

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        apply_finetune(run.cfg, parts, run.meshes)


def _sync_adapter_grads(parts: list[nn.Module], group, dp: int) -> None:
    """Communication plan: each adapter gradient is all-reduced (sum, then divided by dp x cp) over the
    ranks holding different tokens (data- and context-parallel) as autograd produces it, one small all-reduce
    per adapter tensor and micro-batch. A tensor hook runs before accumulation, so micro-batches add
    already-averaged gradients. FSDP2 reduces the (frozen, gradient-free) base as before, which is nothing."""

    def average(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / dp

    for part in parts:
        for name, param in part.named_parameters():
            if is_lora_param(name):
                param.register_hook(average)


def load_init_weights(parts: list[nn.Module], ref: str, args: ModelArgs) -> dict[str, Any]:
    """Copy the weights of a plait checkpoint / run directory or a Hugging Face directory into ``parts``
    (possibly sharded or pipeline stages); refuses a model of another shape. Returns what was loaded."""
    kind, path = resolve_weights(ref)
    if kind == "hf":
        from plait.interop.hf import open_hf
        from plait.parallel.parallelize import load_local_shard

        assert isinstance(path, Path)  # resolve_weights gives 'hf' only for a local directory
        hf = open_hf(path)
        check_same_model(hf.args, args, ref)
        for part in parts:
            for name, param in part.named_parameters():
                # each rank reads only the box of each tensor its shard covers (a slice of the mapped file)
                load_local_shard(param, partial(hf.read, canonical_name(name)))
    else:
        config = read_meta(path).get("config", {})
        if config.get("finetune", {}).get("lora_rank"):
            raise ConfigError(
                f"finetune.init_from={ref} is a LoRA run's checkpoint (base + unmerged adapters); merge it first: "
                f"plait finetune merge {ref} --out DIR, then start from DIR"
            )
        check_same_model(ModelArgs(**config.get("model", {})), args, ref)
        for part in parts:
            load_model_weights(part, path)
    return {"kind": kind, "path": str(path)}


def resolve_weights(ref: str | Path) -> tuple[str, Location]:
    """('hf', dir) for a Hugging Face directory, ('checkpoint', step dir) for a plait checkpoint or run (local
    or s3://)."""
    path = ref if str(ref).startswith("s3://") else Path(ref).expanduser()
    if isinstance(path, Path) and (path / "config.json").is_file() and not (path / "plait.json").is_file():
        return "hf", path

    try:
        return "checkpoint", resolve_checkpoint(path)
    except PlaitError as e:
        raise ConfigError(f"finetune.init_from={ref}: {e}") from None


def check_same_model(found: ModelArgs, expected: ModelArgs, where: str) -> None:
    """Refuse weights of another shape, or with other rotary/norm settings (max_seq_len may differ)."""
    skip = {"max_seq_len", "multiple_of", "ffn_dim_multiplier", "ffn_hidden_dim"}
    a, b = dataclasses.asdict(found), dataclasses.asdict(expected)
    diff = [f"model.{k}: {a[k]!r} there, {b[k]!r} here" for k in a if k not in skip and a[k] != b[k]]
    if found.hidden_dim != expected.hidden_dim:
        diff.append(f"model.ffn_hidden_dim: {found.hidden_dim} there, {expected.hidden_dim} here")
    if diff:
        raise ConfigError(
            f"finetune.init_from={where} holds another model ({'; '.join(diff[:4])}); start from its config "
            f"(the config.toml of its run, or `plait ckpt import` for a Hugging Face directory)"
        )


# ------------------------------------------------------------------------------------------ instruction data


def _records(path: Path, prompt_field: str, response_field: str):
    """(where, a conversation: list of {role, content}, whether the record is one) per record: its "messages",
    or its prompt and response as a user turn and an assistant turn."""
    for where, record in jsonl_records(path):
        if "messages" in record:
            yield where, check_messages(record["messages"], where), True
            continue
        if not all(isinstance(record.get(k), str) for k in (prompt_field, response_field)):
            raise ConfigError(
                f"{where} needs string fields {prompt_field!r} and {response_field!r}, or 'messages' (a conversation)"
            )
        turns = [
            {"role": "user", "content": record[prompt_field]},
            {"role": "assistant", "content": record[response_field]},
        ]
        yield where, turns, False


def _is_val(index: int, messages: list[dict], val_fraction: float) -> bool:
    # index, then each turn's text: for {prompt, response} records the same digest as ever (the same split)
    texts = [m["content"] for m in messages]
    digest = hashlib.sha1("\0".join([str(index), *texts]).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def prepare_instructions(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path,
    template: str | None = None,
    chat_template: str | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
    val_fraction: float = 0.1,
    train_on_prompt: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenise instruction records into a prepared directory with loss masks; returns its manifest.

    A record is a conversation (``{"messages": [{"role", "content"}, ...]}``) or a prompt and a response (a
    user turn and an assistant turn). With a chat template (plait.data.chat: the tokenizer directory's own, or
    ``chat_template``: a built-in name such as "chatml", or a .jinja file) each conversation is rendered as it
    is served, its ids those of ``apply_chat_template``, and only the assistant turns are learned; the template
    travels in the directory (chat_template.jinja) and its manifest (``loss_mask.chat_template``: name, source,
    sha256, text). With ``template`` (a format with {prompt}), or where there is no chat template, a
    prompt/response record becomes ``template.format(prompt=...)`` + response (default: DEFAULT_TEMPLATE) and
    the response is learned; conversations then need a chat template.
    Each record ends with EOS (unless its tokens already do), learned where its last turn is the assistant's.
    ``train_on_prompt`` learns every token. The directory has the ``plait-tokens-v1`` layout the trainer
    reads (``--data.source=DIR``), plus ``<split>_mask_*.bin`` files.
    """
    from plait.data import eos_id, load_tokenizer

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    files = _instruction_files(inputs, template, chat_template, val_fraction)
    tok = load_tokenizer(tokenizer)
    eos = eos_id(tok)
    dtype = np.dtype("<u2") if tok.get_vocab_size(with_added_tokens=True) <= 65535 else np.dtype("<u4")
    chat: ChatTemplate | None
    if chat_template is not None:
        chat = named_chat_template(chat_template, tokenizer)
    else:
        chat = load_chat_template(tokenizer) if template is None else None
    docs, sources = _tokenised(
        files, tok, eos, dtype, chat or template or DEFAULT_TEMPLATE, prompt_field, response_field, val_fraction,
        train_on_prompt,
    )  # fmt: skip
    exists = ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    with staged_dir(out, overwrite=overwrite, exists_error=exists) as tmp:
        splits = {split: _write_split(tmp, split, items, dtype) for split, items in docs.items()}
        _copy_tokenizer(tmp, tokenizer, chat, named=chat_template is not None)
        mask = {
            "template": template or DEFAULT_TEMPLATE if chat is None else None,
            "chat_template": None if chat is None else _template_record(chat, tok),
            "train_on_prompt": train_on_prompt,
        }
        manifest = _instruction_manifest(tmp, tok, eos, dtype, splits, sources, mask)
    return manifest


def _instruction_files(inputs, template: str | None, chat_template: str | None, val_fraction: float) -> list[Path]:
    """The inputs, once the settings are checked (before any work)."""
    if template is not None and "{prompt}" not in template:
        raise ConfigError(f"the prompt template {template!r} must contain {{prompt}}")
    if template is not None and chat_template is not None:
        raise ConfigError("--template (a prompt format) and --chat-template exclude each other: give one")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must be in [0, 1)")
    files = [Path(p) for p in inputs]
    for path in files:
        if not path.is_file() or not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise ConfigError(f"instruction input {path} must be an existing .jsonl or .jsonl.gz file")
    return files


def _copy_tokenizer(tmp: Path, tokenizer: str | Path, chat: ChatTemplate | None, named: bool) -> None:
    """tokenizer.json, and the chat template the data was rendered with, so runs on it carry the template on:
    the tokenizer's own files, or (a named one) its tokenizer_config.json (special tokens) and
    chat_template.jinja, which a reader prefers to the config's template."""
    root = Path(tokenizer)
    shutil.copyfile(root / "tokenizer.json" if root.is_dir() else root, tmp / "tokenizer.json")
    if chat is None:
        return
    if not named:
        for path in chat_files(tokenizer):
            shutil.copyfile(path, tmp / path.name)
        return
    config = (root if root.is_dir() else root.parent) / "tokenizer_config.json"
    if config.is_file():
        shutil.copyfile(config, tmp / config.name)
    (tmp / "chat_template.jinja").write_text(chat.text, encoding="utf-8")


def _template_record(chat: ChatTemplate, tok) -> dict[str, Any]:
    """The manifest's loss_mask.chat_template: the template's name (a built-in's), where it came from, its
    text and hash, and the <|...|> markers it prints that the tokenizer spells out in ordinary tokens."""
    return {
        "name": chat.name,
        "source": chat.source,
        "sha256": hashlib.sha256(chat.text.encode()).hexdigest(),
        "text": chat.text,
        "markers_spelled_out": missing_markers(chat, tok),
    }


def _instruction_manifest(tmp: Path, tok, eos: int, dtype, splits, sources, loss_mask) -> dict[str, Any]:
    from plait.data.loader import FORMAT, MANIFEST

    manifest = {
        "format": FORMAT,
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_id": eos,
        "splits": splits,
        "sources": sources,
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest(),
        "loss_mask": loss_mask,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _tokenised(files, tok, eos: int, dtype, template: ChatTemplate | str, prompt_field: str, response_field: str,
               val_fraction: float, train_on_prompt: bool):  # fmt: skip
    """({"train": [(ids, mask), ...], "val": [...]}, the sources): each record's tokens (rendered with the
    chat template, or the prompt template for prompt/response records), its mask (1 on what is learned: the
    assistant turns, or everything with train_on_prompt) and EOS, its split drawn from its content."""
    docs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
    sources, index = [], 0
    for path in files:
        records = list(_records(path, prompt_field, response_field))
        if not records:
            raise ConfigError(f"{path} has no records")
        sources.append({"path": str(path.resolve()), "num_documents": len(records)})
        if isinstance(template, ChatTemplate):
            encoded = chat_tokens(tok, template, [(messages, where) for where, messages, _ in records])
        else:
            talks = [where for where, _, conversation in records if conversation]
            if talks:
                raise ConfigError(
                    f"{talks[0]} is a conversation ('messages'): it is rendered with the tokenizer's chat template; "
                    "pass --tokenizer as a tokenizer directory with one (tokenizer_config.json 'chat_template' or "
                    "chat_template.jinja), or --chat-template chatml (or plain, or a .jinja file), and no --template"
                )
            encoded = _formatted(tok, template, [messages for _, messages, _ in records])
        for (_, messages, _), (ids, mask) in zip(records, encoded, strict=True):
            if not ids or ids[-1] != eos:  # the document separator, learned after a final assistant turn
                ids = [*ids, eos]
                mask = np.append(mask, np.uint8(messages[-1]["role"] == "assistant"))
            if train_on_prompt:
                mask[:] = 1
            split = "val" if _is_val(index, messages, val_fraction) else "train"
            docs[split].append((np.array(ids, dtype=dtype), mask))
            index += 1
    if val_fraction > 0 and not docs["val"] and len(docs["train"]) >= 2:
        docs["val"].append(docs["train"].pop())
    return docs, sources


def _formatted(tok, template: str, conversations: list[list[dict]]) -> list[tuple[list[int], np.ndarray]]:
    """Prompt/response records through a prompt template: template(prompt) then the response, learned (the
    prompts and the responses each tokenised in one batch)."""
    prompts = tok.encode_batch(
        [template.format(prompt=m[0]["content"]) for m in conversations], add_special_tokens=False
    )
    responses = tok.encode_batch([m[1]["content"] for m in conversations], add_special_tokens=False)
    return [
        ([*p.ids, *r.ids], np.array([0] * len(p.ids) + [1] * len(r.ids), dtype=np.uint8))
        for p, r in zip(prompts, responses, strict=True)
    ]


def _write_split(tmp: Path, split: str, items: list, dtype) -> dict[str, Any]:
    """One split's tokens and loss mask as one shard each (with their hashes); its manifest entry."""
    tokens = np.concatenate([i for i, _ in items]) if items else np.zeros(0, dtype=dtype)
    masks = np.concatenate([m for _, m in items]) if items else np.zeros(0, dtype=np.uint8)
    shard: dict[str, Any] = {
        "file": f"{split}_00000.bin",
        "mask_file": f"{split}_mask_00000.bin",
        "num_tokens": len(tokens),
    }
    for key, array in (("file", tokens), ("mask_file", masks)):
        data = array.tobytes()
        (tmp / shard[key]).write_bytes(data)
        shard["sha256" if key == "file" else "mask_sha256"] = hashlib.sha256(data).hexdigest()
    return {
        "shards": [shard],
        "num_tokens": len(tokens),
        "num_documents": len(items),
        "num_target_tokens": int(masks.sum()),
    }
