"""Conversations rendered with the tokenizer's chat template (plait.data.chat, `plait finetune prepare`): the
ids equal transformers' apply_chat_template exactly, only the assistant turns are learned (equal to
transformers' assistant mask where a template marks its generations), prompt/response records become a user
and an assistant turn, and what cannot be rendered or masked is refused naming why."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from plait.core.errors import ConfigError
from plait.data.chat import BUILTIN_TEMPLATES, ChatTemplate, chat_tokens, load_chat_template, rendered
from plait.lifecycle.finetune import prepare_instructions

transformers = pytest.importorskip("transformers")

CHATML = (  # Qwen2's layout, with transformers' generation markers on the assistant turns
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (  # Llama 3's layout: bos_token, headers, a default system turn, raise_exception
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You are helpful.<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is a sonnet?"}, {"role": "assistant", "content": "Fourteen lines."}],
    [
        {"role": "system", "content": "Answer in verse."},
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "  The Bard of Avon, friend. "},
        {"role": "user", "content": "And Macbeth — für wen?"},
        {"role": "assistant", "content": "The same quill, ‘twas he.\nTwo lines."},
    ],
]


def tokenizer_dir(root: Path, data_dir, template: str, in_file: bool) -> Path:
    """The bundled tokenizer with chat markup as special tokens, and a chat template: in tokenizer_config.json
    or in chat_template.jinja."""
    root.mkdir()
    tok = Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": "<|begin_of_text|>",
    }
    if in_file:
        (root / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return out if isinstance(out, list) else out["input_ids"]


@pytest.mark.parametrize(
    "template,in_file",
    [(CHATML, False), (LLAMA3, True), (BUILTIN_TEMPLATES["chatml"], False), (BUILTIN_TEMPLATES["plain"], True)],
    ids=["chatml-config", "llama3-jinja", "builtin-chatml", "builtin-plain"],
)
def test_ids_equal_apply_chat_template(tmp_path, data_dir, template, in_file):
    root = tokenizer_dir(tmp_path / "tok", data_dir, template, in_file)
    hf = transformers.AutoTokenizer.from_pretrained(str(root))
    chat = load_chat_template(root)
    assert chat is not None
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    for messages in CONVERSATIONS:
        ((ids, mask),) = chat_tokens(tok, chat, [(messages, "test")])
        assert ids == hf_ids(hf, messages)
        assert chat.render(messages, add_generation_prompt=True) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        learned = hf.decode([i for i, m in zip(ids, mask, strict=True) if m])
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert all(a.strip() in learned for a in answers) and "Who wrote" not in learned and "sonnet" not in learned


def test_only_assistant_turns_are_learned_as_transformers_marks_them(tmp_path, data_dir):
    root = tokenizer_dir(tmp_path / "tok", data_dir, CHATML, False)
    hf = transformers.AutoTokenizer.from_pretrained(str(root))
    chat = load_chat_template(root)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    for messages in CONVERSATIONS:
        ((_, mask),) = chat_tokens(tok, chat, [(messages, "test")])
        marked = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert mask.tolist() == list(marked["assistant_masks"])


def test_prepare_renders_conversations_and_prompt_response_records(tmp_path, data_dir):
    from plait.data.loader import TokenDataset, read_manifest

    root = tokenizer_dir(tmp_path / "tok", data_dir, CHATML, False)
    hf = transformers.AutoTokenizer.from_pretrained(str(root))
    src = tmp_path / "chat.jsonl"
    records = [{"messages": m} for m in CONVERSATIONS] * 3 + [{"prompt": "Say hi.", "response": "Hi."}]
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    manifest = prepare_instructions([src], tmp_path / "out", tokenizer=root, val_fraction=0.0)
    assert manifest["loss_mask"]["chat_template"]["source"].endswith("tokenizer_config.json")
    assert manifest["loss_mask"]["template"] is None
    data = TokenDataset(tmp_path / "out", "train")
    tokens = np.asarray(data._shards[0])
    mask = np.asarray(data._masks[0])
    expected = []
    for r in records:
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]},
                                         {"role": "assistant", "content": r["response"]}]  # fmt: skip
        expected += [*hf_ids(hf, messages), 0]  # each conversation, then EOS (id 0) between documents
    assert tokens.tolist() == expected
    assert mask[tokens == 0].all()  # the separator after a final assistant turn is learned (the model stops)
    assert 0 < mask.mean() < 0.6
    assert read_manifest(tmp_path / "out")["splits"]["train"]["num_documents"] == len(records)


def test_what_cannot_be_rendered_or_masked_is_refused(tmp_path, data_dir):
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(Path(data_dir) / "tokenizer.json", plain / "tokenizer.json")
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    with pytest.raises(ConfigError, match="rendered with the tokenizer's chat template; pass --tokenizer"):
        prepare_instructions([src], tmp_path / "o1", tokenizer=plain / "tokenizer.json")
    with pytest.raises(ConfigError, match="rendered with the tokenizer's chat template"):  # --template given
        prepare_instructions([src], tmp_path / "o2", tokenizer=tokenizer_dir(tmp_path / "t", data_dir, CHATML, False),
                             template="Q: {prompt}\nA: ")  # fmt: skip
    dropping = (
        "{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    root = tokenizer_dir(tmp_path / "drop", data_dir, dropping, True)
    src.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    with pytest.raises(
        ConfigError, match="renders the conversation through assistant message 2 differently once later"
    ):
        prepare_instructions([src], tmp_path / "o3", tokenizer=root)
    bad = [
        ({"messages": []}, "must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "has role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "needs string fields 'role' and 'content'"),
    ]
    root = tokenizer_dir(tmp_path / "ok", data_dir, LLAMA3, True)
    for record, message in bad:
        src.write_text(json.dumps(record) + "\n")
        with pytest.raises(ConfigError, match=message):
            prepare_instructions([src], tmp_path / "o4", tokenizer=root)
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))


def test_the_template_travels_from_the_data_to_the_checkpoint_and_the_export(tmp_path, data_dir, capsys):
    """A fine-tune on chat data: its checkpoints keep the chat template beside tokenizer.json, and its
    transformers export carries it, so the model is served with the template it was trained with."""
    import subprocess
    import sys

    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    root = tokenizer_dir(tmp_path / "tok", data_dir, LLAMA3, True)
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps({"messages": m}) for m in CONVERSATIONS * 20) + "\n")
    prepare_instructions([src], tmp_path / "data", tokenizer=root, val_fraction=0.1)
    assert (tmp_path / "data" / "chat_template.jinja").read_text() == LLAMA3
    vocab = json.loads((tmp_path / "data" / "manifest.json").read_text())["vocab_size"]
    train(load_config(None, debug_run(tmp_path / "data", tmp_path, "chat", 2, f"model.vocab_size={vocab}")))
    ckpt = tmp_path / "chat" / "checkpoints" / "step_00000002"
    assert (ckpt / "chat_template.jinja").read_text() == LLAMA3
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "plait.cli", "ckpt", "export", str(ckpt), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    served = transformers.AutoTokenizer.from_pretrained(str(out))
    for messages in CONVERSATIONS:
        assert hf_ids(served, messages) == hf_ids(transformers.AutoTokenizer.from_pretrained(str(root)), messages)
    # `plait generate --chat` renders the prompt as the run learned: the answer is greedy decoding after
    # transformers' own rendering of the user's message with the generation prompt.
    from plait.cli import main
    from plait.engine.generate import generate, load_for_generation

    question = CONVERSATIONS[0][0]["content"]
    assert main(["generate", str(ckpt), "--chat", "--prompt", question, "--temperature", "0",
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0  # fmt: skip
    answer = capsys.readouterr().out
    ids = hf_ids(served, [{"role": "user", "content": question}], add_generation_prompt=True)
    model, tok, eos = load_for_generation(ckpt, "cpu")
    greedy = generate(model, [ids], max_new_tokens=6, temperature=0.0, eos_id=eos)[0]
    assert answer == tok.decode(greedy[len(ids) :]) + "\n"


def test_a_builtin_template_serves_a_tokenizer_without_one_and_travels_in_the_manifest(tmp_path, data_dir):
    """plait's own tokenizer has no template: --chat-template chatml renders with the built-in (its markers
    spelled out in ordinary tokens, and said so), and the prepared directory carries it: chat_template.jinja
    (which checkpoints and exports carry on) and loss_mask.chat_template's name, source, hash and full text."""
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(Path(data_dir) / "tokenizer.json", plain / "tokenizer.json")
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps({"messages": m}) for m in CONVERSATIONS) + "\n")
    manifest = prepare_instructions([src], tmp_path / "out", tokenizer=plain, chat_template="chatml", val_fraction=0)
    record = manifest["loss_mask"]["chat_template"]
    assert record["name"] == "chatml" and record["source"] == "built-in chatml"
    assert record["text"] == BUILTIN_TEMPLATES["chatml"] == (tmp_path / "out" / "chat_template.jinja").read_text()
    assert record["markers_spelled_out"] == ["<|im_start|>", "<|im_end|>"]
    assert load_chat_template(tmp_path / "out").text == BUILTIN_TEMPLATES["chatml"]
    assert 0 < manifest["splits"]["train"]["num_target_tokens"] < manifest["splits"]["train"]["num_tokens"]
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(LLAMA3)
    manifest = prepare_instructions([src], tmp_path / "out2", tokenizer=plain, chat_template=str(jinja))
    assert manifest["loss_mask"]["chat_template"]["name"] is None
    assert manifest["loss_mask"]["chat_template"]["source"] == str(jinja)


def test_the_limits_leave_real_conversations_alone(tmp_path):
    """A 200-turn conversation of 2 M characters renders with the Llama 3 layout in well under its 2 s (the
    limit is per render), equal to the template rendered without limits, and the address-space limit set
    while it renders is restored after."""
    import resource

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 2000} for i in range(200)]
    chat = ChatTemplate("test", LLAMA3, {"bos_token": "<|begin_of_text|>"})
    before = resource.getrlimit(resource.RLIMIT_AS)
    text, spans = rendered(chat, messages, "test")
    assert len(spans) == 100 and len(text) > 2_000_000
    started = time.perf_counter()
    assert chat.render(messages) == text
    assert time.perf_counter() - started < 0.5  # one render, of the whole conversation
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(jinja2.exceptions.TemplateError(m))
    assert text == env.from_string(LLAMA3).render(messages=messages, bos_token="<|begin_of_text|>")


def test_a_turn_without_the_assistants_text_is_refused(tmp_path, data_dir):
    markers_only = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    root = tokenizer_dir(tmp_path / "tok", data_dir, markers_only, True)
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    with pytest.raises(
        ConfigError, match="chat.jsonl:1: assistant message 2: the chat template of .*chat_template.jinja"
    ):
        prepare_instructions([src], tmp_path / "out", tokenizer=root)
    assert not (tmp_path / "out").exists()
