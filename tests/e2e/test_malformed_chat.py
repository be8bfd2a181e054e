"""Chat data, chat templates and prepare inputs that are malformed or hostile meet one clear line and exit 2.

The table runs the real command in this process (tests/bad_inputs.py's judge: exit 2, no traceback, the named
words, nothing under the case's directory changed). A template is data from outside: one that loops without
end, builds a huge string or recurses without end is stopped within its limits (plait.data.sandbox), checked
here also in a child process running the real CLI, its time and peak memory measured. The tokenizer config
reader is fuzzed: any JSON is a template, no template, or a ConfigError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bad_inputs import judge
from plait.core.errors import ConfigError
from plait.data.chat import load_chat_template

pytestmark = pytest.mark.filterwarnings("ignore")

CONVERSATION = [{"role": "user", "content": "What is a sonnet?"}, {"role": "assistant", "content": "Fourteen lines."}]
LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 300000000 }}"
RECURSION = "{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}"
DROPS_CONTENT = (  # the assistant's turn is its markers only: nothing of its text would be learned
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Ctx:
    """What a case may use: a fresh directory (`d`), the bundled prepared data, and its S3 server (`s3`)."""

    def __init__(self, d: Path, data_dir: Path, request):
        self.d, self.data, self._request = d, data_dir, request

    def file(self, name: str, data: bytes | str) -> str:
        path = self.d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)

    def tok(self, template: str | bytes | None = None, config: object | bytes = None) -> str:
        """A tokenizer directory: the bundled tokenizer.json, `template` as chat_template.jinja, `config` as
        tokenizer_config.json (an object written as JSON, or raw bytes)."""
        root = self.d / "tok"
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.data / "tokenizer.json", root / "tokenizer.json")
        if template is not None:
            self.file("tok/chat_template.jinja", template)
        if config is not None:
            self.file("tok/tokenizer_config.json", config if isinstance(config, bytes) else json.dumps(config))
        return str(root)

    def chats(self, *records: object, raw: str | None = None) -> str:
        lines = (
            raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records or [{"messages": CONVERSATION}])
        )
        return self.file("chats.jsonl", lines)

    def s3(self):
        return self._request.getfixturevalue("s3")


def ft(c: Ctx, tokenizer: str, *extra: str, chats: str | None = None) -> list[str]:
    """`plait finetune prepare` of c's conversations with `tokenizer`."""
    return ["finetune", "prepare", chats or c.chats(), "--out", str(c.d / "out"), "--tokenizer", tokenizer, *extra]


def dp(c: Ctx, *inputs: str) -> list[str]:
    return ["data", "prepare", *inputs, "--out", str(c.d / "out")]


def nulls_parquet(c: Ctx) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} of the corpus" if i % 300 < 158 else None for i in range(300)]
    path = c.d / "nulls.parquet"
    pq.write_table(pa.table({"text": texts}), path)
    return str(path)


def nulls_arrow(c: Ctx) -> str:
    import pyarrow as pa

    table = pa.table({"text": ["words and more words"] * 10 + [None] * 5})
    path = c.d / "nulls.arrow"
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        writer.write_table(table)
    return str(path)


def latin1(text: str) -> bytes:
    return text.encode("latin-1")


# (id, argv from a Ctx, words the message must contain)
CASES = [
    # ------------------------------------------------------------------------------- hostile or broken templates
    ("template loops without end", lambda c: ft(c, c.tok(LOOPS)), "chat_template.jinja ran past the limit of 2 s"),
    (
        "template builds a huge string",
        lambda c: ft(c, c.tok(HUGE)),
        "chat_template.jinja would build a str of 300,000,000",
    ),
    ("template recurses without end", lambda c: ft(c, c.tok(RECURSION)), "chat_template.jinja recursed deeper"),
    (
        "template in the config loops",
        lambda c: ft(c, c.tok(config={"chat_template": LOOPS})),
        "tokenizer_config.json ran past the limit",
    ),
    (
        "template drops the assistant's content",
        lambda c: ft(c, c.tok(DROPS_CONTENT)),
        "assistant message 1: the chat template of",
    ),
    (
        "template not Jinja",
        lambda c: ft(c, c.tok("{% for m in messages %}{{ m")),
        "chat_template.jinja is not valid Jinja",
    ),
    (
        "template raises",
        lambda c: ft(c, c.tok("{{ raise_exception('no system turn') }}")),
        "refused a conversation: no system turn",
    ),
    ("template too long", lambda c: ft(c, c.tok("x" * (1 << 21))), "2,097,152 characters, past the limit"),
    (
        "template in Latin-1",
        lambda c: ft(c, c.tok(latin1("{{ 'café' }}{{ messages }}"))),
        "chat_template.jinja is not UTF-8",
    ),
    (
        "template escapes the sandbox",
        lambda c: ft(c, c.tok("{{ cycler.__init__.__globals__ }}")),
        "jinja refused a conversation",
    ),
    # ------------------------------------------------------------------------------------ tokenizer_config.json
    ("config a JSON list", lambda c: ft(c, c.tok(config=[1, 2])), "tokenizer_config.json holds a JSON list"),
    ("config not JSON", lambda c: ft(c, c.tok(config=b"{oops")), "tokenizer_config.json is not valid JSON"),
    (
        "config in Latin-1",
        lambda c: ft(c, c.tok(config=latin1('{"eos_token": "é"}'))),
        "tokenizer_config.json is not UTF-8",
    ),
    ("config template a number", lambda c: ft(c, c.tok(config={"chat_template": 3})), "'chat_template' is a JSON int"),
    (
        "config named templates malformed",
        lambda c: ft(c, c.tok(config={"chat_template": [{"name": ["default"], "template": "x"}]})),
        "'chat_template' entry 0 must be an object",
    ),
    # -------------------------------------------------------------------------------------------- --chat-template
    (
        "--chat-template unknown",
        lambda c: ft(c, c.tok(), "--chat-template", "nosuch"),
        "--chat-template=nosuch is neither",
    ),
    (
        "--chat-template file in Latin-1",
        lambda c: ft(c, c.tok(), "--chat-template", c.file("t.jinja", latin1("é{{ messages }}"))),
        "t.jinja is not UTF-8",
    ),
    (
        "--chat-template file loops",
        lambda c: ft(c, c.tok(), "--chat-template", c.file("t.jinja", LOOPS)),
        "t.jinja ran past the limit of 2 s",
    ),
    (
        "--chat-template with --template",
        lambda c: ft(c, c.tok(), "--chat-template", "chatml", "--template", "Q: {prompt}\nA: "),
        "exclude each other",
    ),
    ("conversation without a template", lambda c: ft(c, c.tok()), "--chat-template chatml"),
    # ---------------------------------------------------------------------------------------------- chat records
    ("messages not a list", lambda c: ft(c, c.tok(), chats=c.chats({"messages": "hi"})), "chats.jsonl:1: 'messages'"),
    (
        "no assistant turn",
        lambda c: ft(c, c.tok(), "--chat-template", "chatml", chats=c.chats({"messages": CONVERSATION[:1]})),
        "chats.jsonl:1: the conversation has no assistant turn",
    ),
    (
        "unknown role",
        lambda c: ft(c, c.tok(), chats=c.chats({"messages": [{"role": "robot", "content": "x"}]})),
        "message 0 has role 'robot'",
    ),
    (
        "content not a string",
        lambda c: ft(c, c.tok(), chats=c.chats({"messages": [{"role": "user", "content": ["x"]}]})),
        "message 0 needs string fields 'role' and 'content'",
    ),
    ("record not an object", lambda c: ft(c, c.tok(), chats=c.chats([1, 2])), "chats.jsonl:1 is a JSON list"),
    ("record not JSON", lambda c: ft(c, c.tok(), chats=c.chats(raw="{oops\n")), "chats.jsonl:1 is not valid JSON"),
    (
        "record in Latin-1",
        lambda c: ft(c, c.tok(), chats=c.file("chats.jsonl", latin1('{"prompt": "café", "response": "x"}\n'))),
        "chats.jsonl:1 is not valid JSON",
    ),
    (
        "prompt without response",
        lambda c: ft(c, c.tok(), chats=c.chats({"prompt": "hi"})),
        "needs string fields 'prompt' and 'response'",
    ),
    ("no records", lambda c: ft(c, c.tok(), chats=c.chats(raw="\n\n")), "chats.jsonl has no records"),
    (
        "corrupt gzip",
        lambda c: ft(c, c.tok(), chats=c.file("chats.jsonl.gz", b"\x1f\x8b garbage")),
        "chats.jsonl.gz cannot be read",
    ),
    ("not JSONL", lambda c: ft(c, c.tok(), chats=c.file("chats.txt", "hi")), "chats.txt must be an existing .jsonl"),
    # ------------------------------------------------------------------------------------- plait data prepare
    ("arrow of random bytes", lambda c: dp(c, c.file("r.arrow", os.urandom(3000))), "r.arrow is not an Arrow stream"),
    (
        "parquet with null texts",
        lambda c: dp(c, nulls_parquet(c)),
        "nulls.parquet: column 'text' holds 142 nulls of 300",
    ),
    ("arrow with null texts", lambda c: dp(c, nulls_arrow(c)), "nulls.arrow: column 'text' holds 5 nulls of 15 rows"),
    (
        "s3 bucket that does not exist",
        lambda c: [*dp(c, "s3://nosuchbucket/corpus"), "--s3-endpoint", c.s3().endpoint],
        "s3://nosuchbucket/corpus does not exist",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_chat_input_gets_one_clear_line(case, data_dir, tmp_path, capsys, request):
    name, build, words = case
    err = judge(name, build(Ctx(tmp_path, Path(data_dir), request)), words, tmp_path, capsys)
    assert len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------------- the real CLI, in a child


def _child(argv: list[str], cwd: Path, limit_s: float = 120) -> tuple[int, str, float, int]:
    """`plait ARGV` in a child process: (exit status, what it printed, seconds, its peak RSS in MiB)."""
    out = cwd / "child.out"
    with open(out, "wb") as sink:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "plait.cli", *argv], cwd=cwd, stdout=sink, stderr=sink)
    timer = threading.Timer(limit_s, proc.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (its peak RSS)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out.read_text(), time.monotonic() - started, usage.ru_maxrss // 1024


def test_hostile_templates_stop_within_their_limits_in_the_real_cli(data_dir, tmp_path):
    """Each ends in exit 2 and one line naming its file, within 20 s (2 s of rendering and the command's
    start; on a loaded machine, within 10 s of a well-behaved run), and the huge string never grows the
    process: its peak RSS stays within 64 MiB of a well-behaved template's run."""
    c = Ctx(tmp_path, Path(data_dir), None)
    code, said, started_s, baseline = _child(ft(c, c.tok(), "--chat-template", "chatml"), tmp_path)
    assert code == 0, said[-2000:]
    for name, template in (("loops", LOOPS), ("huge", HUGE), ("recursion", RECURSION)):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        code, said, seconds, peak = _child(ft(c, c.tok(template)), tmp_path)
        assert code == 2, (name, said[-2000:])
        assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said[-2000:]
        assert "chat_template.jinja" in said, said
        assert seconds < max(20, started_s + 10), (name, seconds, started_s)  # a loaded machine starts slowly
        assert not (tmp_path / "out").exists()
        if name == "huge":
            assert peak < baseline + 64, (peak, baseline)


# ------------------------------------------------------------------------------- fuzzing the config reader

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_configs = _json | st.fixed_dictionaries(
    {},
    optional={
        "chat_template": _json
        | st.text(max_size=60)
        | st.lists(st.fixed_dictionaries({"name": _json, "template": _json})),
        "bos_token": _json,
        "eos_token": _json,
    },
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=_configs)
def test_any_json_config_is_a_template_none_or_a_clean_error(tmp_path_factory, config):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        chat = load_chat_template(root)
        if chat is not None:
            assert isinstance(chat.render(CONVERSATION, add_generation_prompt=True), str)
    except ConfigError:
        pass
