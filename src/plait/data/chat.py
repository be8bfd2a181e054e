"""Conversations rendered with a chat template, as the model will be served.

A tokenizer directory (Hugging Face layout) carries its `chat_template` in `tokenizer_config.json` (a string,
or a list of named templates: "default" is used) or in `chat_template.jinja`; HF chat models have one, base
models and plait's own (`plait data prepare`'s BPE) do not, and take a built-in by name (BUILTIN_TEMPLATES:
`chatml`, `plain`) or a .jinja file (named_chat_template). A template is rendered as transformers renders it
(`apply_chat_template`): Jinja in an immutable sandbox, with trim_blocks and lstrip_blocks, loop controls, its
`tojson` filter, `raise_exception`, `strftime_now`, `dict`, `namespace` and `{% generation %}` marks, and the
tokenizer's special tokens (bos_token, ...) as variables; and within limits of time, size and depth, since a
template is data from outside (plait.data.sandbox: 2 s and 8 Mi characters per render). The rendered text is
tokenised whole, without added special tokens, so the ids equal `apply_chat_template(messages,
tokenize=True)` exactly (tests/e2e/test_chat.py checks it against transformers).

Only assistant turns are learned: each assistant turn's text is where it lies in the rendered conversation,
found by rendering the conversation up to the turn (with the generation prompt) and through it; a token is
a target when it holds any of its characters (as transformers' assistant mask: equal, where a template marks
its generations). A template that renders earlier turns differently once later ones follow (some drop
earlier reasoning), or whose turn does not hold the assistant's text, is refused, naming the turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from plait.core.errors import ConfigError
from plait.data.sandbox import RenderLimit, compile_template, memory_window, render_limited

ROLES = ("system", "user", "assistant", "tool")
CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja")  # where a tokenizer directory keeps its template


BUILTIN_TEMPLATES = {  # --chat-template NAME: for models that carry no template (plait's own, base models)
    # ChatML (Qwen, SmolLM2): <|im_start|>role ... <|im_end|>; the assistant's text marked for transformers
    "chatml": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
        "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
        "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # plain text, no markers: for a small tokenizer (plait data prepare's BPE) where each marker costs tokens
    "plain": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}### Assistant:\n"
        "{% generation %}{{ message['content'] }}\n\n{% endgeneration %}"
        "{% else %}### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
    ),
}


@dataclass
class ChatTemplate:
    source: str  # where it was read (a file, or "built-in NAME"): named in errors
    text: str
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as strings
    name: str | None = None  # a built-in's name (BUILTIN_TEMPLATES)
    _compiled: Any = None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as transformers' apply_chat_template(tokenize=False) renders it, within the limits
        of plait.data.sandbox (RENDER_TIME_S per render, MAX_CHARS built): past one, a ConfigError naming the
        template's file."""
        import jinja2

        try:
            if self._compiled is None:
                self._compiled = compile_template(self.text)
            return render_limited(
                self._compiled, messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except RenderLimit as e:
            raise ConfigError(f"the chat template of {self.source} {e}: it was stopped") from None
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template of {self.source} is not valid Jinja ({_one_line(e)})") from None
        except Exception as e:  # the template's own raise_exception, or a sandbox refusal
            raise ConfigError(f"the chat template of {self.source} refused a conversation: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500] or type(e).__name__


def _read_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json: a JSON object (an empty one where there is no file)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e})") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, expected an object (a tokenizer config)")
    return config


def _config_template(config: dict[str, Any], path: Path) -> str | None:
    """tokenizer_config.json's 'chat_template': a string, or a list of {name, template} ("default" is used)."""
    text = config.get("chat_template")
    if isinstance(text, list):
        named = {}
        for i, t in enumerate(text):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise ConfigError(
                    f"{path}: 'chat_template' entry {i} must be an object with string 'name' and 'template'"
                )
            named[t["name"]] = t["template"]
        text = named.get("default")
    if text is not None and not isinstance(text, str):
        raise ConfigError(
            f"{path}: 'chat_template' is a JSON {type(text).__name__}, expected a string or a list of "
            "{name, template} objects"
        )
    return text


def read_template_file(path: Path) -> str:
    """A .jinja file's text (UTF-8, as transformers reads it)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e}): save the template as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    special = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, str):
            special[key] = value
        elif key.endswith("_token") and isinstance(value, dict) and isinstance(value.get("content", ""), str):
            special[key] = value.get("content", "")
    return special


def load_chat_template(tokenizer: str | Path) -> ChatTemplate | None:
    """The chat template beside a tokenizer (its directory, or the directory of its tokenizer.json); None if
    it has none. A malformed tokenizer_config.json or chat_template.jinja is a ConfigError naming it."""
    root = Path(tokenizer)
    root = root if root.is_dir() else root.parent
    config_path = root / "tokenizer_config.json"
    config = _read_config(config_path)
    text, source = _config_template(config, config_path), str(config_path)
    if (root / "chat_template.jinja").is_file():
        text, source = read_template_file(root / "chat_template.jinja"), str(root / "chat_template.jinja")
    if not text:
        return None
    return ChatTemplate(source, text, _special_tokens(config))


def named_chat_template(spec: str, tokenizer: str | Path) -> ChatTemplate:
    """--chat-template SPEC: a built-in (BUILTIN_TEMPLATES) or a .jinja file; the special tokens (bos_token, ...)
    those of the tokenizer's tokenizer_config.json, where it has one."""
    root = Path(tokenizer)
    config = _read_config((root if root.is_dir() else root.parent) / "tokenizer_config.json")
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(f"built-in {spec}", BUILTIN_TEMPLATES[spec], _special_tokens(config), spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"--chat-template={spec} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor a file"
        )
    text = read_template_file(path)
    if not text.strip():
        raise ConfigError(f"--chat-template={spec}: {path} is empty")
    return ChatTemplate(str(path), text, _special_tokens(config))


def missing_markers(template: ChatTemplate, tok: Tokenizer) -> list[str]:
    """The <|...|> markers the template prints that are not tokens of `tok`: each is spelled out in ordinary
    tokens (learned like any text) rather than being one special token."""
    markers = dict.fromkeys(re.findall(r"<\|[^|<>\s{}']{1,40}\|>", template.text))
    return [m for m in markers if tok.token_to_id(m) is None]


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
    """The conversation's text and the character span of each assistant turn in it (its renders within one
    memory window of plait.data.sandbox)."""
    with memory_window():
        return _rendered(template, messages, where)


def _rendered(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
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
        _check_content(template, m["content"], through[len(before) :], f"{where}: assistant message {i}")
        spans.append((len(before), len(through)))
    return text, spans


def _check_content(template: ChatTemplate, content: str, turn: str, where: str) -> None:
    """The rendered turn holds the message's text (whitespace aside: templates trim, or reflow reasoning);
    otherwise the loss would learn the template's own markers and none of the assistant's words."""
    if "".join(content.split()) not in "".join(turn.split()):
        raise ConfigError(
            f"{where}: the chat template of {template.source} does not render the message's content (the turn "
            f"renders as {turn[:60]!r}): nothing of the assistant's text would be learned; use a template that "
            "prints message['content']"
        )


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
