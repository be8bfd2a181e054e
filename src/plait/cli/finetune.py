"""`plait finetune prepare|merge|generate`: instruction data, adapters folded in, many adapters in one batch.

plait finetune prepare DATA.jsonl --out DIR --tokenizer TOKENIZER_DIR [--chat-template chatml|plain|FILE.jinja]
plait finetune merge ADAPTER_OR_LORA_RUN --out DIR [--format plait|hf]
plait finetune generate BASE --adapter A --adapter B --prompt TEXT   (all adapters in one batch)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from plait.cli.args import PlaitParser
from plait.cli.lifecycle import open_registry_near, registry_arg
from plait.core.errors import ConfigError, PlaitError

if TYPE_CHECKING:
    from plait.model.llama import Transformer


def cmd_finetune(argv: list[str]) -> int:
    parser = PlaitParser(prog="plait finetune", description="Instruction data, adapters, serving.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser(
        "prepare", help="Tokenise conversations or {prompt, response} JSONL: only the assistant's turns are learned."
    )
    p.add_argument(
        "inputs", nargs="+", help=".jsonl / .jsonl.gz files of records: {messages: [...]} or prompt and response."
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--tokenizer",
        required=True,
        help="The base model's tokenizer directory (its chat template renders the records) or tokenizer.json.",
    )
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE.jinja",
        help="The chat template, for a tokenizer without one (plait's own, base models) or in place of its own: "
        "a built-in (chatml, plain) or a .jinja file; recorded in the data and carried by its runs and exports.",
    )
    p.add_argument(
        "--template",
        help="Prompt format with {prompt} for prompt/response records, in place of the chat template; without "
        "either: '### Instruction: ... ### Response:'.",
    )
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--response-field", default="response")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--train-on-prompt", action="store_true", help="Count the prompt's tokens in the loss too.")
    p.add_argument("--overwrite", action="store_true")
    m = sub.add_parser("merge", help="Fold an adapter into its base: a plain model (plait run or HF directory).")
    m.add_argument("source", help="An adapter file, or a LoRA run / checkpoint directory.")
    m.add_argument("--out", required=True)
    m.add_argument("--base", help="For an adapter file: its base (default: the path it records).")
    m.add_argument("--format", choices=["plait", "hf"], default="plait")
    registry_arg(m)
    g = sub.add_parser("generate", help="Run several adapters of one base in one batch (shared stem).")
    g.add_argument("base", help="The base model (checkpoint / run / HF directory).")
    g.add_argument("--adapter", action="append", required=True, metavar="[NAME=]PATH", help="Repeat for more.")
    g.add_argument("--prompt", action="append", required=True, help="Repeat for more; each runs on every adapter.")
    g.add_argument("--include-base", action="store_true", help="Also answer with the base alone.")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    return {"prepare": _ft_prepare, "merge": _ft_merge, "generate": _ft_generate}[a.action](a)


def _ft_prepare(a) -> int:
    from plait.lifecycle.finetune import prepare_instructions

    manifest = prepare_instructions(
        a.inputs,
        a.out,
        tokenizer=a.tokenizer,
        template=a.template.replace("\\n", "\n") if a.template else None,  # a literal \n in a shell
        chat_template=a.chat_template,
        prompt_field=a.prompt_field,
        response_field=a.response_field,
        val_fraction=a.val_fraction,
        train_on_prompt=a.train_on_prompt,
        overwrite=a.overwrite,
    )
    s = manifest["splits"]
    chat = manifest["loss_mask"]["chat_template"]
    rendered = (
        f"the chat template {chat['source']}" if chat else f"the prompt template {manifest['loss_mask']['template']!r}"
    )
    if chat and chat["markers_spelled_out"]:
        rendered += (
            f"\nnote: {', '.join(chat['markers_spelled_out'])} are not tokens of this tokenizer: each is spelled out "
            "in ordinary tokens, learned like any text"
        )
    print(
        f"rendered with {rendered}\n"
        f"wrote {a.out}: train {s['train']['num_documents']} examples / {s['train']['num_tokens']:,} tokens "
        f"({s['train']['num_target_tokens']:,} in the loss), val {s['val']['num_documents']} examples\n"
        f"fine-tune on it with: plait train BASE_RUN/config.toml --finetune.init_from=BASE_RUN "
        f"--finetune.lora_rank=8 --data.source={a.out} --run.name=NAME"
    )
    return 0


def _ft_merge(a) -> int:
    from plait.lifecycle.lora import merge_lora, model_weights_hash
    from plait.lifecycle.model_run import write_run
    from plait.lifecycle.models import artifact_for, load_model

    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose another")
    loaded = load_model(a.source, base=a.base)
    from plait.lifecycle.lora import lora_tensors

    if not lora_tensors(loaded.model):
        raise ConfigError(
            f"{loaded.path} has no LoRA adapters to merge (a plain model: use it as it is); give an adapter file "
            f"or the run of a fine-tune with finetune.lora_rank > 0"
        )
    reg = open_registry_near(a.registry, loaded.path)
    parent = artifact_for(reg, loaded) if reg is not None else None  # before merging: the adapter's own hash
    model = merge_lora(loaded.model)
    if a.format == "hf":
        from plait.interop.hf import export_hf

        export_hf(cast("Transformer", model), out, tokenizer_path=loaded.tokenizer)  # merge_lora: the same model
        digest, target = model_weights_hash(model), out
    else:
        target = write_run(model, out, loaded, None, {"merged_from": str(loaded.path)})
        digest = model_weights_hash(model)
    if reg is not None and parent is not None:
        reg.record(
            "merged", name=out.name, path=target, parent=parent.id, weights_hash=digest, extra={"format": a.format}
        )
    print(f"wrote {out} ({a.format}): {loaded.path} with its adapters merged")
    return 0


def _ft_generate(a) -> int:
    from plait.data import eos_id, load_tokenizer
    from plait.lifecycle.models import load_model
    from plait.lifecycle.serve import SharedStem

    adapters = {}
    for i, spec in enumerate(a.adapter):
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep and not Path(spec).exists() else (f"adapter{i + 1}", spec)
        adapters[name] = path
    base = load_model(a.base)
    if base.tokenizer is None:
        raise PlaitError(f"{base.path} has no tokenizer.json")
    tok = load_tokenizer(base.tokenizer)
    stem = SharedStem(base.model, adapters)
    names: list[str | None] = [*adapters, *([None] if a.include_base else [])]
    requests = [(tok.encode(p, add_special_tokens=False).ids, n) for p in a.prompt for n in names]
    try:
        eos = eos_id(tok)
    except PlaitError:
        eos = None
    outs = stem.generate(requests, max_new_tokens=a.max_new_tokens, temperature=a.temperature, eos_id=eos, seed=a.seed)
    print(f"{len(requests)} requests ({len(a.prompt)} prompts x {len(names)} models) through one shared base")
    for (ids, name), out in zip(requests, outs, strict=True):
        print(f"--- {name or 'base'}: {tok.decode(ids)!r}")
        print(tok.decode(out[len(ids) :]))
    return 0
