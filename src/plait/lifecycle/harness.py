"""plait models in lm-evaluation-harness (`plait eval MODEL --lm-eval TASKS`): the harness's tasks, scored
on a plait checkpoint (from any training layout: checkpoints load whole), a run, an adapter or a Hugging
Face directory plait reads.

`PlaitLM` is the harness's model interface (a TemplateLM, registered as "plait"): log-likelihoods of
continuations, rolling log-likelihoods (perplexity tasks) and greedy generation until a stop string, with
plait's tokenizer. Its choices follow the harness's own transformers model (HFLM), so a plait model and its
transformers export score the same: the context and continuation are encoded whole and split, an empty
context is conditioned on BOS (or EOS where the tokenizer has none), inputs keep their last max_seq_len + 1
tokens, rolling windows are the harness's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.core.errors import ConfigError


def _harness():
    try:
        import lm_eval
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise ConfigError("--lm-eval needs lm-evaluation-harness: pip install 'plait[lm-eval]'") from None
    return lm_eval, TemplateLM


def plait_lm(model, tokenizer, *, device: str = "cpu"):
    """A harness model of a plait Transformer and its tokenizer (tokenizers.Tokenizer)."""
    TemplateLM: Any  # lm_eval's base class, imported only here: declared Any so that it can be subclassed
    _, TemplateLM = _harness()

    class PlaitLM(_PlaitScoring, TemplateLM):
        pass

    return PlaitLM(model, tokenizer, device)


class _PlaitScoring:
    """PlaitLM's methods: the harness's model interface on a plait model. The other base, lm_eval's TemplateLM,
    is imported only when a harness model is made (plait_lm), so this class stands alone."""

    def __init__(self, model, tokenizer, device: str) -> None:
        from plait.data import eos_id
        from plait.interop.hf.names import BOS_TOKENS

        super().__init__()
        self.model, self.tok = model.eval(), tokenizer
        self.max_length = model.args.max_seq_len
        self._device = device
        self._eos = eos_id(tokenizer)
        bos = next((i for t in BOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None), None)
        self._prefix = bos if bos is not None else self._eos

    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=False)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for _, context, continuation in requests:
            ids = (context + continuation)[-(self.max_length + 1) :][:-1]
            x = torch.tensor([ids], device=self._device)
            logprobs = F.log_softmax(self.model(x)[0, -len(continuation) :].float(), dim=-1)
            target = torch.tensor(continuation, device=self._device)
            total = float(logprobs.gather(1, target[:, None]).sum())
            results.append((total, bool((logprobs.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        out = []
        for (string,) in [r.args for r in requests]:
            windows = map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            out.append(sum(lp for lp, _ in scored))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from plait.engine.generate import generate

        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs: dict[str, Any] = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            ids = self.tok_encode(context)[-(self.max_length - max_new) :] or [self.prefix_token_id]
            tokens = generate(self.model, [ids], max_new_tokens=max_new, temperature=0.0, eos_id=self._eos)
            text = self.tok_decode([t for t in tokens[0][len(ids) :] if t != self._eos])
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


TASKS_DIR = Path(__file__).with_name("tasks")
"""plait's own tasks (offline: their data ships with plait), each a YAML whose {data} is the JSONL beside it."""
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def bundled_tasks() -> Path:
    """A task directory of plait's own tasks with their data's paths filled in (the harness resolves a task's
    data_files from the working directory, not from its YAML's)."""
    import json
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="plait-lm-eval-tasks-"))
    for template in TASKS_DIR.glob("*.yaml"):
        data = template.with_suffix(".jsonl")
        (out / template.name).write_text(template.read_text().replace("{data}", json.dumps(str(data.resolve()))))
    return out


def run_lm_eval(
    model,
    tokenizer: str | Path,
    tasks: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    device: str = "cpu",
) -> dict[str, dict[str, Any]]:
    """The harness's results per task (metric -> value) for a plait model and its tokenizer.json. plait's own
    tasks (TASKS_DIR) are always there; a task whose data is on the Hugging Face Hub is refused at once where
    it is not cached and cannot be fetched (check_reachable), before the harness's retries."""
    lm_eval, _ = _harness()
    from lm_eval.tasks import TaskManager

    from plait.data import load_tokenizer

    own = bundled_tasks()
    try:
        return _evaluate(lm_eval, TaskManager, own, model, load_tokenizer(tokenizer), tasks, include_path, limit,
                         num_fewshot, device)  # fmt: skip
    finally:
        shutil.rmtree(own, ignore_errors=True)


def _evaluate(lm_eval, TaskManager, own: Path, model, tok, tasks, include_path, limit, num_fewshot, device):
    manager = TaskManager(include_path=[str(own), include_path] if include_path else str(own))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"--lm-eval-include {include_path}" if include_path else "no --lm-eval-include"
        raise ConfigError(
            f"--lm-eval: no task {unknown[0]!r} in the harness ({where}); plait's own, offline: "
            f"{', '.join(sorted(p.stem for p in TASKS_DIR.glob('*.yaml')))}"
        )
    for task in tasks:
        check_reachable(task, _dataset_path(manager, task))
    lm = plait_lm(model, tok, device=device)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0
    )
    return {task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in out["results"].items()}


def _dataset_path(manager, task: str) -> str | None:
    """A task's dataset_path as its YAML gives it (None for a group, or where this harness version does not
    publish its task index: TaskManager.task_index, lm_eval >= 0.4.8 as pyproject asks)."""
    index = getattr(manager, "task_index", None) or {}
    entry = index.get(task)
    cfg = getattr(entry, "cfg", None) if not isinstance(entry, dict) else entry.get("cfg")
    path = cfg.get("dataset_path") if isinstance(cfg, dict) else None
    return path if isinstance(path, str) else None


def check_reachable(task: str, dataset: str | None) -> None:
    """A task's Hub dataset in the local cache, or the Hub reachable (a 3 s connection): otherwise one line
    naming the task and what is missing, rather than the datasets library's retries and traceback."""
    import os
    import socket
    from urllib.parse import urlparse

    if dataset is None or dataset in LOCAL_BUILDERS or Path(dataset).expanduser().exists() or _cached(dataset):
        return
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "").lower() in ("1", "true")]
    fix = "run it once with the network to cache it, or score a local task (e.g. --lm-eval plait-shakespeare-mc)"
    if offline:
        raise ConfigError(f"--lm-eval {task}: its dataset {dataset} is not cached here and {offline[0]} is set: {fix}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        socket.create_connection((host, urlparse(endpoint).port or 443), timeout=3).close()
    except OSError:
        raise ConfigError(
            f"--lm-eval {task}: its dataset {dataset} is not cached here and {host} cannot be reached (no network): "
            f"{fix}"
        ) from None


def _cached(dataset: str) -> bool:
    """Whether the datasets library's cache or the Hub's holds `dataset` (org/name)."""
    import os

    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    hub_cache = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    return (datasets_cache / dataset.replace("/", "___")).is_dir() or (
        hub_cache / f"datasets--{dataset.replace('/', '--')}"
    ).is_dir()
