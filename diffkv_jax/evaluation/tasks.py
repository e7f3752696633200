"""Answer extraction and scoring per task, and a registry of evaluation tasks.

Extractors and scorers are pure functions of the generated text (HumanEval
runs the program in a child process, never in this one). Every scorer returns
a float in [0, 1]. ``TASKS`` maps a task name to its loader, prompt builder,
scorer and generation defaults, so a CLI can iterate over tasks by name.
"""

from __future__ import annotations

import os
import re
import signal
import string
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from diffkv_jax.evaluation import datasets as ds
from diffkv_jax.evaluation.datasets import Encode, last_boxed

# ---------------------------------------------------------------------------
# GSM8K

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _clean_number(raw: str) -> str:
    """``"$1,234.50"`` -> ``"1234.5"``; integers lose a zero fractional part."""
    s = raw.replace(",", "").replace("$", "").rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def gsm8k_extract(text: str) -> str | None:
    """The final number of a GSM8K solution, normalised (``"1,234."`` -> ``"1234"``).

    Prefers the last "The answer is N" (the few-shot format), then "#### N"
    (the dataset format), then the last number. Text after a new
    ``"Question:"`` is ignored: a base model may go on to invent the next item.
    """
    text = text.split("Question:")[0]
    for pattern in (r"answer is\s*:?\s*\$?\s*(-?[\d,]*\.?\d+)", r"####\s*\$?\s*(-?[\d,]*\.?\d+)"):
        found = re.findall(pattern, text, re.IGNORECASE)
        if found:
            return _clean_number(found[-1])
    numbers = _NUMBER.findall(text)
    return _clean_number(numbers[-1]) if numbers else None


def _as_float(s: str | None) -> float | None:
    try:
        return float(_clean_number(s)) if s is not None else None
    except ValueError:
        return None


def gsm8k_score(text: str, gold: str) -> float:
    """1.0 when the extracted number equals the gold number, else 0.0."""
    pred, ref = _as_float(gsm8k_extract(text)), _as_float(gold)
    return float(pred is not None and ref is not None and abs(pred - ref) < 1e-6)


# ---------------------------------------------------------------------------
# MATH


def math_extract(text: str) -> str | None:
    """The final answer of a MATH solution: last ``\\boxed{}``, else "final answer is $X$"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = re.findall(r"final answer is\s*\$(.+?)\$", text, re.IGNORECASE | re.S)
    if found:
        return found[-1]
    found = re.findall(r"answer is\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", text, re.IGNORECASE)
    return found[-1].strip().strip("$") if found else None


def _brace_arg(s: str, i: int) -> tuple[str, int]:
    """The LaTeX argument starting at ``s[i]`` (a ``{...}`` group or one character)."""
    if i >= len(s):
        return "", i
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == "{") - (s[j] == "}")
        if depth == 0:
            return s[i + 1:j], j + 1
    return s[i + 1:], len(s)


def _fix_fracs(s: str) -> str:
    """``\\frac12`` / ``\\frac9{19}`` -> ``\\frac{1}{2}`` / ``\\frac{9}{19}``."""
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        num, k = _brace_arg(s, j + 5)
        den, k = _brace_arg(s, k)
        out.append(f"{s[i:j]}\\frac{{{_fix_fracs(num)}}}{{{_fix_fracs(den)}}}")
        i = k


_UNIT_SUFFIX = re.compile(  # "5.4 \text{ cents}", "864 \mbox{ inches}^2"
    r"(.*?\d.*?)\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?\d\}?)?")


def normalize_math_answer(answer: str) -> str:
    """Canonical string for a MATH answer, so equal answers written differently compare equal.

    Strips ``\\boxed``, ``$``, spacing commands, ``\\left``/``\\right``,
    degrees, percent, trailing unit words, ``\\text{}`` wrappers, spaces and a
    ``x =`` prefix; writes ``\\dfrac``/``\\tfrac``/``a/b``/``\\frac12`` as
    ``\\frac{a}{b}``, ``.5`` as ``0.5``, ``10,080`` as ``10080`` and ``(C)`` as ``C``.
    """
    s = answer.strip()
    boxed = last_boxed(s)
    s = boxed if boxed is not None else s
    s = s.replace("\n", " ").replace("\\displaystyle", "")
    s = re.sub(r"(?<!\\)\\[!,;: ]", "", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.strip()
    unit = _UNIT_SUFFIX.fullmatch(s)
    if unit:  # "5.4 \text{ cents}": a number followed by its unit
        s = unit.group(1)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm|mathbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace(" ", "")
    lhs = re.fullmatch(r"[A-Za-z](?:_\{?\w+\}?)?=([^=]+)", s)
    if lhs:
        s = lhs.group(1)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    ratio = re.fullmatch(r"(-?)(\d+)/(\d+)", s)
    if ratio:
        s = f"{ratio.group(1)}\\frac{{{ratio.group(2)}}}{{{ratio.group(3)}}}"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    choice = re.fullmatch(r"\(([A-E])\)", s)
    return choice.group(1) if choice else s


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a normalised integer, decimal or ``\\frac{a}{b}``, else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_equiv(pred: str, gold: str) -> bool:
    """Whether two MATH answers match after normalisation (numbers compared by value)."""
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if a == b or (a.isalpha() and a.lower() == b.lower()):
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fa == fb


def math_score(text: str, gold: str) -> float:
    """1.0 when the solution's final answer is equivalent to ``gold``, else 0.0."""
    pred = math_extract(text)
    return float(pred is not None and math_equiv(pred, gold))


# ---------------------------------------------------------------------------
# MMLU


def mmlu_extract(text: str, choices: Sequence[str] | None = None) -> str | None:
    """The chosen letter A-D: a leading letter (``" B."``, ``"(C)"``), "the answer is X",
    or, given ``choices``, a reply that starts with one option's text."""
    t = text.strip()
    lead = re.match(r"\(?([A-D])(?:[).:,]|\s|$)", t)
    if lead:
        return lead.group(1)
    stated = re.findall(r"(?i:answer(?:\s+is)?\s*:?)\s*\(?([A-D])(?![A-Za-z])", t)
    if stated:
        return stated[-1]
    if choices:
        low = t.lower()
        hits = [i for i, c in enumerate(choices) if c.strip() and low.startswith(c.strip().lower())]
        if hits:  # the longest option wins when one is a prefix of another
            return "ABCD"[max(hits, key=lambda i: len(choices[i]))]
    return None


def mmlu_score(text: str, answer: int | str, choices: Sequence[str] | None = None) -> float:
    """1.0 when the extracted letter is the gold one (``answer``: index or letter)."""
    gold = "ABCD"[answer] if isinstance(answer, int) else answer.upper()
    return float(mmlu_extract(text, choices) == gold)


# ---------------------------------------------------------------------------
# LAMBADA


# ASCII punctuation plus curly quotes and the ellipsis character.
_WORD_EDGES = string.punctuation + "\u201c\u201d\u2018\u2019\u2026"


def lambada_extract(text: str) -> str | None:
    """First whitespace-delimited word of the continuation, without surrounding punctuation."""
    parts = text.split()
    word = parts[0].strip(_WORD_EDGES) if parts else ""
    return word or None


def lambada_score(text: str, target: str) -> float:
    """1.0 when the continuation's first word is the target word (case and edge
    punctuation ignored: some shipped targets carry an opening quote, ``"Nadia``)."""
    word = lambada_extract(text)
    return float(word is not None and word.lower() == target.strip().strip(_WORD_EDGES).lower())


# ---------------------------------------------------------------------------
# Reading comprehension (SQuAD-style normalisation)


def normalize_qa_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD rule)."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_exact_match(pred: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    p = normalize_qa_answer(pred)
    return float(any(p == normalize_qa_answer(a) for a in answers))


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_qa_answer(pred).split(), normalize_qa_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, answers: Sequence[str]) -> float:
    """Best token-overlap F1 of the prediction against any gold answer."""
    return max((_f1(pred, a) for a in answers), default=0.0)


def qa_score(text: str, answers: Sequence[str]) -> float:
    """F1 of the first line of ``text``; yes/no questions compare the first word only."""
    line = text.strip().split("\n")[0]
    golds = {normalize_qa_answer(a) for a in answers}
    if golds and golds <= {"yes", "no"}:  # "Yes, they do." is a correct "yes"
        first = normalize_qa_answer(line).split()[:1]
        return float(bool(first) and first[0] in golds)
    return qa_f1(line, answers)


# ---------------------------------------------------------------------------
# Passkey


def passkey_extract(text: str) -> str | None:
    """The first run of digits in the reply."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def passkey_score(text: str, passkey: str) -> float:
    """1.0 when the first number in the reply is the passkey."""
    return float(passkey_extract(text) == passkey)


# ---------------------------------------------------------------------------
# HumanEval

HUMANEVAL_STOPS = ("\nclass", "\nif", "\nprint", "\n#", "\n```")
"""Top-level statements that end a completed function body (the OLMES stop list)."""

# Applied in the child before the candidate runs: a runaway allocation fails
# there instead of swapping the machine. This is a guard, not a sandbox.
_CHILD_PRELUDE = """\
try:
    import resource as _r
    _r.setrlimit(_r.RLIMIT_AS, ({mem}, {mem}))
except Exception:
    pass
"""


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """Source that runs the completed function against the problem's tests.

    A fenced code block is unwrapped. If the completion redefines
    ``entry_point`` it replaces the prompt's stub (the prompt's imports and
    helpers stay); otherwise it is the body, cut at the first top-level stop.
    """
    code = completion
    fenced = re.search(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", code, re.S)
    if fenced:
        code = fenced.group(1)
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        source = f"{prompt}    pass\n\n{code}"
    else:
        cut = min((i for i in (code.find(s) for s in HUMANEVAL_STOPS) if i >= 0), default=len(code))
        source = prompt + code[:cut]
    return f"{source}\n\n{test}\n\ncheck({entry_point})\n"


def run_python(source: str, timeout: float = 10.0, memory_bytes: int = 4 << 30) -> bool:
    """Run ``source`` in a fresh interpreter in a temporary directory; True iff it exits 0.

    The child gets its own session, so on timeout it is killed with anything
    it started.
    """
    with tempfile.TemporaryDirectory(prefix="diffkv_eval_") as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(_CHILD_PRELUDE.format(mem=memory_bytes) + source)
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False


def humaneval_score(completion: str, ex: ds.HumanEvalExample, timeout: float = 10.0) -> float:
    """1.0 when the completed function passes the problem's tests (run in a subprocess)."""
    program = humaneval_program(ex.prompt, completion, ex.test, ex.entry_point)
    return float(run_python(program, timeout))


# ---------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class Task:
    """One evaluation task.

    ``load(limit=None, encode=None)`` returns the examples (``encode`` is
    required only when ``needs_encode``); ``prompt(example)`` the model input;
    ``score(completion, example)`` a float in [0, 1], or ``score`` is None when
    the task has no reference answer (sharegpt: response length is the
    measurement; longppl: perplexity over ``example.token_ids``). ``kind``
    groups tasks by type for negative-sample reports.
    """

    name: str
    kind: str
    load: Callable[..., list]
    prompt: Callable[[Any], str]
    score: Callable[[str, Any], float] | None
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    needs_encode: bool = False


def _plain(loader: Callable[..., list]) -> Callable[..., list]:
    def load(limit: int | None = None, encode: Encode | None = None) -> list:
        return loader(limit=limit)
    return load


def _qa_loader(source: str) -> Callable[..., list]:
    def load(limit: int | None = None, encode: Encode | None = None) -> list:
        return ds.load_qa(source, limit=limit)
    return load


def _require(encode: Encode | None, task: str) -> Encode:
    if encode is None:
        raise ValueError(f"task {task!r} needs a tokenizer: pass encode=tokenizer.encode")
    return encode


def _load_longppl(limit: int | None = None, encode: Encode | None = None,
                  target_tokens: int = 4096) -> list:
    return ds.long_text_documents(_require(encode, "longppl"), target_tokens,
                                  n_docs=8 if limit is None else limit)


def _load_passkey(limit: int | None = None, encode: Encode | None = None) -> list:
    return ds.load_passkey(_require(encode, "passkey"), limit=limit)


_QA_STOPS = ("\n\n", "\nQuestion:")

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("gsm8k", "math", _plain(ds.load_gsm8k), ds.gsm8k_prompt,
         lambda text, ex: gsm8k_score(text, ex.answer), 512, ("Question:", "\n\n")),
    Task("math500", "math", _plain(ds.load_math500), ds.math500_prompt,
         lambda text, ex: math_score(text, ex.answer), 1024, ("Problem:", "\n\n")),
    Task("humaneval", "code", _plain(ds.load_humaneval), ds.humaneval_prompt,
         humaneval_score, 512, HUMANEVAL_STOPS),
    Task("mmlu", "multiple_choice", _plain(ds.load_mmlu), ds.mmlu_prompt,
         lambda text, ex: mmlu_score(text, ex.answer, ex.choices), 8, ("\n",)),
    Task("lambada", "language_modeling", _plain(ds.load_lambada), ds.lambada_prompt,
         lambda text, ex: lambada_score(text, ex.target), 8, ("\n",)),
    *(Task(src, "qa", _qa_loader(src), ds.qa_prompt,
           lambda text, ex: qa_score(text, ex.answers), 16 if src == "qasper" else 50, _QA_STOPS)
      for src in ds.QA_SOURCES),
    Task("sharegpt", "chat", _plain(ds.load_sharegpt), lambda ex: ex.prompt, None, 1024),
    Task("longppl", "perplexity", _load_longppl, lambda ex: ex.text, None, 0,
         needs_encode=True),
    Task("passkey", "retrieval", _load_passkey, lambda ex: ex.prompt,
         lambda text, ex: passkey_score(text, ex.passkey), 16, ("\n",), needs_encode=True),
)}
"""Tasks by name: gsm8k, math500, humaneval, mmlu, lambada, coqa, squad, drop,
qasper, sharegpt, longppl, passkey."""

TASK_NAMES = tuple(TASKS)


def get_task(name: str) -> Task:
    """The registered task ``name``; a ValueError lists the valid names."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}") from None
