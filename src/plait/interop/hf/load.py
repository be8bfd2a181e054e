"""Import: a Hugging Face directory or a plain safetensors file read back, safetensors only (never pickle),
one tensor (or one rank's box of one) at a time, every shape checked first."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from plait.core.errors import PlaitError
from plait.interop.hf.config import args_from_hf_config, hf_family, hf_shapes
from plait.interop.hf.names import (
    EXPERT_NAMES,
    PICKLE_SUFFIXES,
    SAFETENSORS_FORMAT,
    check_tensors,
    first_few,
    hf_pieces,
    param_shapes,
    saved_tensors,
)
from plait.model.build import empty_model
from plait.model.llama import ModelArgs, Transformer


@dataclasses.dataclass(frozen=True)
class HFWeights:
    """A Hugging Face directory whose config and tensor names and shapes are checked, read one tensor (or one
    box of one) at a time. A read opens its file with safetensors, which maps it: the tensor returned is a
    view of the mapping, so the process holds only the pages that are touched, and only while the tensor (or
    a copy made from it, e.g. ``.float()``) is alive."""

    path: Path
    args: ModelArgs
    config: dict
    locations: dict[str, list[tuple[Path, str]]]  # plait name -> its (file, Hugging Face name) pieces
    shapes: dict[str, tuple[int, ...]]  # plait name -> full shape

    def read(self, name: str, offset: Sequence[int] | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Parameter ``name`` (plait's name) in its stored dtype; with ``offset`` and ``shape`` only that box
        of it (one rank's shard), read without the rest. Stacked experts are read expert by expert (only those
        in the box); the MoE routing bias, absent from Hugging Face files, reads as zeros."""
        full = self.shapes[name]
        shape = tuple(shape) if shape is not None else full
        offset = tuple(offset) if offset is not None else (0,) * len(full)
        box = tuple(zip(offset, shape, strict=True))
        pieces = self.locations[name]
        if not pieces:
            return torch.zeros(shape)
        if not name.endswith(tuple(EXPERT_NAMES)):
            file, key = pieces[0]
            return _read_tensor(file, key, None if shape == full else box)
        return torch.stack([_read_tensor(*pieces[e], box[1:]) for e in range(offset[0], offset[0] + shape[0])])


def _read_tensor(file: Path, key: str, box: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, or the box (offset, size) per dimension of it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            if box is None:
                return f.get_tensor(key)
            return f.get_slice(key)[tuple(slice(o, o + n) for o, n in box)]
    except (SafetensorError, OSError) as e:
        raise PlaitError(f"cannot read {key} from {file}: {e}") from None


def open_hf(hf_dir: str | Path) -> HFWeights:
    """Check a Hugging Face directory (config.json, the safetensors files, every tensor's name and shape)
    without reading any tensor, except to compare lm_head with the embeddings of a tied config.

    The tensors are ``Transformer.named_parameters``: with tied embeddings no ``output.weight``; Qwen2's q/k/v
    biases included; ``rotary_emb.inv_freq`` buffers of old checkpoints are ignored (they are derived).
    """
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise PlaitError(f"{hf_dir} has no config.json: give a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlaitError(f"{config_path} is not valid JSON: {e}") from None
    args = args_from_hf_config(config, str(config_path))
    expected = hf_shapes(args)
    where = str(hf_dir)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}  # HF name -> (file, shape)
    for file in _weight_files(hf_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                entries = [(n, tuple(handle.get_slice(n).get_shape())) for n in handle.keys()]  # noqa: SIM118
        except (SafetensorError, OSError) as e:
            raise PlaitError(f"cannot read {file}: {e}") from None
        for name, shape in entries:
            if name in found:
                raise PlaitError(f"{where}: tensor {name} appears in more than one file")
            if not name.endswith("rotary_emb.inv_freq"):
                found[name] = (file, shape)
    if args.tie_embeddings and "lm_head.weight" in found:
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        if embed in found and not torch.equal(_read_tensor(found[head][0], head), _read_tensor(found[embed][0], embed)):
            raise PlaitError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from {embed}; "
                f"set tie_word_embeddings to false in config.json if the output projection is separate"
            )
        del found["lm_head.weight"]
    check_tensors({n: shape for n, (_, shape) in found.items()}, expected, where)
    shapes = param_shapes(args)
    family = hf_family(args)
    locations = {name: [(found[p][0], p) for p, _ in hf_pieces(name, shape, family)] for name, shape in shapes.items()}
    return HFWeights(hf_dir, args, config, locations, shapes)


def import_hf(hf_dir: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(ModelArgs, plait-named tensors in their stored dtype) from a Hugging Face directory: every tensor
    at once, as views of the mapped files (``open_hf`` reads them one at a time)."""
    hf = open_hf(hf_dir)
    return hf.args, {name: hf.read(name) for name in param_shapes(hf.args)}


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise PlaitError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PlaitError(f"{index} names shards that are missing: {first_few(absent)}")
        return files
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise PlaitError(
            f"{hf_dir} holds only PyTorch pickle weights ({first_few(pickles)}); plait reads safetensors and "
            f"never unpickles: convert it to safetensors first, where you trust the file (e.g. "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir))"
        )
    raise PlaitError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json")


def load_hf_model(hf_dir: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """A plait Transformer (fp32) holding the weights of a Hugging Face directory, read one tensor at a time
    into it."""
    hf = open_hf(hf_dir)
    model = empty_model(hf.args, device)
    with torch.no_grad():
        for name, tensor in saved_tensors(model):
            tensor.copy_(hf.read(name))
    return model


def load_safetensors(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """A plait Transformer from a file written by ``export_safetensors``."""
    path = Path(path)
    if not path.is_file():
        raise PlaitError(f"{path} does not exist: give a .safetensors file written by plait")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("plait_format") != SAFETENSORS_FORMAT or "model_args" not in meta:
                raise PlaitError(
                    f"{path} is not a plait safetensors export (no model_args in its metadata); "
                    f"for a Hugging Face directory use load_hf_model"
                )
            args = _args_from_json(meta["model_args"], path)
            names = list(f.keys())
            check_tensors({n: f.get_slice(n).get_shape() for n in names}, param_shapes(args), str(path))
            tensors = {n: f.get_tensor(n) for n in names}
    except SafetensorError as e:
        raise PlaitError(f"cannot read {path}: {e}") from None
    return build_from_tensors(args, tensors, device)


def _args_from_json(text: str, where: Path) -> ModelArgs:
    values = json.loads(text)
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlaitError(f"{where}: unknown model settings {', '.join(unknown)} (written by a newer plait?)")
    return ModelArgs(**values)


def build_from_tensors(
    args: ModelArgs, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> Transformer:
    """A Transformer of shape ``args`` holding ``tensors`` (checked names and shapes, cast to fp32)."""
    check_tensors({k: v.shape for k, v in tensors.items()}, param_shapes(args), "the given tensors")
    model = empty_model(args, device)
    state = dict(tensors)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model
