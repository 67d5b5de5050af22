"""The client a reward function asks the judge through (``POST /v1/verdicts`` or completions).

A client carries the judge's URL and the scoring rule (template, verdict tokens or parse
rule), so it can be rebuilt in any process from one environment variable: the run sets
``ASYNCRL_JUDGE`` before it starts its workers, and reward functions — in the generator,
in a reward process, in a Ray actor — call :func:`judge_client`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.errors import AsyncRLError

ENV = "ASYNCRL_JUDGE"


class JudgeError(AsyncRLError):
    """The judge could not be asked, or its answer could not be read."""


class JudgeUnreachable(JudgeError):
    """No judge answered at the URL: nothing listens there, or it did not answer in time."""


@dataclass(frozen=True)
class JudgeClient:
    """Scores (prompt, completion, answer) triples with a served judge model; see ``judge.*`` in the config."""

    url: str
    mode: str = "verdict"
    template: str = (
        "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Answer Yes or No.\nVerdict:"
    )
    chat: bool = False
    yes: str = " Yes"
    no: str = " No"
    pattern: str = r"-?\d+(?:\.\d+)?"
    score_min: float = 0.0
    score_max: float = 10.0
    max_new_tokens: int = 16
    timeout_s: float = 120.0

    @classmethod
    def from_config(cls, judge, url: str) -> JudgeClient:
        fields = {k: getattr(judge, k) for k in cls.__dataclass_fields__ if k != "url"}
        return cls(url=url.rstrip("/"), **fields)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    def render(self, prompt: Any, completion: str, answer: str | None = None) -> str:
        if not isinstance(prompt, str):  # a conversational prompt: its messages, one per line
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        return self.template.format(prompt=prompt, completion=completion, answer=answer or "")

    def score(self, prompt: Any, completion: str, answer: str | None = None) -> float:
        return self.score_many([(prompt, completion, answer)])[0]

    def score_many(self, items: list[tuple[Any, str, str | None]]) -> list[float | None]:
        """The reward in [0, 1] of each (prompt, completion, answer), in one request to the judge.

        mode=parse: None for an answer in which the pattern finds no number (the caller's
        reward function decides what that means; as a reward it is a recorded error).
        """
        if not items:
            return []
        texts = [self.render(*item) for item in items]
        if self.mode == "verdict":
            body = {"tokens": [self.yes, self.no]}
            body |= (
                {"messages": [[{"role": "user", "content": t}] for t in texts]}
                if self.chat
                else {"prompt": texts}
            )
            probs = self._post("/v1/verdicts", body)["probs"]
            return [yes / (yes + no) if yes + no > 0 else 0.5 for yes, no in probs]
        return [self._parsed(answer) for answer in self._answers(texts)]

    def _answers(self, texts: list[str]) -> list[str]:
        sampling = {"max_tokens": self.max_new_tokens, "temperature": 0.0}
        if not self.chat:
            choices = self._post("/v1/completions", {"prompt": texts, **sampling})["choices"]
            return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]
        return [
            self._post(
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": t}],
                    "max_completion_tokens": self.max_new_tokens,
                    "temperature": 0.0,
                },
            )["choices"][0]["message"]["content"]
            for t in texts
        ]

    def _parsed(self, answer: str) -> float | None:
        match = re.search(self.pattern, answer)
        if match is None:
            return None
        try:
            value = float(match.group(0))
        except ValueError:
            return None
        if not math.isfinite(value):
            return None
        return min(1.0, max(0.0, (value - self.score_min) / (self.score_max - self.score_min)))

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not the server's JSON error
                detail = json.loads(detail)["error"]["message"]
            raise JudgeError(f"the judge at {self.url} refused {path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise JudgeUnreachable(f"cannot reach the judge at {self.url} ({path}): {reason}") from None


def judge_client() -> JudgeClient:
    """The run's judge (``ASYNCRL_JUDGE``, set by a run with ``judge.model`` or ``judge.url``)."""
    spec = os.environ.get(ENV)
    if not spec:
        raise JudgeError(
            f"no judge in this process ({ENV} is not set): configure judge.model or judge.url for the run"
        )
    return JudgeClient(**json.loads(spec))
