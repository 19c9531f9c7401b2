"""What a request will cost, before the upstream sees it.

Prompt tokens come from a model's tokenizer when one is configured, or from the
prompt's UTF-8 bytes divided by the bytes per token learned from the usage of past
responses of that model (4 until the first response). Expected output comes from
``max_completion_tokens`` / ``max_tokens``, or from the mean output learned per class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: Bytes of prompt text per token before any response was seen: English text in the
#: common BPE vocabularies runs at about 4.
DEFAULT_BYTES_PER_TOKEN = 4.0
#: Output tokens expected of a request with no max_tokens, before any was seen.
DEFAULT_OUTPUT_TOKENS = 256
#: Weight of the newest observation in the running means (an exponential average
#: over about the last 50 responses: it follows a change of workload in seconds).
LEARNING_RATE = 0.02


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request sends the model: its messages' contents, or its prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    str(part.get("text", "")) for part in content if isinstance(part, dict)
                )
            elif content is not None:
                parts.append(json.dumps(content))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(str(item) for item in prompt)
    return prompt if isinstance(prompt, str) else ""


@dataclass(slots=True)
class Estimator:
    """Learns, per model, bytes per prompt token and, per class, output tokens."""

    bytes_per_token: dict[str, float] = field(default_factory=dict)
    output_tokens: dict[str, float] = field(default_factory=dict)

    def prompt_tokens(self, model: str, text: str) -> int:
        ratio = self.bytes_per_token.get(model, DEFAULT_BYTES_PER_TOKEN)
        return max(1, round(len(text.encode("utf-8")) / ratio))

    def expected_output(self, qos_class: str, max_tokens: int | None) -> int:
        if max_tokens is not None:
            return max_tokens
        return round(self.output_tokens.get(qos_class, DEFAULT_OUTPUT_TOKENS))

    def learn(self, model: str, qos_class: str, prompt_bytes: int, usage: Usage) -> None:
        """Takes the usage a response reported into the running means."""
        if usage.prompt_tokens > 0 and prompt_bytes > 0:
            seen = prompt_bytes / usage.prompt_tokens
            old = self.bytes_per_token.get(model)
            self.bytes_per_token[model] = (
                seen if old is None else old + LEARNING_RATE * (seen - old)
            )
        old = self.output_tokens.get(qos_class)
        produced = float(usage.completion_tokens)
        self.output_tokens[qos_class] = (
            produced if old is None else old + LEARNING_RATE * (produced - old)
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as an OpenAI-compatible server reports them (``usage``)."""

    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def parse(cls, value: Any) -> Usage | None:
        if not isinstance(value, dict):
            return None
        prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        return cls(max(0, prompt), max(0, completion))
