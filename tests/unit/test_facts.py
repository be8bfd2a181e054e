"""bench/facts.py, the knowledge benchmark's generator: byte-identical output per seed, the split between trained
and database-only people, every training phrasing of every fact, held-out questions, the swapped database, and
its refusals."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import facts  # noqa: E402

FILES = ("train.jsonl", "database.jsonl", "database_swapped.jsonl", "questions.jsonl", "meta.json")
ARGS = ["--people", "60", "--database-share", "0.5", "--phrasings", "3"]


def _generate(out: Path, *extra: str) -> dict[str, bytes]:
    assert facts.main(["--out", str(out), *ARGS, *extra]) == 0
    return {name: (out / name).read_bytes() for name in FILES}


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _sentences(texts: list[str]) -> set[str]:
    """Every sentence of the documents (a document: sentences ending in '.', joined by one space)."""
    return {s if s.endswith(".") else s + "." for t in texts for s in t.split(". ")}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("facts")
    _generate(out)
    meta = json.loads((out / "meta.json").read_text())
    qs = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    return out, meta, qs


def test_same_arguments_same_bytes_other_seed_other_bytes(tmp_path):
    first, again = _generate(tmp_path / "a"), _generate(tmp_path / "b")
    other = _generate(tmp_path / "c", "--seed", "1")
    assert first == again
    assert all(first[name] != other[name] for name in FILES)


def test_split_database_only_people_never_trained_everyone_in_the_database(bench):
    out, meta, qs = bench
    people = {q["person"]: q["split"] for q in qs}
    assert len(people) == 60 and meta["counts"]["trained"] == meta["counts"]["database_only"] == 30
    assert sum(s == "database_only" for s in people.values()) == 30
    train = "\n".join(_texts(out / "train.jsonl"))
    database = "\n".join(_texts(out / "database.jsonl"))
    for name, split in people.items():
        in_train = re.search(rf"\b{re.escape(name)}\b", train) is not None
        assert in_train == (split == "trained"), name
        assert re.search(rf"\b{re.escape(name)}\b", database), name


def test_every_fact_of_a_trained_person_in_each_training_phrasing(bench):
    out, meta, qs = bench
    sentences = _sentences(_texts(out / "train.jsonl"))
    templates = meta["templates"]["training"]
    assert all(len(set(templates[a])) == 3 for a in facts.ATTRIBUTES)
    assert len(_texts(out / "train.jsonl")) == 30 * 3
    for q in qs:
        if q["split"] == "trained":
            value = q["answer"][1:]
            found = [t for t in templates[q["attribute"]] if t.format(name=q["person"], value=value) in sentences]
            assert found == templates[q["attribute"]], q


def test_questions_are_phrased_as_no_document_is(bench):
    out, meta, qs = bench
    documents = [t for name in FILES[:3] for t in _texts(out / name)]
    for attribute, template in meta["templates"]["held_out"].items():
        assert template not in meta["templates"]["training"][attribute]
        for part in template.split("{name}"):
            assert part.strip() and not any(part.strip() in d for d in documents), part
    for q in qs:
        assert q["prompt"] == meta["templates"]["held_out"][q["attribute"]].format(name=q["person"])
        assert q["answer"].startswith(" ") and q["answer"].strip() and q["answer"] == q["answer"].rstrip()


def test_swapped_database_holds_other_values_of_every_fact(bench):
    out, meta, qs = bench
    first = {a: t[0] for a, t in meta["templates"]["training"].items()}  # every biography set uses each template
    original, swapped = _sentences(_texts(out / "database.jsonl")), _sentences(_texts(out / "database_swapped.jsonl"))
    assert len(original) == len(swapped)
    for q in qs:
        assert q["swapped_answer"] != q["answer"] and q["swapped_answer"].startswith(" "), q
        template = first[q["attribute"]]
        was, now = (template.format(name=q["person"], value=v[1:]) for v in (q["answer"], q["swapped_answer"]))
        assert was in original and was not in swapped, q
        assert now in swapped and now not in original, q
    assert {q["swapped_answer"] for q in qs if q["attribute"] == "year"} <= {f" {y}" for y in range(1900, 2000)}


def test_a_non_empty_out_is_refused_and_left_as_it_was(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep")
    assert facts.main(["--out", str(tmp_path), *ARGS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "--overwrite" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "keep"
    assert facts.main(["--out", str(tmp_path), *ARGS, "--overwrite"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"notes.txt", *FILES}


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--people", "0"], "--people"),
        (["--database-share", "1.5"], "--database-share"),
        (["--database-share", "-0.1"], "--database-share"),
        (["--phrasings", "0"], "--phrasings"),
        (["--phrasings", "7"], "--phrasings"),
        (["--qa-every", "-1"], "--qa-every"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, capsys, bad, named):
    out = tmp_path / "out"
    assert facts.main(["--out", str(out), *ARGS, *bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and not out.exists()


def test_questions_asked_in_training_are_every_other_persons_of_each_split(tmp_path):
    """--qa-every 2: every other person of each split (by name) has a training document of their four questions
    with the answers, in the form the test asks in; their splits become qa and read; nothing else changes."""
    plain, asked = tmp_path / "plain", tmp_path / "asked"
    _generate(plain), _generate(asked, "--qa-every", "2")
    rows = [json.loads(line) for line in (asked / "questions.jsonl").read_text().splitlines()]
    before = [json.loads(line) for line in (plain / "questions.jsonl").read_text().splitlines()]
    renamed = {"trained": "qa", "database_only": "read"}
    for split, new in renamed.items():
        people = sorted({q["person"] for q in before if q["split"] == split})
        assert {q["person"] for q in rows if q["split"] == new} == set(people[::2])
    assert [dict(q, split=b["split"]) for q, b in zip(rows, before, strict=True)] == before
    docs = [json.loads(line)["text"] for line in (asked / "train_questions.jsonl").read_text().splitlines()]
    want = {}
    for q in rows:
        if q["split"] in renamed.values():
            want.setdefault(q["person"], []).append(q["prompt"] + q["answer"])
    assert sorted(docs) == sorted("\n".join(lines) for lines in want.values())
    for name in ("train.jsonl", "database.jsonl", "database_swapped.jsonl"):
        assert (asked / name).read_bytes() == (plain / name).read_bytes()
    assert not (plain / "train_questions.jsonl").exists()
