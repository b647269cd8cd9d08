"""Training and evaluation corpora that exist on every machine with Python.

Three request types, each with a deterministic held-out split:

- ``code``: the standard library's ``.py`` sources (tests and site-packages excluded); a file is held out when
  ``crc32(relative path) % HELD_OUT_MOD == 0``.
- ``prose``: the standard library's documentation text — ``pydoc_data.topics`` (the language reference shown by
  ``help()``) and the docstrings of standard-library modules, classes and functions; held out by the same hash
  of the topic name or source file.
- ``structured``: JSON records with a fixed schema, generated from a seeded RNG; the held-out split uses a
  different seed. ``schema_version=2`` is the shifted mix that the second target version is trained on.

Every document is framed as ``BOS bytes EOS`` in a stream of int16 token ids.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.model import BOS_ID, EOS_ID

REQUEST_TYPES = ("code", "prose", "structured")
HELD_OUT_MOD = 20  # 5% of files / topics held out
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo", "ensurepip"}
MAX_FILE_BYTES = 200_000  # a few generated tables in the stdlib are huge and unlike code people write


@dataclass(frozen=True)
class Corpus:
    """Token streams (int16, BOS/EOS-framed documents) per request type and split."""

    train: dict[str, np.ndarray]
    held_out: dict[str, np.ndarray]


def _frame(docs: list[bytes]) -> np.ndarray:
    parts: list[np.ndarray] = []
    for d in docs:
        parts.append(np.array([BOS_ID], dtype=np.int16))
        parts.append(np.frombuffer(d, dtype=np.uint8).astype(np.int16))
        parts.append(np.array([EOS_ID], dtype=np.int16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)


def _held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_MOD == 0


@functools.cache  # parsing the standard library takes seconds; benchmarks ask many times
def stdlib_sources() -> list[tuple[str, bytes]]:
    """(relative path, bytes) of the standard library's Python sources, sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, bytes]] = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts):
            continue
        data = p.read_bytes()
        if 0 < len(data) <= MAX_FILE_BYTES:
            out.append((str(rel), data))
    return out


@functools.cache  # parsing the standard library takes seconds; benchmarks ask many times
def code_docs() -> tuple[list[bytes], list[bytes]]:
    train: list[bytes] = []
    held: list[bytes] = []
    for rel, data in stdlib_sources():
        (held if _held_out(rel) else train).append(data)
    return train, held


@functools.cache  # parsing the standard library takes seconds; benchmarks ask many times
def prose_docs() -> tuple[list[bytes], list[bytes]]:
    from pydoc_data.topics import topics

    train: list[bytes] = []
    held: list[bytes] = []
    for key in sorted(topics):
        (held if _held_out("topic:" + key) else train).append(topics[key].encode("utf-8"))
    for rel, data in stdlib_sources():
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:  # one-liners are not prose
                    docs.append(doc)
        if docs:
            (held if _held_out(rel) else train).append("\n\n".join(docs).encode("utf-8"))
    return train, held


_FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Ken", "Dennis", "Margaret", "John", "Frances",
          "Leslie", "Radia", "Tim", "Guido", "Linus", "Shafi", "Judea", "Yann", "Fei"]
_LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Thompson", "Ritchie", "Hamilton",
         "McCarthy", "Allen", "Lamport", "Perlman", "Berners-Lee", "van Rossum", "Torvalds", "Goldwasser", "Pearl"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Krakow", "Austin", "Hanoi"]
_STATUS = ["active", "pending", "suspended", "closed"]
_TAGS = ["alpha", "beta", "gold", "trial", "vip", "legacy", "beta-tester", "partner"]


def structured_record(rng: random.Random, schema_version: int) -> dict[str, object]:
    """One JSON record. Version 2 renames, reorders and re-distributes fields (a shifted mix)."""
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    if schema_version == 1:
        return {
            "id": rng.randrange(100000, 999999),
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower().replace(' ', '')}@example.com",
            "age": rng.randrange(18, 90),
            "city": rng.choice(_CITIES),
            "status": rng.choice(_STATUS),
            "balance": round(rng.uniform(0, 10000), 2),
            "tags": rng.sample(_TAGS, rng.randrange(0, 4)),
            "created": f"20{rng.randrange(10, 26)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
        }
    if schema_version == 2:
        return {
            "user_id": f"u-{rng.randrange(0, 16**8):08x}",
            "full_name": f"{last}, {first}",
            "location": {"city": rng.choice(_CITIES), "zip": f"{rng.randrange(10000, 99999)}"},
            "state": rng.choice(_STATUS).upper(),
            "score": rng.randrange(0, 1000),
            "labels": ";".join(rng.sample(_TAGS, rng.randrange(1, 4))),
            "updated_at": f"{rng.randrange(1, 29):02d}/{rng.randrange(1, 13):02d}/20{rng.randrange(10, 26)}",
        }
    raise ValueError(f"unknown structured schema_version {schema_version}; use 1 or 2")


def structured_docs(n_docs: int, seed: int, schema_version: int = 1) -> list[bytes]:
    """``n_docs`` documents, each a JSON array of 4-12 records, one per line (JSON Lines inside brackets)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        recs = [structured_record(rng, schema_version) for _ in range(rng.randrange(4, 13))]
        docs.append(("[\n" + ",\n".join("  " + json.dumps(r) for r in recs) + "\n]\n").encode())
    return docs


STRUCTURED_TRAIN_SEED = 1234
STRUCTURED_HELD_SEED = 98765


def load_corpus(structured_schema: int = 1, structured_docs_train: int = 6000) -> Corpus:
    """Build all streams. Deterministic for a given Python installation."""
    code_train, code_held = code_docs()
    prose_train, prose_held = prose_docs()
    s_train = structured_docs(structured_docs_train, STRUCTURED_TRAIN_SEED, structured_schema)
    s_held = structured_docs(200, STRUCTURED_HELD_SEED, structured_schema)
    return Corpus(
        train={"code": _frame(code_train), "prose": _frame(prose_train), "structured": _frame(s_train)},
        held_out={"code": _frame(code_held), "prose": _frame(prose_held), "structured": _frame(s_held)},
    )


def held_out_prompts(request_type: str, n: int, length: int, seed: int, schema_version: int = 1) -> list[bytes]:
    """``n`` real prompts of ``length`` bytes from the held-out split, cut at seeded offsets.

    Used by the engine benchmark and the demo: prompts the models never trained on.
    """
    if request_type == "code":
        docs = [d for d in code_docs()[1] if len(d) > length + 64]
    elif request_type == "prose":
        docs = [d for d in prose_docs()[1] if len(d) > length + 64]
    elif request_type == "structured":
        docs = [d for d in structured_docs(400, STRUCTURED_HELD_SEED + seed, schema_version) if len(d) > length]
        if not docs:
            blob = b"".join(structured_docs(400, STRUCTURED_HELD_SEED + seed, schema_version))
            docs = [blob]
    else:
        raise ValueError(f"unknown request type {request_type!r}; expected one of {REQUEST_TYPES}")
    if not docs:
        blob = b"\n".join(code_docs()[1] if request_type == "code" else prose_docs()[1])
        docs = [blob]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.choice(docs)
        start = rng.randrange(0, max(1, len(d) - length))
        out.append(d[start : start + length])
    return out


def compression_ratio(data: bytes) -> float:
    """zlib-compressed size over raw size: ~0.1 for degenerate repetition, ~0.3-0.7 for real text."""
    if not data:
        return 0.0
    return len(zlib.compress(data, 9)) / len(data)
