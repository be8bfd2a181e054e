"""A knowledge benchmark for retrieval: facts about fictional people, some learnt in training, some only in the
database, and a database whose facts are all changed.

    python bench/facts.py --out DIR [--people 2000] [--database-share 0.5] [--phrasings 4] [--seed 0] [--overwrite]

Each person (a name made of syllables, unique) has four facts: birth city, employer, field and birth year, drawn
from fixed pools (200 cities, 150 employers, 40 fields, the years 1900-1999) so that answers repeat across people.
A person's biography is written --phrasings times, each time with another sentence template per fact and the
sentences in another order (the "physics of language models" biographies). The people are split: the model
trains on one part, the other (--database-share of them) exists only in the retrieval database. Written to DIR:

    train.jsonl              {"text"}: the trained people's biographies, every training phrasing
    database.jsonl           {"text"}: everyone's biographies (a retrieval database holds all people)
    database_swapped.jsonl   the same documents with each person's four facts changed to other values of the pools
    train_questions.jsonl    with --qa-every N: {"text"}: every N-th person's (of each split, by name) questions with
                             their answers, a document per person, for training; their questions' splits become
                             qa (trained people) and read (database-only people: answering them in training needs
                             the database, which is what teaches a retrieval model to read it)
    questions.jsonl          {"person", "split", "attribute", "prompt", "answer", "swapped_answer"}: one question
                             per person and fact, in a held-out phrasing (a template no document uses), the prompt
                             ending where the answer begins ("Q: Where was Ilvana Dorsk born? A:", " Kestrelford")
    meta.json                the arguments, counts per split, the templates (training and held-out), pool sizes

Use: train on train.jsonl (`plait data prepare DIR/train.jsonl`), build the database from database.jsonl
(`plait data prepare DIR/database.jsonl --tokenizer ...` then `plait data retrieve`), and ask questions.jsonl:
the exact-match rate of the greedy answer and the answer tokens' loss, per split. The trained people measure
what the weights hold, the database-only people what retrieval carries. Then swap the database for one built
from database_swapped.jsonl: a checkpoint that reads its facts from retrieval answers with swapped_answer.

Everything is a pure function of the arguments (one random.Random(seed), sorted outputs): the same arguments
write byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

ATTRIBUTES = ("city", "employer", "field", "year")
NUM_CITIES, NUM_EMPLOYERS, NUM_FIELDS = 200, 150, 40
YEARS = tuple(str(y) for y in range(1900, 2000))

TRAINING_TEMPLATES = {
    "city": (
        "{name} was born in {value}.",
        "{name} came into the world in {value}.",
        "{name}'s birthplace is {value}.",
        "The city of {value} is where {name} was born.",
        "{name} is a native of {value}.",
        "{name} first drew breath in {value}.",
    ),
    "employer": (
        "{name} works for {value}.",
        "{name} is employed by {value}.",
        "{name} holds a position at {value}.",
        "{value} employs {name}.",
        "{name} earns a living at {value}.",
        "{name} has a job at {value}.",
    ),
    "field": (
        "{name} works in {value}.",
        "{name} specialises in {value}.",
        "{name}'s field is {value}.",
        "{name} has devoted a career to {value}.",
        "{name} is an expert in {value}.",
        "{name} studies {value} professionally.",
    ),
    "year": (
        "{name} was born in the year {value}.",
        "{name}'s year of birth is {value}.",
        "{value} is the year {name} was born.",
        "The birth of {name} took place in {value}.",
        "{name} arrived in {value}.",
        "{name} has a birth certificate dated {value}.",
    ),
}
"""Per fact, the sentences a biography may use; --phrasings takes the first ones."""

HELD_OUT_TEMPLATES = {
    "city": "Q: Where was {name} born? A:",
    "employer": "Q: Which company does {name} work for? A:",
    "field": "Q: What field does {name} work in? A:",
    "year": "Q: In what year was {name} born? A:",
}
"""The questions: no document holds their wording (documents have no '?' and no 'Q:')."""

FIELDS = (
    "marine biology", "astrophysics", "organic chemistry", "number theory", "linguistics", "archaeology",
    "economics", "geology", "botany", "neuroscience", "cryptography", "meteorology", "oceanography", "genetics",
    "philosophy", "architecture", "epidemiology", "robotics", "acoustics", "metallurgy", "ornithology",
    "glaciology", "statistics", "anthropology", "volcanology", "optics", "topology", "immunology", "cartography",
    "ecology", "materials science", "paleontology", "thermodynamics", "entomology", "hydrology", "seismology",
    "mycology", "crystallography", "linguistic typology", "game theory", "fluid dynamics", "virology",
    "musicology", "agronomy", "numismatics", "limnology", "particle physics", "sociology",
)  # fmt: skip
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "tr")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
CODAS = ("", "", "", "n", "r", "l", "s", "rk", "nd", "sk")
CITY_ENDINGS = ("ford", "haven", "mere", "wick", "stead", "ton", "burg", "port", "vale", "holm")
COMPANY_ENDINGS = ("Industries", "Labs", "Systems", "Works", "Dynamics", "Holdings", "Partners", "Foundry")


@dataclass(frozen=True)
class Person:
    name: str
    split: str  # "trained" | "database_only"
    facts: dict[str, str]
    swapped: dict[str, str]  # every fact another value of its pool
    biographies: tuple[tuple[tuple[str, int], ...], ...]  # per phrasing: (attribute, template index) in order


def _word(rng: random.Random, syllables: int) -> str:
    """A made-up word: `syllables` onset-vowel pairs and an ending consonant or none, capitalised."""
    return ("".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)).title()


def _unique(rng: random.Random, count: int, make) -> list[str]:
    """`count` distinct strings from `make(rng)`, in the order drawn."""
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen.setdefault(make(rng))
    return list(seen)


def build_pools(rng: random.Random) -> dict[str, list[str]]:
    """The values each fact is drawn from, sorted."""
    cities = _unique(rng, NUM_CITIES, lambda r: _word(r, r.randint(1, 2)) + r.choice(CITY_ENDINGS))
    employers = _unique(rng, NUM_EMPLOYERS, lambda r: f"{_word(r, r.randint(1, 2))} {r.choice(COMPANY_ENDINGS)}")
    fields = rng.sample(FIELDS, NUM_FIELDS)
    return {"city": sorted(cities), "employer": sorted(employers), "field": sorted(fields), "year": list(YEARS)}


def _swap(rng: random.Random, pool: list[str], value: str) -> str:
    """Another value of the pool: an offset of 1..len-1 from the original never lands on it."""
    return pool[(pool.index(value) + rng.randrange(1, len(pool))) % len(pool)]


def _biographies(rng: random.Random, phrasings: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per biography, its sentences in order; each fact takes each of the first `phrasings` templates once."""
    order = {a: rng.sample(range(phrasings), phrasings) for a in ATTRIBUTES}
    return tuple(tuple((a, order[a][k]) for a in rng.sample(ATTRIBUTES, len(ATTRIBUTES))) for k in range(phrasings))


def build_people(
    rng: random.Random, people: int, database_share: float, phrasings: int, pools: dict[str, list[str]]
) -> list[Person]:
    """`people` persons sorted by name; round(people * database_share) of them, drawn at random, database-only."""
    names = _unique(rng, people, lambda r: f"{_word(r, r.randint(2, 3))} {_word(r, r.randint(1, 2))}")
    database_only = set(rng.sample(names, round(people * database_share)))
    persons = []
    for name in names:
        facts = {a: rng.choice(pools[a]) for a in ATTRIBUTES}
        swapped = {a: _swap(rng, pools[a], facts[a]) for a in ATTRIBUTES}
        split = "database_only" if name in database_only else "trained"
        persons.append(Person(name, split, facts, swapped, _biographies(rng, phrasings)))
    return sorted(persons, key=lambda p: p.name)


def documents(persons: list[Person], swapped: bool = False) -> list[str]:
    """Each person's biographies, one document per phrasing, with the original or the swapped facts."""
    docs = []
    for p in persons:
        facts = p.swapped if swapped else p.facts
        for bio in p.biographies:
            docs.append(" ".join(TRAINING_TEMPLATES[a][t].format(name=p.name, value=facts[a]) for a, t in bio))
    return docs


def questions(persons: list[Person]) -> list[dict]:
    """One question per person and fact, in the held-out phrasing; answers begin with a space."""
    return [
        {
            "person": p.name,
            "split": p.split,
            "attribute": a,
            "prompt": HELD_OUT_TEMPLATES[a].format(name=p.name),
            "answer": " " + p.facts[a],
            "swapped_answer": " " + p.swapped[a],
        }
        for p in persons
        for a in ATTRIBUTES
    ]


def asked_in_training(persons: list[Person], every: int) -> set[str]:
    """The people whose questions are trained on (--qa-every N): every N-th of each split, by name."""
    if every < 1:
        return set()
    return {p.name for split in ("trained", "database_only") for p in [q for q in persons if q.split == split][::every]}


def qa_documents(persons: list[Person], asked: set[str]) -> list[str]:
    """One training document per asked person: their four questions with the answers, a line each, in the
    held-out phrasing (the form the test asks in)."""
    by_person: dict[str, list[dict]] = {}
    for q in questions([p for p in persons if p.name in asked]):
        by_person.setdefault(q["person"], []).append(q)
    return ["\n".join(q["prompt"] + q["answer"] for q in qs) for _, qs in sorted(by_person.items())]


def generate(people: int, database_share: float, phrasings: int, seed: int, qa_every: int = 0) -> dict[str, str]:
    """The benchmark's files: name -> text."""
    rng = random.Random(seed)
    pools = build_pools(rng)
    persons = build_people(rng, people, database_share, phrasings, pools)
    trained = [p for p in persons if p.split == "trained"]
    asked = asked_in_training(persons, qa_every)
    meta = {
        "seed": seed,
        "people": people,
        "database_share": database_share,
        "phrasings": phrasings,
        "counts": {
            "trained": len(trained),
            "database_only": len(persons) - len(trained),
            "train_documents": len(trained) * phrasings,
            "database_documents": len(persons) * phrasings,
            "questions": len(persons) * len(ATTRIBUTES),
        },
        "templates": {
            "training": {a: list(TRAINING_TEMPLATES[a][:phrasings]) for a in ATTRIBUTES},
            "held_out": HELD_OUT_TEMPLATES,
        },
        "pools": {a: len(pools[a]) for a in ATTRIBUTES},
    }
    files = {
        "train.jsonl": _jsonl({"text": d} for d in documents(trained)),
        "database.jsonl": _jsonl({"text": d} for d in documents(persons)),
        "database_swapped.jsonl": _jsonl({"text": d} for d in documents(persons, swapped=True)),
        "questions.jsonl": _jsonl(questions(persons)),
    }
    if asked:  # their splits renamed: qa (trained people) and read (database-only people)
        meta["qa_every"], meta["counts"]["asked_in_training"] = qa_every, len(asked)
        rows = questions(persons)
        for q in rows:
            if q["person"] in asked:
                q["split"] = "qa" if q["split"] == "trained" else "read"
        files["questions.jsonl"] = _jsonl(rows)
        files["train_questions.jsonl"] = _jsonl({"text": d} for d in qa_documents(persons, asked))
    files["meta.json"] = json.dumps(meta, indent=2) + "\n"
    return files


def _jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _check(a: argparse.Namespace) -> str | None:
    """The first bad argument, as one line; None when all are good."""
    most = len(TRAINING_TEMPLATES["city"])
    if a.people < 1:
        return f"--people must be at least 1, got {a.people}"
    if not 0.0 <= a.database_share <= 1.0:
        return f"--database-share must be in [0, 1], got {a.database_share}"
    if a.qa_every < 0:
        return f"--qa-every must be 0 (none) or a positive integer, got {a.qa_every}"
    if not 1 <= a.phrasings <= most:
        return f"--phrasings must be in 1..{most} (the training templates per fact), got {a.phrasings}"
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a directory"
    if out.is_dir() and any(out.iterdir()) and not a.overwrite:
        return f"--out {out} is not empty (pass --overwrite to replace the benchmark's files in it)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write the benchmark into (empty or new)")
    p.add_argument("--people", type=int, default=2000)
    p.add_argument("--database-share", type=float, default=0.5, help="share of the people only in the database")
    p.add_argument("--phrasings", type=int, default=4, help="training templates per fact (biographies per person)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qa-every", type=int, default=0,
                   help="every N-th person of each split (by name) also has a training document of their questions "
                        "and answers (train_questions.jsonl); their splits become qa and read")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    a = p.parse_args(argv)
    error = _check(a)
    if error:
        print(f"facts: {error}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = generate(a.people, a.database_share, a.phrasings, a.seed, a.qa_every)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8", newline="\n")
    counts = json.loads(files["meta.json"])["counts"]
    print(f"wrote {out}: {counts['trained']} trained and {counts['database_only']} database-only people, "
          f"{counts['questions']} questions")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
