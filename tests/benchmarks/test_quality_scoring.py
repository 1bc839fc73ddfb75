"""QA answer normalisation, EM/F1, data parsing, and the paired bootstrap."""

import json

import numpy as np
import pytest

from benchmarks.quality import qa_scoring as qa
from benchmarks.quality.evaluate import paired_bootstrap


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple,  a pear ", "apple pear"),
    ("STRASSE", "strasse"),
    ("Straße", "strasse"),                # casefold, not lower
    ("«Théâtre» — l'Odéon", "théâtre lodéon"),  # Unicode punctuation is deleted
    ("U.S.A.", "usa"),
    ("theatre", "theatre"),               # articles only as whole words
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert qa.normalize_answer(text) == expected


def test_exact_match_and_f1_on_hand_made_cases():
    assert qa.exact_match("the Beatles.", "Beatles") == 1.0
    assert qa.exact_match("Beatles band", "Beatles") == 0.0
    # pred {paris, france}, gold {paris}: precision 1/2, recall 1 -> F1 2/3
    assert qa.f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)
    # pred {new, york, city}, gold {york, new}: common 2, P 2/3, R 1 -> F1 0.8
    assert qa.f1_score("New York City", "the new york") == pytest.approx(0.8)
    # repeated tokens count with multiplicity: common min(3,1)=1, P 1/3, R 1 -> 0.5
    assert qa.f1_score("go go go", "go") == pytest.approx(0.5)
    assert qa.f1_score("London", "Paris") == 0.0
    assert qa.f1_score("yes it is", "yes") == 0.0   # yes/no answers must match exactly
    assert qa.f1_score("No.", "no") == 1.0
    assert qa.f1_score("", "") == 1.0 and qa.f1_score("the", "Paris") == 0.0


def test_best_scores_over_several_answers():
    em, f1 = qa.best_scores("Barack Obama", ["Obama", "Barack Hussein Obama", "Barack Obama"])
    assert (em, f1) == (1.0, 1.0)
    em, f1 = qa.best_scores("president Obama", ["Obama", "Barack Obama"])
    assert em == 0.0 and f1 == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least one gold"):
        qa.best_scores("x", [])


def test_jsonl_parsing_of_hotpot_and_plain_records(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [
        {"question": "Who?", "context": [["Title A", ["First.", " Second."]], ["B", ["Third."]]],
         "answer": "Ann"},
        {"question": "Where?", "context": "Plain text.", "answers": ["Rome", "Roma"]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    examples = qa.load_jsonl(path)
    assert examples[0].context == "Title A: First. Second.\nB: Third."
    assert examples[0].answers == ("Ann",) and examples[1].answers == ("Rome", "Roma")
    assert examples[1].prompt().endswith("Question: Where?\nAnswer:")
    assert "Plain text." in examples[1].prompt()
    assert len(qa.load_jsonl(path, limit=1)) == 1
    path.write_text(json.dumps({"question": "q", "context": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:1: missing field 'answer'"):
        qa.load_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        qa.load_jsonl(path)


def test_extract_answer_takes_the_first_line():
    assert qa.extract_answer(" Paris\nQuestion: next") == "Paris"
    assert qa.extract_answer("\n") == ""


def test_paired_bootstrap_known_answers():
    rng = np.random.default_rng(0)
    a = rng.normal(size=200)
    mean, lo, hi = paired_bootstrap(a, a.copy())
    assert mean == 0.0 and lo == 0.0 and hi == 0.0
    # b = a - 1 + small noise: the paired difference is ~1 with sd 0.1, interval near 1, not 0.
    b = a - 1.0 + rng.normal(scale=0.1, size=200)
    mean, lo, hi = paired_bootstrap(a, b)
    assert lo > 0.9 and hi < 1.1 and lo < mean < hi
    # Pairing matters: the unpaired spread of a (sd 1) would not give so tight an interval.
    assert hi - lo < 0.1
    # The seed draws the resamples: the same seed gives the same interval, another seed another
    # (so the first equality is not a call compared with a seed it ignores); the interval widens
    # with the confidence level.
    assert paired_bootstrap(a, b, seed=5) == paired_bootstrap(a, b, seed=5)
    assert paired_bootstrap(a, b, seed=5)[1:] != paired_bootstrap(a, b, seed=6)[1:]
    _, lo99, hi99 = paired_bootstrap(a, b, confidence=0.99)
    assert lo99 <= lo and hi99 >= hi
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap(a, b[:-1])
