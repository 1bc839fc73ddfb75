"""Answer scoring for HotpotQA / 2WikiMultihopQA-style data: normalisation, EM, token F1.

Normalisation (the HotpotQA/SQuAD recipe, Unicode-aware): casefold, delete punctuation (every
Unicode category P*, so "U.S." becomes "us"), drop the articles "a", "an", "the", collapse whitespace.
Token F1 follows HotpotQA: when either side normalises to "yes", "no" or "noanswer" and the two
differ, F1 is 0. With several gold answers a prediction takes its best score.

Data: JSON lines with `question`, `context`, and `answer` (a string) or `answers` (a list).
`context` is a string, a list of strings, or HotpotQA's list of `[title, [sentence, ...]]`.
"""

from __future__ import annotations

import collections
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

PROMPT_TEMPLATE = ("Answer the question using the context. Reply with a short answer only.\n\n"
                   "Context:\n{context}\n\nQuestion: {question}\nAnswer:")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """Casefold, strip punctuation and articles, collapse whitespace."""
    text = "".join(c for c in text.casefold() if not unicodedata.category(c).startswith("P"))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of the normalised strings (see the module docstring for yes/no)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    if not pred_tokens or not ref_tokens:
        return float(pred_tokens == ref_tokens)
    common = sum((collections.Counter(pred_tokens) & collections.Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def best_scores(prediction: str, golds: list[str]) -> tuple[float, float]:
    """(EM, F1) of a prediction against its best-matching gold answer."""
    if not golds:
        raise ValueError("an example needs at least one gold answer")
    return (max(exact_match(prediction, g) for g in golds),
            max(f1_score(prediction, g) for g in golds))


@dataclass(frozen=True)
class QAExample:
    question: str
    context: str
    answers: tuple[str, ...]

    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(context=self.context, question=self.question)


def _context_text(context, where: str) -> str:
    if isinstance(context, str):
        return context
    if isinstance(context, list):
        paragraphs = []
        for item in context:
            if isinstance(item, str):
                paragraphs.append(item)
            elif (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                  and isinstance(item[1], list) and all(isinstance(s, str) for s in item[1])):
                paragraphs.append(f"{item[0]}: {''.join(item[1])}")
            else:
                raise ValueError(f"{where}: context items must be strings or [title, [sentences]]")
        return "\n".join(paragraphs)
    raise ValueError(f"{where}: context must be a string or a list, got {type(context).__name__}")


def parse_example(record: dict, where: str = "example") -> QAExample:
    """A QAExample from one JSON record (see the module docstring for the fields)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for name in ("question", "context"):
        if name not in record:
            raise ValueError(f"{where}: missing field {name!r}")
    if "answers" in record:
        answers = record["answers"]
        if isinstance(answers, str):
            answers = [answers]
    elif "answer" in record:
        answers = [record["answer"]]
    else:
        raise ValueError(f"{where}: missing field 'answer' or 'answers'")
    if not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{where}: answers must be a non-empty list of strings")
    if not isinstance(record["question"], str):
        raise ValueError(f"{where}: question must be a string")
    return QAExample(record["question"], _context_text(record["context"], where), tuple(answers))


def load_jsonl(path: str | Path, limit: int | None = None) -> list[QAExample]:
    """Examples of a JSON-lines file (blank lines skipped), the first `limit` when given."""
    path = Path(path)
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(examples) >= limit:
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            examples.append(parse_example(record, f"{path}:{lineno}"))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def extract_answer(generated: str) -> str:
    """The first line of a generated answer, stripped."""
    return generated.strip().split("\n", 1)[0].strip()
