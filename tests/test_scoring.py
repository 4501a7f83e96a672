"""Scoring functions against hand-worked cases, normalization edge cases included."""
from __future__ import annotations

import pytest

from cachesmith.instance import WorkloadInstance
from cachesmith.scoring import normalize_answer, score, set_f1, short_answer, token_f1


def inst(task: str, gold: tuple[str, ...]) -> WorkloadInstance:
    return WorkloadInstance(task=task, documents=("doc",), question="q?", gold=gold)


@pytest.mark.parametrize("raw, expected", [
    ("The Eiffel Tower.", "eiffel tower"),
    ("  an   APPLE, a pear ", "apple pear"),
    ("theatre", "theatre"),  # "the" inside a word is not an article
    ("A-B", "ab"),  # punctuation is removed, not replaced by a space (SQuAD/LongBench behaviour)
    ("", ""),
    ("!!!", ""),
    ("Über café", "über café"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_token_f1_hand_worked():
    # pred tokens [port, lantern, town], gold [port, lantern]: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("Port Lantern town", "Port Lantern") == pytest.approx(0.8)
    assert token_f1("the", "a") == 0.0  # both normalize to nothing in common
    assert token_f1("Lantern Lantern", "Lantern") == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_set_f1_hand_worked():
    assert set_f1(["A", "B"], ["A", "B", "C", "D"]) == pytest.approx(2 * 1 * 0.5 / 1.5)  # 0.667
    assert set_f1(["A", "X", "Y"], ["A", "B"]) == pytest.approx(2 * (1 / 3) * 0.5 / (1 / 3 + 0.5))  # 0.4
    assert set_f1([], ["A"]) == 0.0
    assert set_f1(["A", "A"], ["A"]) == 1.0


def test_short_answer_cuts_at_first_clause():
    assert short_answer("Port Lantern, a small town.\nMore") == "Port Lantern"
    assert short_answer(" Amberfield.") == "Amberfield"
    assert short_answer("St.Ives is") == "St.Ives is"  # a period inside a word is not an end


def test_pr_scores_the_first_number():
    case = inst("pr", ("Paragraph 3",))
    assert score(case, " 3: The tomato").passed
    assert not score(case, " 13").passed and not score(case, " 4, not 3").passed
    assert not score(case, "none").passed and score(case, "none").extracted == ""


def test_msq_exact_match_after_normalization():
    case = inst("msq", ("Port Lantern",))
    good = score(case, " port lantern. It lies on the coast")
    assert good.passed and good.value == 1.0 and good.f1 == 1.0
    partial = score(case, " Lantern")
    assert not partial.passed and partial.f1 == pytest.approx(2 / 3)


def test_set_tasks_pass_above_half():
    mv = inst("mv", ("1111111", "2222222", "3333333", "4444444"))
    assert score(mv, "1111111, 2222222 and 9999999").value == pytest.approx(4 / 7)  # P 2/3, R 1/2
    assert score(mv, "1111111, 2222222 and 9999999").passed
    assert not score(mv, "1111111 and 9999999").passed  # P 1/2, R 1/4 -> F1 1/3
    vt = inst("vt", ("ABCDE", "FGHIJ"))
    assert score(vt, "VAR ABCDE, VAR FGHIJ").value == 1.0
    assert score(vt, "ABCDE FGHIJ").extracted == score(vt, "FGHIJ and ABCDE").extracted


def test_user_workloads_match_gold_on_word_boundaries():
    case = inst("custom", ("Paris",))
    assert score(case, "It is Paris, France.").passed
    assert not score(case, "Parisian food").passed
