"""`atom-moe gsm8k`: GSM8K accuracy of a live OpenAI-compatible server (vLLM, SGLang).

Sends lm-eval-style few-shot GSM8K prompts to /v1/completions (prompt text) or
/v1/chat/completions (few-shot as chat turns; the server applies the chat template) with
greedy decoding, and scores the replies with lm-eval's two gsm8k filters, strict-match and
flexible-extract, and its exact_match metric. With --threshold it is a deployment gate:
exit 1 when the chosen metric is below it. Exit 2 on bad input or an unreachable server.

Few-shot examples: the first --num-fewshot items of --fewshot-data (GSM8K's train split);
without it, the first --num-fewshot items of --data, which are then not evaluated; with
neither file, the train split of HuggingFace's openai/gsm8k. See docs/gsm8k.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .args import nonnegative_int, positive_float, positive_int, unit_interval
from .gsm8k_metrics import METRICS, score_response

DEFAULT_STOP = ["Question:", "</s>", "<|im_end|>"]  # lm-eval gsm8k's `until`
HF_DATASET = ("openai/gsm8k", "main")
FORMAT_HINT = '{"question": "...", "answer": "... #### 42"}'
RETRY_STATUSES = {502, 503, 504}  # gateway / not-ready answers: worth another try
RETRY_DELAY_S = 1.0  # first back-off; doubles per attempt


class Gsm8kError(Exception):
    """A problem the user can fix: bad input, an unreachable server, a malformed reply."""


class ServerError(Gsm8kError):
    """The server did not answer, or answered with an error or an unreadable reply (exit 1)."""


# ---- data -------------------------------------------------------------------------------

def check_item(obj: object, where: str) -> dict[str, str]:
    """One GSM8K item, validated: string 'question' and 'answer', the answer ending in '#### n'."""
    if not (isinstance(obj, dict) and isinstance(obj.get("question"), str) and isinstance(obj.get("answer"), str)):
        raise Gsm8kError(f"{where}: expected an object with string fields 'question' and 'answer' "
                         f"({FORMAT_HINT}), got {str(obj)[:120]}")
    if "#### " not in obj["answer"]:
        # the reference number is what follows '#### '; without it nothing could ever match
        raise Gsm8kError(f"{where}: the answer has no '#### <number>' final line, which GSM8K's format requires "
                         f"({FORMAT_HINT})")
    return {"question": obj["question"], "answer": obj["answer"]}


def load_jsonl(path: str) -> list[dict[str, str]]:
    """GSM8K items from a jsonl file in the official format, one object per line."""
    file = Path(path)
    if not file.is_file():
        raise Gsm8kError(f"{path}: no such file (expected GSM8K jsonl, one {FORMAT_HINT} per line)")
    items = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise Gsm8kError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one "
                                 f"object like {FORMAT_HINT}") from None
            items.append(check_item(obj, f"{path}:{number}"))
    if not items:
        raise Gsm8kError(f"{path}: no items (expected GSM8K jsonl, one {FORMAT_HINT} per line)")
    return items


def load_hf(split: str) -> list[dict[str, str]]:
    """A split of HuggingFace's openai/gsm8k (main); needs `datasets` and the network or its cache."""
    hint = ("pass --data PATH to GSM8K's test.jsonl (github.com/openai/grade-school-math, "
            "grade_school_math/data/test.jsonl)")
    try:
        import datasets
    except ImportError:
        raise Gsm8kError(f"no --data given and the `datasets` package is not installed: {hint}, "
                         f"or pip install datasets") from None
    try:
        rows = datasets.load_dataset(*HF_DATASET, split=split)
    except Exception as exc:  # offline, hub errors, cache problems: all end the same way for the user
        raise Gsm8kError(f"could not load {HF_DATASET[0]} ({HF_DATASET[1]}, split {split}) with `datasets`: "
                         f"{exc}; offline? {hint}") from None
    return [check_item(dict(row), f"{HF_DATASET[0]}[{split}][{i}]") for i, row in enumerate(rows)]


def select_items(args: argparse.Namespace) -> tuple[list[dict], list[dict], dict[str, str]]:
    """(items to evaluate, few-shot examples, where each came from) per the data options."""
    n = args.num_fewshot
    if args.data:
        items, data_source = load_jsonl(args.data), args.data
    else:
        items, data_source = load_hf("test"), f"{HF_DATASET[0]} ({HF_DATASET[1]}) test"
    if args.fewshot_data:
        pool, pool_source = load_jsonl(args.fewshot_data), args.fewshot_data
    elif not args.data:
        pool, pool_source = (load_hf("train") if n else []), f"{HF_DATASET[0]} ({HF_DATASET[1]}) train"
    else:  # no train file: the head of the data file teaches, the rest is evaluated
        if len(items) <= n:
            raise Gsm8kError(f"{args.data} has {len(items)} items; with --num-fewshot {n} and no --fewshot-data "
                             f"they are all few-shot examples and none is left to evaluate: pass --fewshot-data "
                             f"(GSM8K's train.jsonl) or lower --num-fewshot")
        pool, pool_source, items = items[:n], f"{args.data} (not evaluated)", items[n:]
    if len(pool) < n:
        raise Gsm8kError(f"--num-fewshot {n} asks for more examples than {pool_source} has ({len(pool)})")
    if args.limit is not None:
        items = items[:args.limit]
    fewshot_source = f"first {n} items of {pool_source}" if n else "none (zero-shot)"
    return items, pool[:n], {"data": data_source, "fewshot": fewshot_source}


# ---- prompts ----------------------------------------------------------------------------

def question_text(item: dict[str, str]) -> str:
    """lm-eval gsm8k's doc_to_text."""
    return f"Question: {item['question']}\nAnswer:"


def completion_prompt(item: dict[str, str], shots: list[dict[str, str]]) -> str:
    """Few-shot prompt text: each example 'Question: q\\nAnswer: a\\n\\n', then the question."""
    return "".join(f"{question_text(s)} {s['answer']}\n\n" for s in shots) + question_text(item)


def chat_messages(item: dict[str, str], shots: list[dict[str, str]]) -> list[dict[str, str]]:
    """Few-shot as alternating user/assistant turns (lm-eval's --fewshot_as_multiturn), then the question."""
    messages = []
    for s in shots:
        messages += [{"role": "user", "content": question_text(s)}, {"role": "assistant", "content": s["answer"]}]
    return messages + [{"role": "user", "content": question_text(item)}]


# ---- client -----------------------------------------------------------------------------

class Client:
    """A minimal JSON client for an OpenAI-compatible server, with bounded retries."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, retries: int) -> None:
        self.base_url, self.api_key, self.timeout, self.retries = base_url, api_key, timeout, retries

    def request(self, path: str, body: dict | None = None) -> dict:
        """GET (no body) or POST a JSON body to base_url + path; the decoded JSON reply."""
        url = self.base_url + path
        method = "GET" if body is None else "POST"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    payload = reply.read()
                break
            except urllib.error.HTTPError as exc:  # the server answered, with an error status
                if exc.code in RETRY_STATUSES and not last:
                    time.sleep(RETRY_DELAY_S * 2**attempt)
                    continue
                detail = exc.read()[:500].decode(errors="replace")
                raise ServerError(f"{method} {url} answered HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                if not last:
                    time.sleep(RETRY_DELAY_S * 2**attempt)
                    continue
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                if isinstance(reason, TimeoutError):
                    reason = f"no answer within --timeout {self.timeout:g} s"
                raise ServerError(f"{method} {url} failed after {attempt + 1} attempt(s): {reason or type(exc).__name__}"
                                 f"; is the server up at {self.base_url}? (see docs/gsm8k.md)") from None
        try:
            return json.loads(payload)
        except ValueError:
            raise ServerError(f"{method} {url} answered with something other than JSON: {payload[:200]!r}") from None


def first_model(client: Client) -> str:
    """The first model id the server lists at GET /v1/models."""
    reply = client.request("/v1/models")
    try:
        return str(reply["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"GET {client.base_url}/v1/models listed no model ({str(reply)[:200]}); "
                         f"pass --model") from None


def generate(client: Client, args: argparse.Namespace, model: str, item: dict, shots: list[dict]) -> dict:
    """Ask the server one question (greedy); the sample: prompt, response, tokens, latency."""
    body: dict = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0, "stop": args.stop}
    if args.api == "completions":
        body["prompt"] = prompt = completion_prompt(item, shots)
        path = "/v1/completions"
    else:
        body["messages"] = prompt = chat_messages(item, shots)
        path = "/v1/chat/completions"
    start = time.perf_counter()
    reply = client.request(path, body)
    latency = time.perf_counter() - start
    try:
        choice = reply["choices"][0]
        # a reasoning model's chat content can be null when it ran out of tokens while thinking
        text = (choice["text"] if args.api == "completions" else choice["message"]["content"]) or ""
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"POST {client.base_url}{path}: reply has no choices[0] "
                         f"{'text' if args.api == 'completions' else 'message.content'}: {str(reply)[:200]}") from None
    usage = reply.get("usage") or {}
    return {"prompt": prompt, "response": text, "latency_s": latency,
            "completion_tokens": usage.get("completion_tokens")}


def _progress_bar(total: int):  # tqdm is in the `tools` extra: no bar where it is missing
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="gsm8k", unit="q", file=sys.stderr)


def evaluate(client: Client, args: argparse.Namespace, model: str, items: list[dict],
             shots: list[dict]) -> list[dict]:
    """Every item asked with up to --concurrency requests in flight; the scored samples, in item order."""
    samples: list[dict] = [{}] * len(items)
    bar = _progress_bar(len(items))
    pool = ThreadPoolExecutor(max_workers=args.concurrency)
    try:
        futures = {pool.submit(generate, client, args, model, item, shots): i for i, item in enumerate(items)}
        for future in as_completed(futures):
            i = futures[future]
            sample = future.result()  # a failed request ends the run: a dead server is not a wrong answer
            samples[i] = {"index": i, "question": items[i]["question"], "target": items[i]["answer"], **sample,
                          **score_response(sample["response"], items[i]["answer"])}
            if bar is not None:
                bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    return samples


# ---- results ----------------------------------------------------------------------------

def summarize(samples: list[dict]) -> dict[str, dict]:
    """Per metric: exact_match (mean), its standard error (as lm-eval computes it), counts."""
    n = len(samples)
    out = {}
    for metric in METRICS:
        correct = sum(s[metric]["correct"] for s in samples)
        invalid = sum(s[metric]["extracted"] == "[invalid]" for s in samples)
        mean = correct / n
        # sample standard deviation (n - 1) over sqrt(n), as lm-eval's mean_stderr
        stderr = math.sqrt(mean * (1 - mean) * n / (n - 1)) / math.sqrt(n) if n > 1 else None
        out[metric] = {"exact_match": mean, "stderr": stderr, "correct": correct, "invalid": invalid, "total": n}
    return out


def format_results(metrics: dict[str, dict], header: str, timing: dict) -> str:
    """A plain-text table of both metrics, with the run's header and timing lines."""
    lines = [header, f"{'metric':<17} {'exact_match':>11} {'stderr':>8} {'correct':>9} {'invalid':>8}"]
    for name, m in metrics.items():
        stderr = "n/a" if m["stderr"] is None else f"{m['stderr']:.4f}"
        lines.append(f"{name:<17} {m['exact_match']:>11.4f} {stderr:>8} {m['correct']:>4}/{m['total']:<4} "
                     f"{m['invalid']:>8}")
    tokens = "" if timing["output_tokens_per_s"] is None else f", {timing['output_tokens_per_s']:.1f} output tok/s"
    lines.append(f"time: {timing['wall_s']:.2f} s, {timing['requests_per_s']:.2f} req/s, "
                 f"mean latency {timing['mean_latency_s']:.3f} s{tokens}")
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `atom-moe gsm8k`."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, with or without a trailing /v1 (default %(default)s)")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="completions: few-shot prompt text; chat: few-shot as chat turns, the server applies "
                             "the chat template (default %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'; none: no header")
    parser.add_argument("--data", default=None,
                        help="GSM8K jsonl to evaluate (official test.jsonl format); default: HuggingFace "
                             "openai/gsm8k test split, if `datasets` is installed and online")
    parser.add_argument("--fewshot-data", default=None,
                        help="jsonl of few-shot examples (GSM8K's train.jsonl), the first --num-fewshot are used; "
                             "default: the first --num-fewshot items of --data, which are then not evaluated")
    parser.add_argument("--num-fewshot", type=nonnegative_int, default=3, help="few-shot examples per prompt (default %(default)s)")
    parser.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N items; none: all")
    parser.add_argument("--concurrency", type=positive_int, default=32, help="requests in flight (default %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="max generated tokens (default %(default)s)")
    parser.add_argument("--stop", action="append", default=None,
                        help=f"stop sequence, repeatable; replaces the default {DEFAULT_STOP}")
    parser.add_argument("--metric", choices=METRICS, default="flexible-extract",
                        help="the metric --threshold gates on (default %(default)s)")
    parser.add_argument("--threshold", type=unit_interval, default=None,
                        help="exit 1 when --metric is below this accuracy (0..1); none: no gate")
    parser.add_argument("--output", default=None,
                        help="write results (metrics, settings, counts, timing) as JSON; none: print only")
    parser.add_argument("--log-samples", action="store_true",
                        help="with --output: also every sample's prompt, response, extracted answers, correctness")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per request (default %(default)s)")
    parser.add_argument("--retries", type=nonnegative_int, default=3,
                        help="retries of a request after a connection error, timeout or HTTP 502/503/504, with "
                             "doubling back-off from 1 s (default %(default)s)")


def _check_args(args: argparse.Namespace) -> None:
    checks = [
        (args.num_fewshot >= 0, f"--num-fewshot must be >= 0, got {args.num_fewshot}"),
        (args.limit is None or args.limit >= 1, f"--limit must be >= 1, got {args.limit}"),
        (args.concurrency >= 1, f"--concurrency must be >= 1, got {args.concurrency}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}"),
        (args.retries >= 0, f"--retries must be >= 0, got {args.retries}"),
        (args.threshold is None or 0 <= args.threshold <= 1,
         f"--threshold is an accuracy between 0 and 1, got {args.threshold}"),
        (not args.log_samples or args.output, "--log-samples needs --output PATH to write the samples to"),
        (args.base_url.startswith(("http://", "https://")),
         f"--base-url must start with http:// or https://, got {args.base_url!r}"),
        (not args.output or Path(args.output).resolve().parent.is_dir(),
         f"--output {args.output}: the folder it would go in does not exist"),
    ]
    for ok, message in checks:
        if not ok:
            raise Gsm8kError(message)


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")  # OpenAI-client style URLs end in /v1
    args.stop = list(DEFAULT_STOP) if args.stop is None else args.stop
    items, shots, sources = select_items(args)
    client = Client(base_url, args.api_key, args.timeout, args.retries)
    model = args.model or first_model(client)
    header = (f"atom-moe gsm8k: model={model} api={args.api} base_url={base_url} n={len(items)} "
              f"fewshot={len(shots)} ({sources['fewshot']}) concurrency={args.concurrency}")
    print(header, flush=True)
    start = time.perf_counter()
    samples = evaluate(client, args, model, items, shots)
    wall = time.perf_counter() - start
    metrics = summarize(samples)
    tokens = [s["completion_tokens"] for s in samples]
    total_tokens = sum(tokens) if all(isinstance(t, int) for t in tokens) else None
    timing = {"wall_s": wall, "requests_per_s": len(samples) / wall,
              "mean_latency_s": sum(s["latency_s"] for s in samples) / len(samples),
              "completion_tokens": total_tokens,
              "output_tokens_per_s": None if total_tokens is None else total_tokens / wall}
    print(format_results(metrics, "results (lm-eval gsm8k filters, exact_match):", timing))
    score = metrics[args.metric]["exact_match"]
    passed = None if args.threshold is None else score >= args.threshold
    if args.output:
        settings = {"base_url": base_url, "model": model, "api": args.api, "num_fewshot": args.num_fewshot,
                    "limit": args.limit, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                    "temperature": 0.0, "stop": args.stop, "timeout_s": args.timeout, "retries": args.retries,
                    "data": sources["data"], "fewshot": sources["fewshot"]}
        result = {"task": "gsm8k", "metrics": metrics, "metric": args.metric, "threshold": args.threshold,
                  "passed": passed, "settings": settings,
                  "counts": {"evaluated": len(samples), "fewshot": len(shots)}, "timing": timing}
        if args.log_samples:
            result["samples"] = samples
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    if passed is False:
        print(f"atom-moe gsm8k: FAIL: {args.metric} {score:.4f} is below --threshold {args.threshold:g}",
              file=sys.stderr)
        return 1
    if passed:
        print(f"PASS: {args.metric} {score:.4f} >= --threshold {args.threshold:g}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe gsm8k`; 0 ok, 1 below --threshold or server trouble, 2 bad input."""
    try:
        return _run(args)
    except ServerError as exc:
        print(f"atom-moe gsm8k: {exc}", file=sys.stderr)
        return 1
    except Gsm8kError as exc:
        print(f"atom-moe gsm8k: error: {exc}", file=sys.stderr)
        return 2
