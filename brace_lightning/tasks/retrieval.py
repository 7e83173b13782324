"""Search-R1-style retrieval QA: a BM25 search tool over a small local corpus, exact-match verifier.

The policy searches with ``<search>QUERY</search>``; the environment appends the top passages in
``<info>...</info>``; the policy ends the episode with ``<answer>TEXT</answer>``::

    Question: Who discovered penicillin?
    <search>penicillin discovered</search><info>Penicillin: Penicillin is an antibiotic. Alexander
    Fleming discovered it in 1928.</info><answer>Alexander Fleming</answer>

The repository ships the corpus (``tasks/data/wiki_corpus.jsonl``: 66 short encyclopedic passages,
``{"id", "title", "text"}`` per line) and questions answered by it (``tasks/data/wiki_qa.jsonl``:
``{"question", "answers"}``, the answers a list of accepted aliases). Both are plain ASCII, so the
character tokenizer covers them.

BM25 (Robertson & Zaragoza 2009, the Okapi weighting with Lucene's non-negative idf), implemented
here in pure Python: for query tokens ``q`` (with repetition) and a document ``d`` of length
``|d|`` in a corpus of ``N`` documents with mean length ``avgdl``::

    score(d) = Σ_q idf(q) · tf(q, d) · (k1 + 1) / (tf(q, d) + k1 · (1 − b + b · |d| / avgdl))
    idf(q)   = ln(1 + (N − n(q) + 0.5) / (n(q) + 0.5))

where ``n(q)`` counts the documents containing ``q``. Tokens are lowercase runs of letters and
digits; a document is its title and text. Ties are broken by corpus order.

Verification is SQuAD/Search-R1 exact match after normalisation (lowercase, punctuation and the
articles a/an/the removed, whitespace collapsed) of the last ``<answer>`` against any alias.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from brace_lightning.tasks.base import Prompt, PromptList
from brace_lightning.tasks.env import ToolEnvironment, last_call, strip_blocks
from brace_lightning.tasks.jsonl import read_jsonl, shown

DEFAULT_QA_TEMPLATE = "Question: {question}\n"
_TOKEN = re.compile(r"[a-z0-9]+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _data_file(name: str) -> Path:
    return Path(str(resources.files("brace_lightning.tasks").joinpath("data", name)))


#: The shipped corpus and question files.
DEFAULT_CORPUS = _data_file("wiki_corpus.jsonl")
DEFAULT_QA = _data_file("wiki_qa.jsonl")


def bm25_tokenize(text: str) -> list[str]:
    """Lowercase runs of ASCII letters and digits: ``"Mont-Blanc, 4808 m"`` → ``["mont", "blanc",
    "4808", "m"]``."""
    return _TOKEN.findall(text.lower())


class BM25:
    """An Okapi BM25 index over ``documents`` (see the module docstring for the formula).

    Args:
        documents: the texts to index (at least one).
        k1: term-frequency saturation, > 0.
        b: length normalisation in [0, 1].
    """

    def __init__(self, documents: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not documents:
            raise ValueError("BM25 got no documents; expected at least one.")
        if not k1 > 0:
            raise ValueError(f"BM25 got k1={k1!r}; expected a value > 0.")
        if not 0 <= b <= 1:
            raise ValueError(f"BM25 got b={b!r}; expected a value in [0, 1].")
        self.k1, self.b = float(k1), float(b)
        self.term_counts = [Counter(bm25_tokenize(doc)) for doc in documents]
        self.lengths = [sum(counts.values()) for counts in self.term_counts]
        self.avgdl = sum(self.lengths) / len(self.lengths)
        frequency = Counter(term for counts in self.term_counts for term in counts)
        n = len(documents)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}

    def __len__(self) -> int:
        return len(self.term_counts)

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for ``query``."""
        terms = [t for t in bm25_tokenize(query) if t in self.idf]
        out = []
        for counts, length in zip(self.term_counts, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / max(self.avgdl, 1e-12))
            score = 0.0
            for term in terms:
                tf = counts.get(term, 0)
                if tf:
                    score += self.idf[term] * tf * (self.k1 + 1) / (tf + norm)
            out.append(score)
        return out

    def search(self, query: str, k: int) -> list[int]:
        """Indices of the (at most) ``k`` best documents with a positive score, best first."""
        scores = self.scores(query)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [i for i in order[:k] if scores[i] > 0]


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(predicted: str | None, answers: Sequence[str]) -> bool:
    """Whether ``predicted`` equals any of ``answers`` after :func:`normalize_answer`."""
    if predicted is None:
        return False
    return normalize_answer(predicted) in {normalize_answer(a) for a in answers}


def _read_jsonl(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist.")
    records = []
    for where, record in read_jsonl(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: got {shown(record)}; expected an object.")
        records.append(record)
    return records


def load_corpus(path: str | Path | None = None) -> list[tuple[str, str]]:
    """``(title, text)`` passages of a JSONL corpus (None = the shipped one)."""
    path = DEFAULT_CORPUS if path is None else Path(path)
    passages = []
    for number, record in enumerate(_read_jsonl(path, "corpus"), start=1):
        if not all(isinstance(record.get(key), str) for key in ("title", "text")):
            raise ValueError(
                f"{path}: record {number} lacks string fields 'title' and 'text'; expected both."
            )
        passages.append((record["title"], record["text"]))
    if not passages:
        raise ValueError(f"corpus file {str(path)!r} holds no passages; expected at least one.")
    return passages


class RetrievalQA(PromptList):
    """Questions with accepted answers from a JSONL file (None = the shipped ``wiki_qa.jsonl``).

    Each line is ``{"question": str, "answers": [str, ...]}``; ``Prompt.answer`` is the first alias
    and ``Prompt.metadata["answers"]`` holds them all.

    Args:
        source: path of the JSONL file; None uses the questions shipped with the package.
        prompt_template: format string with a ``{question}`` field.
    """

    def __init__(
        self, source: str | None = None, *, prompt_template: str = DEFAULT_QA_TEMPLATE
    ) -> None:
        if "{question}" not in prompt_template:
            raise ValueError(
                f"RetrievalQA got prompt_template={prompt_template!r}; expected a '{{question}}' "
                "field."
            )
        path = DEFAULT_QA if source is None else Path(source)
        self.prompts = []
        for number, record in enumerate(_read_jsonl(path, "QA"), start=1):
            answers = record.get("answers")
            if (
                not isinstance(record.get("question"), str)
                or not isinstance(answers, list)
                or not answers
                or not all(isinstance(a, str) for a in answers)
            ):
                raise ValueError(
                    f"{path}: record {number} needs a string 'question' and a non-empty list of "
                    "string 'answers'."
                )
            self.prompts.append(
                Prompt(
                    text=prompt_template.format(question=record["question"]),
                    answer=answers[0],
                    metadata={"answers": list(answers), "question": record["question"]},
                )
            )
        if not self.prompts:
            raise ValueError(f"QA file {str(path)!r} holds no questions; expected at least one.")


class RetrievalEnv(ToolEnvironment):
    """BM25 search tool environment with the exact-match verifier.

    Args:
        corpus: JSONL corpus path; None uses the passages shipped with the package.
        top_k: passages returned per search.
        k1, b: BM25 parameters.
        max_turns: searches answered per episode.
        max_response_tokens: transcript token budget per episode (observations included).
    """

    def __init__(
        self,
        *,
        corpus: str | None = None,
        top_k: int = 2,
        k1: float = 1.5,
        b: float = 0.75,
        max_turns: int = 2,
        max_response_tokens: int = 512,
    ) -> None:
        super().__init__(max_turns=max_turns, max_response_tokens=max_response_tokens)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1; got {top_k!r}.")
        self.passages = load_corpus(corpus)
        self.index = BM25([f"{title} {text}" for title, text in self.passages], k1=k1, b=b)
        self.top_k = top_k

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ("</search>", "</answer>")

    def observe(self, prompt: Prompt, transcript: str) -> str | None:
        """``<info>`` with the top passages for a search; None after ``</answer>`` (done)."""
        if transcript.endswith("</answer>"):
            return None
        query = last_call(transcript, "search")
        if query is None:
            return "<info>error: no <search> before </search></info>"
        hits = self.index.search(query, self.top_k)
        if not hits:
            return "<info>no results</info>"
        return (
            "<info>"
            + "\n".join(f"{t}: {x}" for t, x in (self.passages[i] for i in hits))
            + ("</info>")
        )

    def error_observation(self, message: str) -> str:
        return f"<info>error: {message}</info>"

    @staticmethod
    def final_answer(transcript: str) -> str | None:
        """The text of the last ``<answer>...</answer>`` outside ``<info>`` blocks, or None.

        Each ``<answer>`` is paired with the first ``</answer>`` after it, left to right (what
        ``re.findall(r"<answer>(.*?)</answer>")`` gives), by a single forward scan: linear time even
        for many unclosed tags, where the regex is quadratic."""
        text = strip_blocks(transcript, ("info",))
        found, position = None, 0
        while (start := text.find("<answer>", position)) >= 0:
            end = text.find("</answer>", start + len("<answer>"))
            if end < 0:
                break
            found, position = text[start + len("<answer>") : end], end + len("</answer>")
        return found

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self.is_correct(prompt, completion) else 0.0

    def is_correct(self, prompt: Prompt, completion: str) -> bool:
        """Exact match of the final answer with any accepted alias (``metadata["answers"]``)."""
        return exact_match(
            self.final_answer(completion), prompt.metadata.get("answers", [prompt.answer])
        )
