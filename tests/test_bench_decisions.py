"""bench/decisions.py --quick: one decision against the chat requests asking the same questions (with the server's
default max_tokens, and with max_tokens 8), each with a numeric ratio and a verdict, the answers compared; and the
rerank part's rows (the chat model, a tiny reranker on lmserve, and on llama-server or skipped without its binary).

Timings are never asserted (the goal is the full benchmark's business, on a quiet machine).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.bench_quick import run_quick

TIMEOUT_S = 300
RATIO = re.compile(r"^\| decisions / (?P<peer>chat|chat, max_tokens 8), wall \| (?P<ratio>\d+\.\d+)x \| <= 0\.1x \| "
                   r"(?P<verdict>PASS|MISS) \|$", re.MULTILINE)
QUESTIONS = 8
"""Fewer than --quick's 20: enough to batch the questions, share their opening and compare the answers."""
SMALLEST = ("--doc-tokens", "200", "--questions", str(QUESTIONS), "--documents", str(QUESTIONS))
AGREEMENT = re.compile(rf"^\| same answer as the decision \| - \| \d+/{QUESTIONS} \(\d+%\) "
                       rf"\| \d+/{QUESTIONS} \(\d+%\) \|$", re.MULTILINE)
TINY = re.compile(r"^\| tiny BERT reranker[^|]* \| (?P<server>lmserve|llama-server) \| "
                  r"(?P<ms>\d+\.\d+|- \| skipped: no binary) \|", re.MULTILINE)


def test_quick_prints_both_ratios_the_agreement_and_the_rerank_rows(model_path: Path) -> None:
    code, out = run_quick("decisions.py", "--model", str(model_path), *SMALLEST, timeout_s=TIMEOUT_S)
    assert code == 0, out[-3000:]
    ratios = {m["peer"]: float(m["ratio"]) for m in RATIO.finditer(out)}
    assert sorted(ratios) == ["chat", "chat, max_tokens 8"], out[-3000:]
    assert all(value > 0 for value in ratios.values()), ratios
    assert AGREEMENT.search(out), out[-3000:]
    assert f"| requests | 1 | {QUESTIONS} | {QUESTIONS} |" in out, out[-3000:]
    assert re.search(r"^\| \S+ \(chat model judging: P\(Yes\)\) \| lmserve \| \d+\.\d+ \|", out, re.MULTILINE), out
    tiny = {m["server"]: m["ms"] for m in TINY.finditer(out)}
    assert sorted(tiny) == ["llama-server", "lmserve"], out[-3000:]
    assert float(tiny["lmserve"]) > 0
    if tiny["llama-server"][0].isdigit():  # both ran: the same GGUF gives the same scores
        assert "lmserve / llama-server, tiny reranker, ms per passage: " in out, out[-3000:]
        delta = re.search(r"max abs difference (\S+) \(after a sigmoid\)", out)
        assert delta and float(delta[1]) < 1e-3, out[-3000:]


def test_the_chat_side_asks_each_question_in_the_words_a_decision_uses() -> None:
    from bench.decisions import make_questions, make_towns
    from lmserve.service.judging import question_text
    from lmserve.types import Question

    for ask in make_questions(make_towns(4), 9):
        question = Question(ask.body["type"], ask.body["instructions"], list(ask.answers))
        assert ask.text == question_text(question)
