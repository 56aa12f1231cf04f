"""`atom-moe gsm8k` against a real loopback HTTP server, and its metrics against lm-eval's own."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from atom_moe.ep.launch import free_port
from atom_moe.tools import gsm8k
from atom_moe.tools.args import Parser
from atom_moe.tools.gsm8k_metrics import exact_match, flexible_extract, normalize, strict_match

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "gsm8k_fixture.jsonl"
FEWSHOT = DATA / "gsm8k_fewshot.jsonl"
MODEL = "fake-gsm8k-model"


def _questions(path: Path) -> list[str]:
    return [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]


# The fake model's reply to each fixture question, in file order, and what each metric makes of it.
# (reply, strict-match extracted, flexible-extract extracted, strict correct, flexible correct)
REPLIES = [
    ("Mira has 4 * 9 = 36 tulips. 36 - 7 = 29.\n#### 29", "29", "29", True, True),
    ("They sold 45 + 38 = 83 muffins, so the bakery made 83 * 3 = $249.", "[invalid]", "$249.", False, True),
    ("3 - 8 = -5\n#### -5", "-5", "-5", True, True),
    ("12 * 100 = 1,200 pencils.\n#### 1,200", "1,200", "1,200", True, True),
    ("He runs 2.5 * 6 = 15 kilometers. The answer is 15.", "[invalid]", "15.", False, True),
    ("Each piece is 5 / 2 = 2.50 meters.\n#### 2.50", "2.50", "2.50", False, False),  # exact string match
    ("3 * 24 = 72 stickers, and 72 / 8 = 8.\n#### 8", "8", "8", False, False),
    ("17 * 7 = 119 and 119 - 100 = 19.\n#### 19\nThat is about 1 and a half dozen.", "19", "1", True, False),
    ("", "[invalid]", "[invalid]", False, False),
    ("The helmet is $60, the total is $300.\n#### 300", "300", "300", True, True),
    ("There are 152 books on the shelves", "[invalid]", "152", False, True),
    ("5 * 15 + 2 * 25 = 130\n#### 130", "130", "130", False, False),
]
REPLY_BY_QUESTION = dict(zip(_questions(FIXTURE), (r[0] for r in REPLIES)))
STRICT_CORRECT = sum(r[3] for r in REPLIES)  # 5
FLEXIBLE_CORRECT = sum(r[4] for r in REPLIES)  # 7


class FakeServer(ThreadingHTTPServer):
    """An OpenAI-compatible server on loopback whose 'model' answers from REPLY_BY_QUESTION."""

    daemon_threads = True

    def __init__(self, api_key: str | None = None, delay: float = 0.02, drop_first: int = 0):
        super().__init__(("127.0.0.1", 0), Handler)
        self.api_key, self.delay, self.drop_left = api_key, delay, drop_first
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client that gave up
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._send(401, {"error": {"message": "bad api key"}})
            return False
        return True

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        with self.server.lock:
            if self.server.drop_left > 0:  # hang up without answering: a connection error for the client
                self.server.drop_left -= 1
                self.close_connection = True
                return
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"path": self.path, "body": body})
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            # lets concurrent requests overlap, and finish out of order (even-numbered prompts take longer)
            time.sleep(self.server.delay * (3 if len(self.server.requests) % 2 else 1))
            if body.get("model") != MODEL:
                self._send(404, {"error": {"message": f"model {body.get('model')!r} does not exist"}})
                return
            if self.path == "/v1/completions":
                question = body["prompt"].rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
                reply = REPLY_BY_QUESTION[question]
                self._send(200, {"choices": [{"index": 0, "text": reply, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 100, "completion_tokens": 10}})
            elif self.path == "/v1/chat/completions":
                question = body["messages"][-1]["content"].removeprefix("Question: ").removesuffix("\nAnswer:")
                reply = REPLY_BY_QUESTION[question]
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 100, "completion_tokens": 10}})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})
        finally:
            with self.server.lock:
                self.server.in_flight -= 1


@pytest.fixture
def make_server():
    servers = []

    def start(**kwargs) -> FakeServer:
        server = FakeServer(**kwargs)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(gsm8k, "RETRY_DELAY_S", 0.01)


def run_tool(*argv: str) -> int:
    parser = Parser(prog="atom-moe gsm8k")  # the CLI's parser: one-line errors, exit 2
    gsm8k.add_arguments(parser)
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code
    return gsm8k.run(args)


# ---- end to end against the loopback server ---------------------------------------------

@pytest.mark.parametrize("api", ["completions", "chat"])
def test_scores_json_and_requests(api, make_server, tmp_path, capsys):
    server = make_server(api_key="sk-test")
    out = tmp_path / "result.json"
    rc = run_tool("--base-url", server.url + "/v1", "--api", api, "--api-key", "sk-test", "--data", str(FIXTURE),
                  "--fewshot-data", str(FEWSHOT), "--concurrency", "4", "--output", str(out), "--log-samples")
    assert rc == 0
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    assert metrics["strict-match"]["exact_match"] == pytest.approx(STRICT_CORRECT / 12)
    assert metrics["flexible-extract"]["exact_match"] == pytest.approx(FLEXIBLE_CORRECT / 12)
    assert (metrics["strict-match"]["correct"], metrics["flexible-extract"]["correct"]) == (5, 7)
    assert (metrics["strict-match"]["invalid"], metrics["flexible-extract"]["invalid"]) == (4, 1)
    # lm-eval's stderr: sample standard deviation (n - 1) over sqrt(n)
    p = 7 / 12
    assert metrics["flexible-extract"]["stderr"] == pytest.approx((p * (1 - p) * 12 / 11) ** 0.5 / 12 ** 0.5)
    assert result["settings"]["model"] == MODEL  # found through GET /v1/models
    assert result["settings"]["api"] == api and result["settings"]["num_fewshot"] == 3
    assert result["counts"] == {"evaluated": 12, "fewshot": 3}
    assert result["timing"]["completion_tokens"] == 120 and result["timing"]["wall_s"] > 0
    assert [s["response"] for s in result["samples"]] == [r[0] for r in REPLIES]
    for sample, (_, strict, flexible, strict_ok, flexible_ok) in zip(result["samples"], REPLIES):
        assert sample["strict-match"] == {"extracted": strict, "correct": strict_ok}
        assert sample["flexible-extract"] == {"extracted": flexible, "correct": flexible_ok}
    text = capsys.readouterr().out
    assert "strict-match" in text and "0.4167" in text and "0.5833" in text

    assert len(server.requests) == 12 and server.max_in_flight > 1
    body = server.requests[0]["body"]
    assert body["temperature"] == 0 and body["max_tokens"] == 256
    assert body["stop"] == ["Question:", "</s>", "<|im_end|>"]
    assert server.requests[0]["path"] == f"/v1/{'completions' if api == 'completions' else 'chat/completions'}"
    # the exact lm-eval gsm8k prompt for the first question
    shots = [json.loads(line) for line in FEWSHOT.read_text().splitlines()]
    question = _questions(FIXTURE)[0]
    asked = {(r["body"].get("prompt") or r["body"]["messages"][-1]["content"]).count(question) for r in server.requests}
    assert asked == {0, 1}
    first = next(r["body"] for r in server.requests
                 if question in (r["body"].get("prompt") or r["body"]["messages"][-1]["content"]))
    if api == "completions":
        expected = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        assert first["prompt"] == expected + f"Question: {question}\nAnswer:"
        assert first["prompt"].startswith("Question: Tom has 6 apples")
        assert "\n#### 9\n\nQuestion: A box" in first["prompt"]
    else:
        roles = [m["role"] for m in first["messages"]]
        assert roles == ["user", "assistant"] * 3 + ["user"]
        assert first["messages"][0]["content"] == f"Question: {shots[0]['question']}\nAnswer:"
        assert first["messages"][1]["content"] == shots[0]["answer"]
        assert first["messages"][-1]["content"] == f"Question: {question}\nAnswer:"


def test_threshold_exit_codes(make_server, capsys):
    server = make_server()
    common = ["--base-url", server.url, "--data", str(FIXTURE), "--fewshot-data", str(FEWSHOT), "--concurrency", "3"]
    assert run_tool(*common, "--threshold", "0.58") == 0  # flexible 7/12 = 0.583
    assert "PASS" in capsys.readouterr().out
    assert run_tool(*common, "--threshold", "0.59") == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "flexible-extract 0.5833 is below --threshold 0.59" in err
    assert run_tool(*common, "--metric", "strict-match", "--threshold", "0.42") == 1  # strict 5/12 = 0.417
    assert "strict-match 0.4167 is below" in capsys.readouterr().err
    assert run_tool(*common, "--metric", "strict-match", "--threshold", "0.41") == 0
    assert run_tool(*common, "--threshold", repr(7 / 12)) == 0  # equal to the threshold passes


def test_fewshot_from_head_of_data_and_limit_and_stop(make_server, tmp_path):
    server = make_server()
    out = tmp_path / "r.json"
    rc = run_tool("--base-url", server.url, "--data", str(FIXTURE), "--num-fewshot", "2", "--limit", "5",
                  "--stop", "###", "--stop", "\n\n", "--max-tokens", "64", "--model", MODEL, "--output", str(out))
    assert rc == 0
    result = json.loads(out.read_text())
    questions = _questions(FIXTURE)
    # items 0 and 1 teach; items 2..6 are evaluated (replies 2..6: strict 3/5 correct, flexible 3/5)
    assert result["counts"] == {"evaluated": 5, "fewshot": 2}
    assert result["metrics"]["strict-match"]["correct"] == sum(r[3] for r in REPLIES[2:7])
    assert result["metrics"]["flexible-extract"]["correct"] == sum(r[4] for r in REPLIES[2:7])
    assert "gsm8k_fixture.jsonl (not evaluated)" in result["settings"]["fewshot"]
    prompts = [r["body"]["prompt"] for r in server.requests]
    assert all(p.startswith(f"Question: {questions[0]}\n") and f"Question: {questions[1]}\n" in p for p in prompts)
    assert sorted(p.rsplit("Question: ", 1)[1] for p in prompts) == sorted(f"{q}\nAnswer:" for q in questions[2:7])
    assert all(r["body"]["stop"] == ["###", "\n\n"] and r["body"]["max_tokens"] == 64 for r in server.requests)
    assert "samples" not in result


def test_retries_connection_errors_bounded(make_server, tmp_path, capsys):
    server = make_server(drop_first=2)  # the first two POSTs are hung up on
    common = ["--base-url", server.url, "--data", str(FIXTURE), "--fewshot-data", str(FEWSHOT), "--model", MODEL,
              "--concurrency", "1", "--limit", "2"]
    assert run_tool(*common, "--retries", "2") == 0
    assert len(server.requests) == 2
    server.drop_left = 2
    assert run_tool(*common, "--retries", "1") == 1  # server trouble is a runtime failure
    err = capsys.readouterr().err
    assert "failed after 2 attempt(s)" in err and "is the server up" in err


def test_server_down_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    rc = run_tool("--base-url", url, "--data", str(FIXTURE), "--retries", "1")
    assert rc == 1
    err = capsys.readouterr().err
    assert f"GET {url}/v1/models failed after 2 attempt(s)" in err and "refused" in err.lower()


def test_timeout_is_a_clear_error(make_server, capsys):
    server = make_server(delay=1.0)
    rc = run_tool("--base-url", server.url, "--data", str(FIXTURE), "--model", MODEL, "--limit", "1",
                  "--timeout", "0.2", "--retries", "0")
    assert rc == 1
    assert "no answer within --timeout 0.2 s" in capsys.readouterr().err


def test_http_errors_reported(make_server, capsys):
    server = make_server(api_key="right")
    base = ["--base-url", server.url, "--data", str(FIXTURE), "--limit", "1"]
    assert run_tool(*base, "--api-key", "wrong") == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert run_tool(*base, "--api-key", "right", "--model", "nope") == 1
    assert "HTTP 404" in capsys.readouterr().err and len(server.requests) == 1  # no retry on a 404


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": "a #### 1"}\nnot json\n', ":2: not valid JSON"),
    ('{"question": "q", "answer": "a #### 1"}\n{"question": "q"}\n', ":2: expected an object with string fields"),
    ('{"question": "q", "answer": "the answer is 4"}\n', ":1: the answer has no '#### <number>' final line"),
    ("\n\n", "no items"),
])
def test_malformed_data(content, message, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    # the data is read before any request: no server is needed to reject it
    assert run_tool("--base-url", f"http://127.0.0.1:{free_port()}", "--data", str(bad), "--num-fewshot", "0") == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err


@pytest.mark.parametrize("argv, message", [
    (["--num-fewshot", "-1"], "argument --num-fewshot: '-1' is out of range; allowed: an integer >= 0"),
    (["--concurrency", "0"], "argument --concurrency: '0' is out of range; allowed: an integer >= 1"),
    (["--limit", "0"], "argument --limit: '0' is out of range; allowed: an integer >= 1"),
    (["--threshold", "90"], "argument --threshold: '90' is out of range; allowed: a number in [0, 1]"),
    (["--timeout", "soon"], "argument --timeout: 'soon' is not a number; allowed: a number > 0"),
    (["--log-samples"], "--log-samples needs --output"),
    (["--base-url", "localhost:8000"], "--base-url must start with http://"),
    (["--output", "/no/such/dir/r.json"], "the folder it would go in does not exist"),
    (["--num-fewshot", "12"], "none is left to evaluate"),
    (["--fewshot-data", str(FEWSHOT), "--num-fewshot", "4"], "more examples than"),
    (["--data", "/no/such.jsonl"], "/no/such.jsonl: no such file"),
])
def test_bad_options(argv, message, capsys):
    argv = ["--data", str(FIXTURE)] + argv
    assert run_tool("--base-url", f"http://127.0.0.1:{free_port()}", *argv) == 2
    assert message in capsys.readouterr().err


def test_huggingface_source(monkeypatch, make_server, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert run_tool("--limit", "1") == 2
    assert "`datasets` package is not installed" in capsys.readouterr().err

    calls = []
    rows = {"test": [json.loads(line) for line in FIXTURE.read_text().splitlines()],
            "train": [json.loads(line) for line in FEWSHOT.read_text().splitlines()]}

    class FakeDatasets:  # stands in for `datasets`: nothing is downloaded
        @staticmethod
        def load_dataset(path, name, split):
            calls.append((path, name, split))
            if split not in rows:
                raise ConnectionError("offline")
            return rows[split]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    server = make_server()
    assert run_tool("--base-url", server.url, "--model", MODEL) == 0
    assert calls == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "train")]
    assert len(server.requests) == 12  # the test split in full; few-shot from train
    assert server.requests[0]["body"]["prompt"].startswith("Question: Tom has 6 apples")
    rows.pop("test")
    assert run_tool("--base-url", server.url, "--model", MODEL) == 2
    assert "could not load openai/gsm8k (main, split test)" in capsys.readouterr().err


def test_fits_the_cli(monkeypatch, make_server, capsys):
    from atom_moe.tools import cli

    # the lead wires the subcommand in cli.SUBCOMMANDS; this checks the module fits that contract
    monkeypatch.setitem(cli.SUBCOMMANDS, "gsm8k", ("atom_moe.tools.gsm8k", "GSM8K accuracy of a live server"))
    server = make_server()
    assert cli.main(["gsm8k", "--base-url", server.url, "--data", str(FIXTURE), "--limit", "3"]) == 0
    assert "flexible-extract" in capsys.readouterr().out and len(server.requests) == 3


def test_runs_without_tqdm(monkeypatch, make_server):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert gsm8k._progress_bar(3) is None
    server = make_server()
    assert run_tool("--base-url", server.url, "--data", str(FIXTURE), "--limit", "4", "--model", MODEL) == 0
    assert len(server.requests) == 4


# ---- metrics: our functions against lm-eval's own gsm8k filters and exact_match ---------

TARGETS = ["Some work <<2+2=4>>4.\n#### 42", "It fell 3 - 8 = <<3-8=-5>>-5.\n#### -5", "#### 1200", "#### 2.5",
           "x\n#### 18", "#### 0", "#### 1000000"]
RESPONSES = [
    "#### 42", "The answer is 42.", "42", "#### 42.", "#### 42\n#### 43", "#### 43\nso 42", "$42", "#### $42",
    "It costs $42.00.", "#### 4,2", "-42", "#### -42", "She has 3 apples and 39 more: 42 in all.", "no number here",
    "", "#### ", "#### -5", "It is -5 degrees.", "- 5", "minus 5: #### -5.", "#### 1,200", "1,200 pencils",
    "$1,200.", "#### 1200.0", "12 * 100 = 1200\n#### 1200", "#### 2.5", "2.50", "2.5.", "about .5", "#### .5",
    "#### 18\nQuestion: next", "18!", "eighteen", "#### 0", "0", "0.", "#### 1,000,000", "1 000 000", "#### 42 #### 18",
    "#### 42\n\n#### 18", "The Answer: 42\n", "42\n", "a $ sign alone $", "2.5 and 18", "18.\n",
]


def lm_eval_scores(pairs: list[tuple[str, str]]) -> list[dict[str, tuple[str, bool]]]:
    """lm-eval's gsm8k filters (built from its task yaml as lm-eval does) and its exact_match, per pair."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the `test` extra: pip install -e .[test]")
    import importlib.resources

    import yaml
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_metric
    from lm_eval.filters import build_filter_ensemble

    config = yaml.safe_load((importlib.resources.files("lm_eval") / "tasks/gsm8k/gsm8k.yaml").read_text())
    ensembles = [build_filter_ensemble(f["name"], [[step["function"], {k: v for k, v in step.items()
                                                                        if k != "function"}] for step in f["filter"]])
                 for f in config["filter_list"]]
    instances = [Instance("generate_until", doc={"answer": target}, arguments=("", {}), idx=0, resps=[response])
                 for response, target in pairs]
    for ensemble in ensembles:
        ensemble.apply(instances)
    (metric_config,) = config["metric_list"]
    assert metric_config["metric"] == "exact_match"
    kwargs = {k: v for k, v in metric_config.items() if k not in ("metric", "aggregation", "higher_is_better")}
    metric = get_metric("exact_match")
    scores = []
    for inst, (_, target) in zip(instances, pairs):
        scores.append({name: (pred, metric(references=[target], predictions=[pred], **kwargs)["exact_match"] == 1.0)
                       for name, pred in inst.filtered_resps.items()})
    return scores


def test_normalize_as_gsm8k_exact_match():
    assert normalize("Total: $1,234.") == "total: 1234"
    assert normalize("Work <<6*7=42>>42.\n#### 4,2") == "42"  # everything up to the last '#### ' goes
    assert normalize("#### 1\n#### 2") == "2"  # greedy: up to the last '#### '
    assert normalize("1.5.") == "1.5" and normalize("ABC") == "abc"
    assert exact_match("$1,200.", "x\n#### 1200") and not exact_match("2.50", "#### 2.5")


def test_metrics_match_lm_eval():
    pairs = [(response, target) for response in RESPONSES for target in TARGETS]
    theirs = lm_eval_scores(pairs)
    ours = [{"strict-match": (strict_match(r), exact_match(strict_match(r), t)),
             "flexible-extract": (flexible_extract(r), exact_match(flexible_extract(r), t))} for r, t in pairs]
    mismatches = [(pair, o, t) for pair, o, t in zip(pairs, ours, theirs) if o != t]
    assert not mismatches, mismatches[:5]
    # the comparison means something only if both outcomes occur for both metrics
    for name in ("strict-match", "flexible-extract"):
        outcomes = {s[name][1] for s in theirs}
        assert outcomes == {True, False}
    assert sum(s["flexible-extract"][1] for s in theirs) > sum(s["strict-match"][1] for s in theirs)


def test_fixture_replies_scored_as_lm_eval_does():
    targets = [json.loads(line)["answer"] for line in FIXTURE.read_text().splitlines()]
    theirs = lm_eval_scores([(r[0], t) for r, t in zip(REPLIES, targets)])
    for reply, scores in zip(REPLIES, theirs):
        assert scores == {"strict-match": (reply[1], reply[3]), "flexible-extract": (reply[2], reply[4])}
