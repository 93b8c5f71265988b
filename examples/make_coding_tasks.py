"""Writes examples/coding_tasks.jsonl: the 30 hand-written problems plus 260 generated from 26 parametrised families.

    python examples/make_coding_tasks.py        # rewrites the file (deterministic: the same bytes every time)

RL needs many problems for a signal; writing 200 by hand is not the honest way to get them, so each
family is one function-writing problem with a parameter (a divisor, a base, a width, a character, ...):
ten settings make ten problems whose prompts, tests and answers all differ. Each problem's hidden tests
call the function on fixed inputs and compare with what the reference solution returns (computed here,
by running the reference), and `tests/integration/test_coding_env.py` runs every reference solution
against its hidden tests in the real Docker sandbox. Train and eval are disjoint by problem: in every
family the last two settings are eval problems, never trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
HANDWRITTEN = HERE / "coding_tasks_handwritten.jsonl"
OUT = HERE / "coding_tasks.jsonl"
EVAL_SETTINGS = 2  # per family, the last settings are the eval split


@dataclass(frozen=True)
class Family:
    name: str  # the function the problem asks for
    signature: str
    prompt: Callable[[Any], str]  # what the function does, for one setting
    solution: Callable[[Any], str]  # the reference, for one setting
    settings: tuple
    inputs: tuple  # argument tuples the hidden tests call it with


def _fizz(p):
    a, b = p
    return (f"def fizz(n):\n    out = []\n    for i in range(1, n + 1):\n        word = ('Fizz' if i % {a} == 0 else '') + ('Buzz' if i % {b} == 0 else '')\n"
            "        out.append(word or str(i))\n    return out\n")


FAMILIES = [
    Family("sum_multiples", "n", lambda p: f"returns the sum of the positive integers below `n` that are divisible by {p[0]} or by {p[1]}",
           lambda p: f"def sum_multiples(n):\n    return sum(i for i in range(1, n) if i % {p[0]} == 0 or i % {p[1]} == 0)\n",
           ((3, 5), (2, 7), (4, 6), (3, 7), (5, 8), (2, 9), (6, 10), (7, 11), (3, 11), (4, 9)), ((10,), (100,), (1,))),
    Family("power_sum", "n", lambda k: f"returns 1**{k} + 2**{k} + ... + n**{k} (0 when n is 0)",
           lambda k: f"def power_sum(n):\n    return sum(i ** {k} for i in range(1, n + 1))\n",
           tuple(range(1, 11)), ((0,), (3,), (10,))),
    Family("rotate_left", "xs", lambda k: f"returns the list `xs` rotated left by {k} positions (the first {k} elements move to the end, cyclically; an empty list stays empty)",
           lambda k: f"def rotate_left(xs):\n    if not xs:\n        return []\n    k = {k} % len(xs)\n    return xs[k:] + xs[:k]\n",
           tuple(range(1, 11)), (([1, 2, 3, 4, 5],), ([],), ([7, 8, 9, 10, 11, 12, 13],))),
    Family("caesar", "s", lambda k: f"shifts every letter of `s` {k} places forward in the alphabet, wrapping from z to a and keeping its case; other characters are unchanged",
           lambda k: ("def caesar(s):\n    out = []\n    for ch in s:\n        if ch.islower():\n"
                      f"            out.append(chr((ord(ch) - 97 + {k}) % 26 + 97))\n        elif ch.isupper():\n"
                      f"            out.append(chr((ord(ch) - 65 + {k}) % 26 + 65))\n        else:\n            out.append(ch)\n    return ''.join(out)\n"),
           tuple(range(1, 11)), (("hello",), ("Zebra, Yak!",), ("",))),
    Family("chunk", "xs", lambda k: f"splits the list `xs` into consecutive chunks of {k} elements (the last chunk may be shorter) and returns the list of chunks",
           lambda k: f"def chunk(xs):\n    return [xs[i:i + {k}] for i in range(0, len(xs), {k})]\n",
           tuple(range(2, 12)), ((list(range(10)),), ([],), ([5, 6, 7],))),
    Family("count_char", "s", lambda c: f"returns how many times the letter {c!r} appears in `s`, in either case",
           lambda c: f"def count_char(s):\n    return s.lower().count({c!r})\n",
           tuple("aeiostnrlm"), (("Sassafras and Tomatoes",),  ("",), ("MISSISSIPPI moon lamp trail",))),
    Family("fizz", "n", lambda p: f"returns the list for 1..n where a number divisible by {p[0]} becomes 'Fizz', one divisible by {p[1]} becomes 'Buzz', one divisible by both 'FizzBuzz', and any other number its decimal string",
           _fizz, ((3, 5), (2, 3), (4, 7), (3, 4), (2, 5), (5, 7), (3, 8), (6, 9), (2, 7), (4, 5)), ((15,), (1,), (0,))),
    Family("clamp_all", "xs", lambda p: f"returns a new list in which every number of `xs` is clamped to the range [{p[0]}, {p[1]}]",
           lambda p: f"def clamp_all(xs):\n    return [min(max(x, {p[0]}), {p[1]}) for x in xs]\n",
           ((0, 10), (-5, 5), (1, 3), (10, 20), (-100, 0), (2, 2), (0, 1), (-3, 7), (5, 50), (-1, 1)), (([-20, 0, 3, 15, 60],), ([],), ([2, 2, 9],))),
    Family("digit_sum_base", "n", lambda b: f"returns the sum of the digits of the non-negative integer `n` written in base {b}",
           lambda b: f"def digit_sum_base(n):\n    total = 0\n    while n:\n        total += n % {b}\n        n //= {b}\n    return total\n",
           tuple(range(2, 12)), ((0,), (255,), (1000,))),
    Family("to_base", "n", lambda b: f"returns the non-negative integer `n` written in base {b} as a string, using digits 0-9 and then lowercase letters ('0' for zero)",
           lambda b: ("def to_base(n):\n    digits = '0123456789abcdefghijklmnopqrstuvwxyz'\n    if n == 0:\n        return '0'\n    out = ''\n"
                      f"    while n:\n        out = digits[n % {b}] + out\n        n //= {b}\n    return out\n"),
           (2, 3, 4, 5, 6, 7, 8, 9, 12, 16), ((0,), (10,), (12345,))),
    Family("every_kth", "xs", lambda k: f"returns every {k}th element of the list `xs`: the elements at positions {k}, {2 * k}, ... counting from 1",
           lambda k: f"def every_kth(xs):\n    return xs[{k - 1}::{k}]\n",
           tuple(range(1, 11)), ((list(range(1, 25)),), ([],), (["a", "b", "c"],))),
    Family("repeat_chars", "s", lambda k: f"returns `s` with every character repeated {k} times in place",
           lambda k: f"def repeat_chars(s):\n    return ''.join(ch * {k} for ch in s)\n",
           tuple(range(2, 12)), (("abc",), ("",), ("a b!",))),
    Family("pad_left", "s", lambda p: f"returns `s` padded on the left with {p[0]!r} to a width of {p[1]} characters (a longer `s` is returned unchanged)",
           lambda p: f"def pad_left(s):\n    return s.rjust({p[1]}, {p[0]!r})\n",
           (("0", 5), ("*", 8), (" ", 6), ("-", 10), ("#", 4), ("x", 7), (".", 12), ("0", 3), ("_", 9), ("+", 11)), (("42",), ("",), ("abcdefghijklmn",))),
    Family("top_k", "xs", lambda k: f"returns the {k} largest numbers of `xs` in descending order (all of them, sorted descending, when there are fewer than {k})",
           lambda k: f"def top_k(xs):\n    return sorted(xs, reverse=True)[:{k}]\n",
           tuple(range(1, 11)), (([5, 1, 9, 3, 7, 9, 2, 8, 6, 4, 0, 11],), ([],), ([3, -1],))),
    Family("window_sums", "xs", lambda k: f"returns the sums of every run of {k} consecutive elements of `xs`, in order (an empty list when `xs` has fewer than {k} elements)",
           lambda k: f"def window_sums(xs):\n    return [sum(xs[i:i + {k}]) for i in range(len(xs) - {k} + 1)]\n",
           tuple(range(1, 11)), ((list(range(1, 16)),), ([],), ([4, -2, 7],))),
    Family("count_divisible", "xs", lambda k: f"returns how many integers in `xs` are divisible by {k}",
           lambda k: f"def count_divisible(xs):\n    return sum(1 for x in xs if x % {k} == 0)\n",
           tuple(range(2, 12)), ((list(range(-10, 60)),), ([],), ([7, 14, 21, 22],))),
    Family("remove_char", "s", lambda c: f"returns `s` without any occurrence of the character {c!r}",
           lambda c: f"def remove_char(s):\n    return s.replace({c!r}, '')\n",
           tuple("ae ,.-lo!s"), (("hello, world - a test.",), ("",), ("sassy lemons!!",))),
    Family("truncate", "s", lambda w: f"returns `s` unchanged if it has at most {w} characters, otherwise its first {w} characters followed by '...'",
           lambda w: f"def truncate(s):\n    return s if len(s) <= {w} else s[:{w}] + '...'\n",
           tuple(range(3, 13)), (("abcdefghijklmnopqrstuvwxyz",), ("",), ("short",))),
    Family("polygonal", "n", lambda s: f"returns the n-th {s}-gonal number: (({s} - 2) * n * n - ({s} - 4) * n) // 2",
           lambda s: f"def polygonal(n):\n    return (({s} - 2) * n * n - ({s} - 4) * n) // 2\n",
           tuple(range(3, 13)), ((1,), (5,), (20,))),
    Family("interleave", "a, b", lambda k: f"merges the lists `a` and `b` by taking {k} elements from `a`, then {k} from `b`, and so on; when one runs out, the rest of the other follows",
           lambda k: ("def interleave(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) or j < len(b):\n"
                      f"        out += a[i:i + {k}]\n        i += {k}\n        out += b[j:j + {k}]\n        j += {k}\n    return out\n"),
           tuple(range(1, 11)), ((list(range(1, 12)), list(range(100, 105))), ([], [1, 2]), ([1], []))),
    Family("square_sum_mod", "xs", lambda m: f"returns the sum of x * x over the integers x in `xs`, modulo {m}",
           lambda m: f"def square_sum_mod(xs):\n    return sum(x * x for x in xs) % {m}\n",
           (7, 10, 11, 13, 17, 97, 100, 101, 1000, 9973), ((list(range(50)),), ([],), ([-3, 4, 12345],))),
    Family("count_long_words", "s", lambda k: f"returns how many whitespace-separated words of `s` are longer than {k} characters",
           lambda k: f"def count_long_words(s):\n    return sum(1 for w in s.split() if len(w) > {k})\n",
           tuple(range(1, 11)), (("a bb ccc dddd eeeee ffffff ggggggg hhhhhhhh iiiiiiiii jjjjjjjjjj kkkkkkkkkkk",), ("",), ("extraordinarily long words abound",))),
    Family("keep_multiples", "xs", lambda k: f"returns the elements of `xs` that are multiples of {k}, in their original order",
           lambda k: f"def keep_multiples(xs):\n    return [x for x in xs if x % {k} == 0]\n",
           tuple(range(2, 12)), ((list(range(-12, 45)),), ([],), ([1, 2, 3],))),
    Family("acronym", "s", lambda sep: f"returns the upper-case first letters of the whitespace-separated words of `s`, joined by {sep!r}",
           lambda sep: f"def acronym(s):\n    return {sep!r}.join(w[0].upper() for w in s.split())\n",
           (".", "-", "", "_", ":", "/", "+", "*", "|", "~"), (("portable network graphics",), ("",), ("  as   soon as possible ",))),
    Family("digit_power_sum", "n", lambda k: f"returns the sum of each decimal digit of the non-negative integer `n` raised to the power {k}",
           lambda k: f"def digit_power_sum(n):\n    return sum(int(d) ** {k} for d in str(n))\n",
           tuple(range(1, 11)), ((0,), (153,), (9876,))),
    Family("staircase", "n", lambda c: f"returns a list of `n` strings, the i-th (from 1) being the character {c!r} repeated i times",
           lambda c: f"def staircase(n):\n    return [{c!r} * i for i in range(1, n + 1)]\n",
           tuple("#*x+@o=%-~"), ((0,), (1,), (4,))),
]


def _run(source: str, name: str, args: tuple):
    namespace: dict = {}
    exec(source, namespace)
    return namespace[name](*[list(a) if isinstance(a, list) else a for a in args])


def generated() -> list[dict]:
    rows = []
    for family in FAMILIES:
        assert len(family.settings) == 10 and len(set(family.settings)) == 10, family.name
        for i, setting in enumerate(family.settings):
            solution = family.solution(setting)
            tests = [f"from solution import {family.name}"]
            for j, args in enumerate(family.inputs):
                expected = _run(solution, family.name, args)
                call = ", ".join(repr(a) for a in args)
                tests.append(f"def test_{j + 1}():\n    assert {family.name}({call}) == {expected!r}")
            rows.append({
                "id": f"g-{family.name}-{i:02d}",
                "split": "eval" if i >= len(family.settings) - EVAL_SETTINGS else "train",
                "prompt": f"Write a Python function `{family.name}` in the file solution.py. `{family.name}({family.signature})` {family.prompt(setting)}.",
                "solution": solution,
                "tests": "\n".join(tests) + "\n",
                "family": family.name,
            })
    return rows


def main() -> None:
    handwritten = [json.loads(line) for line in HANDWRITTEN.read_text().splitlines() if line.strip()]
    rows = handwritten + generated()
    assert len({r["id"] for r in rows}) == len(rows) and len({r["prompt"] for r in rows}) == len(rows)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = [r["split"] for r in rows]
    print(f"{OUT.name}: {len(rows)} problems ({splits.count('train')} train, {splits.count('eval')} eval)")


if __name__ == "__main__":
    main()
