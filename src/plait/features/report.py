"""The end of `plait train`: validation loss against the corpus's unigram entropy, the checkpoint written, and
a sample from the trained model (the EndReport callback; plait's own data and model only)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from plait.config import Config
from plait.data import eos_id, load_tokenizer
from plait.engine.callbacks import Callback, RunState
from plait.engine.checkpoint import checkpoint_dir, list_checkpoints
from plait.engine.generate import generate
from plait.engine.metrics import console, info
from plait.engine.validation import unigram_baseline
from plait.model import Transformer


class EndReport(Callback):
    """retriever(data_dir, model, device): a retrieval model's neighbours for the sample (the database's own
    encoder: plait.lifecycle.retrieval.database_retriever, passed by plait.api); without it a retrieval model's
    report names the `plait generate` command instead."""

    def __init__(self, retriever=None) -> None:
        self.retriever = retriever

    def on_end(self, run: RunState, final: dict[str, float]) -> None:
        if not run.env.is_main or run.data_dir is None or not run.plait_model:
            return
        whole = run.t.model if run.env.world_size == 1 and not run.t.fsdp else None
        with torch.compiler.set_stance("force_eager"):  # sampling changes shapes every token
            _report(run.cfg, whole, run.data_dir, final, run.env.device, self.retriever)


SAMPLE_FROM_CHECKPOINT_MAX_PARAMS = 2e9
"""After a run whose model is sharded, the main rank samples from the final checkpoint loaded whole on its
device, up to this size; larger runs print the `plait generate` command instead."""


def _report(
    cfg: Config, model: Transformer | None, data_dir: Path, final: dict[str, float], device: torch.device, retriever
) -> None:
    if "val_loss" in final:
        # the unigram baseline reads the whole validation split: for one local corpus only (a mixture's
        # total weighs its sources; a corpus on S3 is not downloaded for it)
        entropy = unigram_baseline(cfg, data_dir)
        baseline = f"unigram entropy of the corpus: {entropy:.3f}; " if entropy is not None else ""
        info(
            f"validation loss {final['val_loss']:.3f} nats/token "
            f"({baseline}a model that learned nothing scores {math.log(cfg.model.vocab_size):.3f})"
        )
    ckpts = list_checkpoints(checkpoint_dir(cfg))
    if ckpts:
        info(f"checkpoint: {ckpts[-1]}")
    sampling = cfg.sample.prompt and cfg.sample.max_new_tokens
    if sampling and cfg.model.retrieval_ids and retriever is None:
        info(f"no sample here (a retrieval model samples with its database's encoder): plait generate {cfg.run_dir}")
        return
    if model is None and sampling and ckpts and cfg.model.num_params() <= SAMPLE_FROM_CHECKPOINT_MAX_PARAMS:
        from plait.engine.generate import load_for_generation

        model = load_for_generation(ckpts[-1], str(device))[0]  # the sharded model, whole on this rank
    elif model is None and sampling and ckpts:
        info(f"sample with: plait generate {cfg.run_dir}")
    if model is not None and cfg.sample.prompt and cfg.sample.max_new_tokens:
        tok = load_tokenizer(data_dir / "tokenizer.json")
        ids = tok.encode(cfg.sample.prompt).ids
        s = cfg.sample
        # RETRO: each new chunk's neighbours from the database, by its own encoder
        retrieve = retriever(data_dir, model, str(device)) if cfg.model.retrieval_ids else None
        out = generate(
            model,
            [ids],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            eos_id=eos_id(tok),
            seed=cfg.run.seed,
            retrieve=retrieve,
        )
        console.rule("sample")
        print(tok.decode(out[0]), flush=True)
        console.rule()
