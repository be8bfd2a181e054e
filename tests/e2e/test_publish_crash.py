"""Every published directory survives a crash at any step of its publishing: the reader finds the old copy or
the new one, complete, never neither and never a half-written one.

Each publish runs the real command in this process (`plait ckpt import`, `plait ckpt export` as a transformers
directory, a safetensors file and a PEFT adapter, `plait data retrieve`, `plait compress quantize`): first one
that makes the old copy (where the command can replace one), then one that replaces it. A crash is injected at
one step of the second publish, caught at the renames that publish it (os.rename / os.replace naming the
output): once the content is written and nothing is renamed yet, once the old copy is moved aside, once the new
one is renamed in. Two views are checked:

- a hard crash (the process killed there): the disk as it was at that moment, copied aside;
- a failure in the process (an exception there): the disk once the command's own clean-up has run.

The table of (publish, crash point, how the copies are swapped) is the parametrisation. core.publish swaps the
old copy and the new one in one step where the system can (Linux's renameat2 RENAME_EXCHANGE): no moment
leaves neither. Where it cannot (another OS, a file system without it), two renames publish (the old copy
moved aside, then the new one renamed in), and the moment between them leaves neither at the output's name
(the old one is under a hidden name beside it): those cases are the expected failures, kept in the table so
that it says so."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.config import Config, to_dict

TINY = dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=16, max_seq_len=32)
TWO_RENAMES = (
    "without renameat2, core.publish moves the old copy aside, then renames the new one in: between the two, the "
    "output's name holds neither (a hard crash leaves the old copy under a hidden name beside it)"
)
SWAPS = ("exchange", "two renames")


class Crash(BaseException):
    """The injected crash: a BaseException, so no `except Exception` on the way takes it for a user error."""


# ------------------------------------------------------------------------------------------------ sources


def _model(seed: int):
    from plait.engine.trainer import build_model
    from plait.model import ModelArgs

    return build_model(ModelArgs(**TINY), torch.device("cpu"), seed)


def _weights_run(model, run: Path) -> Path:
    from plait.engine.checkpoint.weights import write_weights_checkpoint

    cfg = Config()
    cfg.model = model.args
    cfg.data.seq_len = 32
    cfg.data.source = str(run / "no-data")  # compress measures no perplexity: the data is gone
    cfg.run.name, cfg.run.out_dir = run.name, str(run.parent)
    write_weights_checkpoint(model, run / "checkpoints" / "step_00000000", config=to_dict(cfg), tokenizer_path=None,
                             extra={})  # fmt: skip
    return run


def _adapter(model, path: Path, seed: int) -> Path:
    from plait.lifecycle.lora import save_adapter
    from plait.model.lora import apply_lora

    apply_lora(model, 2, 4.0, "wq,wv", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(generator=torch.Generator().manual_seed(seed))
    return save_adapter(model, path, base_hash="", rank=2, alpha=4.0, targets="wq,wv")


@pytest.fixture(scope="module")
def sources(tmp_path_factory, data_dir) -> dict[str, Path]:
    """Two of each input (old, new): weights-only runs, transformers directories, LoRA adapters; and a tiny
    prepared corpus."""
    from plait.data.prepare import prepare
    from plait.interop.hf import export_hf

    root = tmp_path_factory.mktemp("sources")
    found: dict[str, Path] = {}
    for which, seed in (("old", 0), ("new", 1)):
        found[f"run_{which}"] = _weights_run(_model(seed), root / f"run_{which}")
        found[f"hf_{which}"] = export_hf(_model(seed), root / f"hf_{which}", tokenizer_path=None)
        found[f"adapter_{which}"] = _adapter(_model(seed), root / f"adapter_{which}.safetensors", seed)
    docs = [{"text": f"Document {i}: " + " ".join(f"word{(i * j) % 37}" for j in range(60))} for i in range(40)]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    prepare([root / "docs.jsonl"], root / "data", tokenizer=Path(data_dir) / "tokenizer.json", val_fraction=0.1)
    found["data"] = root / "data"
    return found


# ------------------------------------------------------------------------------------------------ publishes
# Each: (the output under the case's root, make the old copy or None, make the new one, which copy a path holds:
# "old", "new", None when absent; anything incomplete raises)


def _tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name)


def _which(value: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> str:
    if torch.equal(value, old):
        return "old"
    assert torch.equal(value, new), "the output holds weights of neither copy"
    return "new"


def _checkpoint_holds(ckpt: Path, s) -> str:
    from plait.engine.checkpoint.weights import load_checkpoint_model

    source = json.loads((ckpt / "plait.json").read_text())["imported_from"]["path"]
    weight = load_checkpoint_model(ckpt).tok_embeddings.weight  # every tensor read: a missing one raises
    assert source in (str(s["hf_old"].resolve()), str(s["hf_new"].resolve()))
    return _which(weight, _model(0).tok_embeddings.weight, _model(1).tok_embeddings.weight)


def _import(s, old: bool):
    hf = s["hf_old" if old else "hf_new"]
    return ["ckpt", "import", str(hf), "--out", "{out}", *([] if old else ["--overwrite"])]


def _import_holds(out: Path, s) -> str | None:
    if not out.exists():
        return None
    assert (out / "config.toml").is_file(), "a run directory without its config.toml"
    return _checkpoint_holds(out / "checkpoints" / "step_00000000", s)


def _export(fmt: str):
    def argv(s, old: bool):
        run = s["run_old" if old else "run_new"]
        return ["ckpt", "export", str(run), "--format", fmt, "--out", "{out}", *([] if old else ["--overwrite"])]

    return argv


def _hf_holds(out: Path, s) -> str | None:
    if not out.exists():
        return None
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    weight = _tensor(out / "model.safetensors", "model.embed_tokens.weight")
    return _which(weight, _model(0).tok_embeddings.weight, _model(1).tok_embeddings.weight)


def _safetensors_holds(out: Path, s) -> str | None:
    if not out.exists():
        return None
    weight = _tensor(out, "tok_embeddings.weight")
    return _which(weight, _model(0).tok_embeddings.weight, _model(1).tok_embeddings.weight)


def _peft(s, old: bool):
    adapter = s["adapter_old" if old else "adapter_new"]
    return ["ckpt", "export", str(adapter), "--format", "peft", "--out", "{out}", *([] if old else ["--overwrite"])]


def _peft_holds(out: Path, s) -> str | None:
    from plait.interop.peft import read_peft_adapter

    if not out.exists():
        return None
    name = "layers.0.attention.wq.lora_b"
    got = read_peft_adapter(out).tensors[name]
    return _which(got, _tensor(s["adapter_old"], name), _tensor(s["adapter_new"], name))


def _retrieve(s, old: bool):
    k = "2" if old else "3"
    return ["data", "retrieve", "{data}", "--encoder", "lexical", "--dim", "16", "--chunk", "8", "--k", k,
            *([] if old else ["--overwrite"])]  # fmt: skip


def _database_holds(out: Path, s) -> str | None:
    from plait.data.retrieval import neighbours, read_database

    if not out.exists():
        return None
    k = read_database(out.parent)["k"]
    assert neighbours(out.parent, "train").shape[1] == k  # the arrays are there and whole
    return {2: "old", 3: "new"}[k]


def _quantize(s, old: bool):
    return ["compress", "quantize", str(s["run_new"]), "--bits", "8", "--format", "plait", "--out", "{out}"]


def _quantized_holds(out: Path, s) -> str | None:
    if not out.exists():
        return None
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["bits"] == "8" and len(list(f.keys())) > 0
    return "new"


PUBLISHES = {  # name -> (output under the root, argv of a publish (old/new), which copy it holds, has an old copy)
    "hf import": ("runs/ft", _import, _import_holds, True),
    "hf export": ("hf", _export("hf"), _hf_holds, True),
    "safetensors export": ("st/model.safetensors", _export("safetensors"), _safetensors_holds, True),
    "peft export": ("peft", _peft, _peft_holds, True),
    "retrieval database": ("data/retrieval", _retrieve, _database_holds, True),
    "quantized model": ("q", _quantize, _quantized_holds, False),
}
POINTS = ("content written", "old copy moved aside", "new copy renamed in")
MOVED_ASIDE = {"hf import", "hf export", "peft export", "retrieval database"}  # two renames: a window between


def _cases():
    for swap in SWAPS:
        for name in PUBLISHES:
            for point in POINTS:
                window = swap == "two renames" and point == "old copy moved aside" and name in MOVED_ASIDE
                marks = [pytest.mark.xfail(strict=True, reason=TWO_RENAMES)] if window else []
                yield pytest.param(name, point, swap, marks=marks, id=f"{name}-{point}-{swap}".replace(" ", "_"))


# ------------------------------------------------------------------------------------------------ the test


class Injector:
    """Wraps os.rename and os.replace: at the chosen step of publishing `out` it copies the case's root aside
    (the disk a hard crash would leave) and raises Crash."""

    def __init__(self, root: Path, out: Path, point: str, image: Path):
        self.root, self.out, self.point, self.image = root, out, point, image
        self.fired = False
        self.rename, self.replace = os.rename, os.replace

    def _call(self, real, src, dst, *args, **kwargs):
        src, dst = Path(src), Path(dst)
        ours = not self.fired and self.out in (src, dst)
        if ours and self.point == "content written":
            self._crash()
        real(src, dst, *args, **kwargs)
        if ours and (self.point == "old copy moved aside" and src == self.out or
                     self.point == "new copy renamed in" and dst == self.out):  # fmt: skip
            self._crash()

    def _crash(self) -> None:
        self.fired = True
        shutil.copytree(self.root, self.image, symlinks=True)
        raise Crash(self.point)

    def _exchange(self, real, a, b) -> bool:
        """The one-step swap of the new copy (a) with the old one (b): before it, the content is written; after
        it, the new copy is in."""
        ours = not self.fired and Path(b) == self.out
        if ours and self.point == "content written":
            self._crash()
        swapped = real(a, b)
        if ours and swapped and self.point == "new copy renamed in":
            self._crash()
        return swapped

    def install(self, monkeypatch, swap: str) -> None:
        from plait.core import publish

        monkeypatch.setattr(os, "rename", lambda s, d, *a, **k: self._call(self.rename, s, d, *a, **k))
        monkeypatch.setattr(os, "replace", lambda s, d, *a, **k: self._call(self.replace, s, d, *a, **k))
        real = publish.exchange if swap == "exchange" else (lambda a, b: False)
        monkeypatch.setattr(publish, "exchange", lambda a, b: self._exchange(real, a, b))


@pytest.mark.parametrize(("name", "point", "swap"), _cases())
def test_a_crash_while_publishing_leaves_the_old_copy_or_the_new_one(name, point, swap, sources, tmp_path, monkeypatch):
    where, argv, holds, has_old = PUBLISHES[name]
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(sources["data"], root / "data")
    out = root / where

    def run(old: bool) -> int:
        args = [a.format(out=out, data=root / "data") for a in argv(sources, old)]
        return main(args)

    before = None
    if has_old:
        assert run(old=True) == 0
        before = holds(out, sources)
        assert before == "old"
    injector = Injector(root, out, point, tmp_path / "image")
    from plait.core.publish import exchange

    if swap == "exchange":  # this machine's temporary directory must be able to: else the case says nothing
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        assert exchange(tmp_path / "a", tmp_path / "b"), "renameat2 RENAME_EXCHANGE unavailable here"
    injector.install(monkeypatch, swap)
    try:
        code = run(old=False)
    except Crash:
        code = None
    monkeypatch.undo()
    allowed = {"old", "new"} if has_old else {None, "new"}
    if not injector.fired:  # this publish has no such step: it ran to the end
        moves_aside = swap == "two renames" and name in MOVED_ASIDE
        assert point == "old copy moved aside" and not moves_aside, f"{name} never reached {point!r}"
        assert code == 0 and holds(out, sources) == "new"
        return
    crashed = holds(tmp_path / "image" / where, sources)
    assert crashed in allowed, f"a hard crash at {point!r} leaves {crashed or 'nothing'} at {where}"
    failed = holds(out, sources)
    assert failed in allowed, f"a failure at {point!r} leaves {failed or 'nothing'} at {where}"
