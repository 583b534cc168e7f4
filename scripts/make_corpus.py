"""Write the built-in task's corpus: ``src/mixprec/tasks/data/corpus.txt``.

The text is generated here from word lists and templates written for this project (no outside
text, so no licence but the project's), by a small generator with its own pseudo-random numbers
(a 64-bit xorshift): the same file on every Python version and machine. It mixes English prose
about training numerics, lists, tables of numbers and Python-like code, so a character model has
words, punctuation, digits and indentation to learn. ``tests/tasks/test_corpus.py`` checks the
shipped file is what this script writes.

    python scripts/make_corpus.py            # rewrite the file
    python scripts/make_corpus.py --check    # exit 1 if the shipped file differs
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "mixprec" / "tasks" / "data" / "corpus.txt"
TARGET_CHARS = 400_000


class Rng:
    """xorshift64*: tiny, fast, and defined here (Python's own generators may change)."""

    def __init__(self, seed: int) -> None:
        self.state = (seed * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        x = self.state
        x ^= (x >> 12)
        x ^= (x << 25) & 0xFFFFFFFFFFFFFFFF
        x ^= (x >> 27)
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        return (self.next() >> 11) % n

    def pick(self, items):
        return items[self.below(len(items))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


NOUNS = """model layer weight gradient update optimizer scale loss batch step tensor matrix vector
norm activation kernel format exponent mantissa range value sum mean variance buffer copy master
run curve seed device rank shard bucket parameter learning-rate schedule epoch checkpoint result
table column row figure report test reference baseline budget error bound margin history window
product accumulator reduction cast island region block head embedding token sequence dataset""".split()
ADJECTIVES = """small large fresh stale exact rounded scaled unscaled finite infinite dense sparse
sharded local global first last next previous stable noisy careful quiet slow fast cheap costly
visible hidden lower upper safe unsafe healthy broken careful precise coarse narrow wide""".split()
VERBS = """keeps drops rounds scales checks skips halves doubles reads writes stores measures
compares tracks holds moves casts clips sums averages records saves loads restores shards gathers
reduces steps updates warns""".split()
ADVERBS = "quietly exactly rarely often always never slowly quickly twice once again early later".split()
CONNECT = ["because", "while", "unless", "until", "although", "so that", "when", "after", "before", "if"]
FORMATS = ["fp32", "fp16", "bf16", "e4m3", "e5m2", "fp64", "int8"]
NAMES = ["scale", "grad", "loss", "weight", "step", "count", "total", "norm", "value", "limit", "alpha",
         "beta", "eps", "lr", "state", "history", "found_inf", "tracker", "window", "bias"]
FUNCS = ["update", "clip", "measure", "cast", "reduce", "check", "apply", "record", "restore", "split",
         "join", "scan", "fold", "sample", "compare", "summarize"]
BITS = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7), "e4m3": (4, 3), "e5m2": (5, 2), "fp64": (11, 52)}
TITLES = ["Notes on", "A short guide to", "Questions about", "What we learned from", "Checking", "On"]


def noun_phrase(r: Rng) -> str:
    words = []
    if r.chance(40):
        words.append(r.pick(ADJECTIVES))
    if r.chance(20):
        words.append(r.pick(FORMATS))
    words.append(r.pick(NOUNS))
    article = r.pick(["the", "the", "a", "each", "every", "one", "no", "this"])
    if article == "a" and words[0][0] in "aeiou":
        article = "an"
    return f"{article} {' '.join(words)}"


def clause(r: Rng) -> str:
    parts = [noun_phrase(r), r.pick(VERBS), noun_phrase(r)]
    if r.chance(25):
        parts.append(r.pick(ADVERBS))
    if r.chance(20):
        parts.append(f"by {r.below(64) + 1}")
    return " ".join(parts)


def sentence(r: Rng) -> str:
    s = clause(r)
    if r.chance(35):
        s += f" {r.pick(CONNECT)} {clause(r)}"
    if r.chance(15):
        fmt = r.pick(sorted(BITS))
        which = r.below(2)
        s += f" ({fmt} has {BITS[fmt][which]} {('exponent', 'mantissa')[which]} bits)"
    s = s[0].upper() + s[1:]
    return s + r.pick([".", ".", ".", ".", "!", "?", ";"]).replace(";", ".")


def number(r: Rng) -> str:
    kind = r.below(5)
    if kind == 0:
        return str(r.below(10000))
    if kind == 1:
        return f"{r.below(1000) / 100:.2f}"
    if kind == 2:
        return f"2**{r.below(33) - 16}"
    if kind == 3:
        return f"{r.below(9) + 1}.{r.below(100):02d}e-{r.below(30) + 1}"
    return f"-{r.below(500) / 10:.1f}"


def paragraph(r: Rng) -> str:
    return " ".join(sentence(r) for _ in range(r.below(5) + 2))


def listing(r: Rng) -> str:
    lines = []
    for _ in range(r.below(5) + 2):
        lines.append(f"- {r.pick(NOUNS)}: {number(r)} ({r.pick(ADJECTIVES)}, {r.pick(FORMATS)})")
    return "\n".join(lines)


def table(r: Rng) -> str:
    cols = [r.pick(NAMES) for _ in range(r.below(3) + 2)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _ in range(r.below(4) + 2):
        lines.append("| " + " | ".join(number(r) for _ in cols) + " |")
    return "\n".join(lines)


def expression(r: Rng, depth: int = 0) -> str:
    if depth > 1 or r.chance(40):
        return r.pick(NAMES) if r.chance(60) else number(r)
    op = r.pick([" + ", " - ", " * ", " / ", " ** ", " // ", " % "])
    inner = f"{expression(r, depth + 1)}{op}{expression(r, depth + 1)}"
    if r.chance(30):
        return f"{r.pick(FUNCS)}({inner})"
    return f"({inner})" if depth else inner


def code(r: Rng) -> str:
    fn, args = r.pick(FUNCS), sorted({r.pick(NAMES) for _ in range(r.below(3) + 1)})
    lines = [f"def {fn}_{r.pick(NAMES)}({', '.join(args)}):"]
    if r.chance(50):
        lines.append(f'    """{sentence(r)}"""')
    for _ in range(r.below(4) + 1):
        kind = r.below(4)
        if kind == 0:
            lines.append(f"    {r.pick(NAMES)} = {expression(r)}")
        elif kind == 1:
            lines += [f"    for i in range({r.below(100) + 1}):", f"        {r.pick(NAMES)}[i] += {expression(r)}"]
        elif kind == 2:
            lines += [f"    if {r.pick(NAMES)} {r.pick(['<', '>', '==', '!=', '<=', '>='])} {number(r)}:",
                      f"        return {r.pick(['None', 'True', 'False', r.pick(NAMES)])}"]
        else:
            lines.append(f"    # {clause(r)}")
    lines.append(f"    return {expression(r)}")
    return "\n".join(lines)


def document(r: Rng) -> str:
    noun = r.pick(NOUNS)
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + ("es" if noun.endswith(("s", "x", "ch")) else "s")
    title = f"{r.pick(TITLES)} {r.pick(ADJECTIVES)} {plural}"
    blocks = [title + "\n" + "=" * len(title)]
    for _ in range(r.below(6) + 3):
        kind = r.below(10)
        blocks.append(code(r) if kind < 2 else listing(r) if kind < 4 else table(r) if kind < 5 else paragraph(r))
    return "\n\n".join(blocks)


def make_text(seed: int = 2026, target: int = TARGET_CHARS) -> str:
    r = Rng(seed)
    docs, size = [], 0
    while size < target:
        d = document(r)
        docs.append(d)
        size += len(d) + 2
    return "\n\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the shipped corpus differs from what this writes")
    args = ap.parse_args(argv)
    text = make_text()
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="ascii") == text
        print("corpus up to date" if same else f"corpus differs from {OUT}: rerun scripts/make_corpus.py")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="ascii", newline="\n")
    print(f"wrote {OUT} ({len(text)} chars, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
