"""Replaying a workload through an OpenAI-compatible endpoint with the official
``openai`` async client: straight to ``qosd sim-vllm``, or through an admission proxy
in front of it (``qosd proxy``, LiteLLM's).

Each request is a streaming chat completion whose prompt is ``input_tokens`` words (the
simulated server counts one token per word) and whose ``max_tokens`` is the trace's
output length. Its class and tenant go in qosd's headers (``x-qos-class``,
``x-qos-tenant``), and, where ``priorities`` are given, its class's rank in the body's
``priority`` field (LiteLLM schedules by it; vLLM does with ``--scheduling-policy
priority``). A refusal (429 or 503) is recorded with the reason the proxy gave
(``x-qos-reason``), the client retrying nothing: a refused request is a result.
Latencies count from the request's scheduled arrival, as ``gateway.Gateway``'s do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import openai

from qosd_sim.gateway import ReplayLoop, RequestRecord
from qosd_sim.replay import Request

#: The word the simulated model writes per token (qosd_sim.vllm.TOKEN_TEXT).
TOKEN_WORD = "tok"


class OpenAIGateway(ReplayLoop):
    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str = "unused",
        priorities: Mapping[str, int] | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(on_record)
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s
        )
        self._model = model
        self._priorities = priorities

    async def close(self) -> None:
        await self._client.close()

    async def _infer(self, request: Request, record: RequestRecord, arrived: float) -> None:
        extra_body: dict[str, int] = {}
        if self._priorities is not None:
            extra_body["priority"] = self._priorities[request.qos_class]
        headers = {"x-qos-class": request.qos_class}
        if request.tenant:
            headers["x-qos-tenant"] = request.tenant
        try:
            stream = await self._client.chat.completions.create(
                model=self._model,
                messages=[{"role": "user", "content": " w" * request.input_tokens}],
                max_tokens=request.output_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
                extra_body=extra_body or None,
            )
        except openai.APIStatusError as refused:
            reason = refused.response.headers.get("x-qos-reason")
            record.decision = (reason or f"HTTP_{refused.status_code}").upper()
            return
        record.admitted = True
        async with stream:
            async for chunk in stream:
                now = time.monotonic()
                if chunk.usage is not None:
                    record.tokens_seen = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text = choice.delta.content or ""
                    if text and record.ttft_ms is None:
                        record.ttft_ms = (now - arrived) * 1000
                    if choice.finish_reason is not None:
                        record.e2e_ms = (now - arrived) * 1000
                        record.completed = True


def rank_priorities(classes: list[str]) -> dict[str, int]:
    """Each class's rank (0 for the first), as a ``priority`` field."""
    return {name: rank for rank, name in enumerate(classes)}
