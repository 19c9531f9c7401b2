"""Counting prompts at the upstream while the estimate has little to go on.

The estimator (``estimate.py``) learns a model's tokens per byte from the usage of
answered requests. Usage comes with an answer's last token, seconds after its request
was admitted: the first seconds of traffic are admitted on the prior alone, and a
prior of 4 bytes a token halves every prompt written at 2. Replayed through the proxy
(Azure 2x, chunked, pinned seeds 11 to 15 at ``138775e``), P0 missed 42, 23, 34, 14
and 1 objectives in the first 20 s against 1, 1, 3, 0 and 0 through the gateway loop,
which sends real counts, and as many as the gateway loop after (docs/adr/0013).

vLLM, and servers that copy its API, count a prompt on request: ``POST /tokenize``
with the chat's ``messages`` (and ``tools``), rendered as a completion would render
them, or a ``prompt``. While a model's fit holds less than
``estimate.CALIBRATION_EVIDENCE`` responses' worth, the proxy asks the least busy
upstream to count the prompts it sees, at most ``IN_FLIGHT`` at a time, off the
request's path (the request goes on with the estimate it has), and learns from each
count as from usage. An upstream that has no such route (404, 405, 501) is not asked
again; one that fails or is slow costs nothing but the count. Prompts with media
parts, or with fields the count would render otherwise (``response_format``, legacy
``functions``, a list of prompts), are not counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import Counter

from qosd.doors.proxy.answers import AnswerTooLarge, read_capped
from qosd.doors.proxy.estimate import Estimator, PromptSize, token_count
from qosd.doors.proxy.upstreams import Upstream, Upstreams

log = logging.getLogger(__name__)

#: vLLM's route (SGLang's and others' where they copy it).
TOKENIZE_PATH = "/tokenize"
#: Counts asked at once, across models: enough to learn in the first second of
#: traffic, too few to load a server.
IN_FLIGHT = 4
#: Seconds a count may take: a tokenizer answers in milliseconds.
TIMEOUT_S = 2.0
#: The largest answer read: vLLM lists the token ids, up to 8 bytes each, and a
#: counted prompt (MAX_COUNTED_BYTES) has at most a token a byte.
MAX_ANSWER_BYTES = 16 * 1024 * 1024
#: The largest request whose prompt is counted: its JSON is written again on the
#: proxy's loop, and a few hundred thousand tokens teach the fit what smaller ones do.
MAX_COUNTED_BYTES = 1024 * 1024
#: Statuses that say the server has no such route.
NO_ROUTE = frozenset({404, 405, 501})
#: Request fields a chat's count would render otherwise than a completion: the count
#: of such a prompt teaches the fit nothing true.
UNCOUNTED_FIELDS = ("response_format", "functions")


def count_query(model: str, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """The ``/tokenize`` body that counts ``body``'s prompt as its completion would
    (vLLM's chat template, generation prompt included), or None where the count would
    not be the prompt's."""
    if any(body.get(name) for name in UNCOUNTED_FIELDS):
        return None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        query: dict[str, Any] = {"model": model, "messages": messages,
                                 "add_generation_prompt": True}  # fmt: skip
        if body.get("tools"):
            query["tools"] = body["tools"]
        return query
    prompt = body.get("prompt")
    return {"model": model, "prompt": prompt} if isinstance(prompt, str) and prompt else None


@dataclass(slots=True)
class PromptCounter:
    """Asks upstreams to count prompts while the estimator calibrates (see the module's
    docstring); ``counted`` is told of each count asked, by result: learned, refused
    (an answer the fit cannot take), unsupported (no route), failed."""

    session: aiohttp.ClientSession
    estimator: Estimator
    headers: Callable[[], dict[str, str]]
    counted: Counter
    path: str = TOKENIZE_PATH
    without_route: set[str] = field(default_factory=set)  # upstream URLs
    _asking: set[asyncio.Task[None]] = field(default_factory=set)

    def consider(
        self, model: str, body: dict[str, Any], prompt: PromptSize, chat: bool, upstreams: Upstreams
    ) -> None:
        """Asks the least busy of ``model``'s upstreams to count this prompt, in the
        background, if the estimator needs it and a count of it would be true. Once
        calibrated, a request costs one comparison here."""
        if (
            not self.path
            or not self.estimator.calibrating(model)
            or len(self._asking) >= IN_FLIGHT
            or prompt.media_parts
            or prompt.text_bytes > MAX_COUNTED_BYTES
        ):
            return
        upstream = upstreams.pick(model)
        query = count_query(model, body, chat)
        if upstream is None or upstream.url in self.without_route or query is None:
            return
        task = asyncio.get_running_loop().create_task(self._ask(model, prompt, query, upstream))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _ask(
        self, model: str, prompt: PromptSize, query: dict[str, Any], upstream: Upstream
    ) -> None:
        result = "failed"
        try:
            async with self.session.post(
                upstream.url + self.path, data=json.dumps(query), headers=self.headers(),
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), allow_redirects=False,
            ) as answer:  # fmt: skip
                if answer.status in NO_ROUTE:
                    self.without_route.add(upstream.url)
                    log.info("upstream %s counts no prompts (%s %d): estimates learn from "
                             "usage alone", upstream.url, self.path, answer.status)  # fmt: skip
                    result = "unsupported"
                elif answer.status == 200:
                    result = self._learn(model, prompt, await read_capped(answer, MAX_ANSWER_BYTES))
        except (TimeoutError, aiohttp.ClientError, AnswerTooLarge, ValueError, RecursionError):
            pass  # the estimate stands; the next prompt asks again
        finally:
            self.counted.labels(model, result).inc()

    def _learn(self, model: str, prompt: PromptSize, answer: bytes) -> str:
        parsed = json.loads(answer)
        count = token_count(parsed.get("count")) if isinstance(parsed, dict) else None
        taken = count is not None and self.estimator.learn_prompt(model, prompt, count)
        return "learned" if taken else "refused"

    @property
    def asking(self) -> int:
        """Counts asked and not yet answered."""
        return len(self._asking)

    async def idle(self) -> None:
        """Waits for the counts asked so far to be answered (or to fail)."""
        while self._asking:
            await asyncio.gather(*self._asking, return_exceptions=True)

    async def close(self) -> None:
        """Cancels the counts still asked (on shutdown)."""
        for task in list(self._asking):
            task.cancel()
        await asyncio.gather(*self._asking, return_exceptions=True)
