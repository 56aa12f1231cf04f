"""GSM8K scoring with lm-eval's definitions: the strict-match and flexible-extract filters, exact_match.

These mirror lm-eval's gsm8k task (tasks/gsm8k/gsm8k.yaml, version 3.0): its two filter
pipelines (a regex filter, then take-first) and the exact_match metric with the task's
settings, so a score here is comparable with an lm-eval run on the same responses.
tests/test_gsm8k.py checks them against lm-eval itself.
"""

from __future__ import annotations

import re

# the task yaml's filter_list
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
INVALID = "[invalid]"  # lm-eval's fallback when the regex finds nothing

# the task yaml's exact_match settings: ignore_case true, ignore_punctuation false, and these
# regexes removed (in this order) from both prediction and target; "(?s).*#### " leaves the
# target's final number only
REGEXES_TO_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")

METRICS = ("strict-match", "flexible-extract")


def _extract(pattern: re.Pattern[str], response: str, pick: int) -> str:
    matches = pattern.findall(response)
    if not matches:
        return INVALID
    match = matches[pick]
    if isinstance(match, tuple):  # several groups: the first one that matched text
        match = next((group for group in match if group), INVALID)
    return match.strip()


def strict_match(response: str) -> str:
    """The number after the first '#### ' in the response, or '[invalid]'."""
    return _extract(STRICT_PATTERN, response, 0)


def flexible_extract(response: str) -> str:
    """The last number-like run in the response (may keep '$', ',' and '.'), or '[invalid]'."""
    return _extract(FLEXIBLE_PATTERN, response, -1)


EXTRACTORS = {"strict-match": strict_match, "flexible-extract": flexible_extract}


def normalize(text: str) -> str:
    """exact_match's normalization with gsm8k's settings: drop the ignored regexes, lower-case."""
    for pattern in REGEXES_TO_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(prediction: str, target: str) -> bool:
    """Whether an extracted answer equals the reference answer (full GSM8K answer text) after normalization."""
    return normalize(prediction) == normalize(target)


def score_response(response: str, target: str) -> dict[str, dict[str, object]]:
    """Per metric: the extracted answer and whether it is correct."""
    scores = {}
    for name, extract in EXTRACTORS.items():
        extracted = extract(response)
        scores[name] = {"extracted": extracted, "correct": exact_match(extracted, target)}
    return scores
