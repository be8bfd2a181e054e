"""Conversations rendered with a tokenizer's own chat template, as the model will be served.

A tokenizer directory (Hugging Face layout) carries its `chat_template` in `tokenizer_config.json` (a string,
or a list of named templates: "default" is used) or in `chat_template.jinja`. It is rendered as transformers
renders it (`apply_chat_template`): Jinja in an immutable sandbox (the template is data, never trusted code),
with trim_blocks and lstrip_blocks, loop controls, its `tojson` filter, `raise_exception`, `strftime_now`
and `{% generation %}` marks, and the tokenizer's special tokens (bos_token, ...) as variables. The rendered
text is tokenised whole, without added special tokens, so the ids equal `apply_chat_template(messages,
tokenize=True)` exactly (tests/test_chat.py checks it against transformers).

Only assistant turns are learned: each assistant turn's text is where it lies in the rendered conversation,
found by rendering the conversation up to the turn (with the generation prompt) and through it; a token is
a target when it holds any of its characters (as transformers' assistant mask: equal, where a template marks
its generations). A template that renders earlier turns differently once later ones
follow (some drop earlier reasoning) cannot be masked that way and is refused, naming the turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from plait.core.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja")  # where a tokenizer directory keeps its template


@dataclass
class ChatTemplate:
    source: str  # where it was read: named in errors
    text: str
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as strings
    _compiled: Callable[..., str] | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self._compiled is None:
            self._compiled = _compile(self.text, self.source)
        try:
            return self._compiled(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except Exception as e:  # the template's own raise_exception, or a sandbox refusal
            raise ConfigError(f"the chat template of {self.source} refused a conversation: {e}") from None


def _compile(text: str, source: str) -> Callable[..., str]:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} ... {% endgeneration %} marks of an assistant's text: rendered as
        their body (the assistant turns are located by rendering, so the marks are not needed)."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text).render
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template of {source} is not valid Jinja ({e})") from None


def load_chat_template(tokenizer: str | Path) -> ChatTemplate | None:
    """The chat template beside a tokenizer (its directory, or the directory of its tokenizer.json); None if
    it has none."""
    root = Path(tokenizer)
    root = root if root.is_dir() else root.parent
    config: dict[str, Any] = {}
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{config_path} is not valid JSON ({e})") from None
    text, source = config.get("chat_template"), str(config_path)
    if isinstance(text, list):  # named templates
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    if (root / "chat_template.jinja").is_file():
        text, source = (root / "chat_template.jinja").read_text(encoding="utf-8"), str(root / "chat_template.jinja")
    if not isinstance(text, str) or not text:
        return None
    special = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, (str, dict)):
            special[key] = value if isinstance(value, str) else str(value.get("content", ""))
    return ChatTemplate(source, text, special)


def chat_files(tokenizer: str | Path) -> list[Path]:
    """The files of the chat template beside a tokenizer (none if it has no template): they travel with its
    tokenizer.json into prepared data, checkpoints and exports, so a model is served as it was trained."""
    root = Path(tokenizer)
    root = root if root.is_dir() else root.parent
    if load_chat_template(root) is None:
        return []
    return [root / name for name in CHAT_FILES if (root / name).is_file()]


def check_messages(messages: Any, where: str) -> list[dict]:
    """A conversation: a list of {"role", "content"} objects (roles of ROLES), with an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{where}: \'messages\' must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: message {i} needs string fields 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn: nothing to learn")
    return messages


def rendered(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character span of each assistant turn in it."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(
                f"{where}: the chat template of {template.source} renders the conversation through assistant message "
                f"{i} differently once later turns follow (it may drop earlier turns or reasoning): its assistant "
                "turns cannot be located to be learned; use a template that renders conversations incrementally"
            )
        spans.append((len(before), len(through)))
    return text, spans


def chat_tokens(
    tok: Tokenizer, template: ChatTemplate, conversations: list[tuple[list[dict], str]]
) -> list[tuple[list[int], np.ndarray]]:
    """Each conversation's (messages, where) token ids (apply_chat_template's) and 0/1 mask, 1 on the assistant
    turns; the texts are tokenised in one batch (the tokenizer's threads)."""
    texts = [rendered(template, messages, where) for messages, where in conversations]
    out = []
    for encoding, (_, spans) in zip(
        tok.encode_batch([t for t, _ in texts], add_special_tokens=False), texts, strict=True
    ):
        offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(offsets), dtype=np.uint8)
        for lo, hi in spans:  # a token with any character of the turn (transformers' assistant mask does the same)
            mask[(offsets[:, 0] < hi) & (offsets[:, 1] > lo)] = 1
        out.append((list(encoding.ids), mask))
    return out
