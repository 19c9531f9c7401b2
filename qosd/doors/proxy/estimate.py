"""What a request will cost, before the upstream sees it.

Prompt tokens are estimated from the prompt's UTF-8 bytes, per model, as

    tokens = overhead + bytes / bytes_per_token

where ``overhead`` is what the chat template adds whatever the text (role markers,
a system prompt the server inserts) and ``bytes_per_token`` the tokenizer's ratio on
this traffic. Both start from a stated prior (``PRIOR_OVERHEAD_TOKENS``,
``PRIOR_BYTES_PER_TOKEN``) and are learned over many responses' usage by least
squares with exponential forgetting (about the last ``MEMORY`` responses), pulled
towards the prior as strongly as ``PRIOR_WEIGHT`` responses would. A single short
response cannot swing the estimate: one "hi" answered with 5 prompt tokens (most of
them template) says little about bytes per token, and with one unknown per response
the fit keeps the ratio near its prior until prompts of different lengths are seen.

An estimate is only an estimate: the proxy admits with it marked as such (never
refused as too large for its class on it alone) and settles each lease from the
usage the server reports. It refuses a prompt as too large only when even
``MAX_BYTES_PER_TOKEN`` bytes per token, more than any tokenizer packs into one
token, would put it past the request limit: beyond doubt.

Expected output comes from ``max_completion_tokens`` / ``max_tokens``, or from the
mean output learned per class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

#: Tokens the chat template adds to every request, before any response was seen.
PRIOR_OVERHEAD_TOKENS = 8.0
#: Bytes of prompt text per token, before any response: English text in the common
#: BPE vocabularies runs at about 4.
PRIOR_BYTES_PER_TOKEN = 4.0
#: How many responses' worth of evidence the prior counts as.
PRIOR_WEIGHT = 8.0
#: Responses the fit remembers, about: each new one weighs 1, older ones decay.
MEMORY = 256
#: The most bytes any tokenizer packs into one token of text; a prompt longer than
#: the request limit even at this ratio is too large beyond doubt.
MAX_BYTES_PER_TOKEN = 32.0
#: Bounds of the learned parameters: a token is at least one byte of text (byte
#: fallback), at most MAX_BYTES_PER_TOKEN; a template adds under 4,096 tokens.
MIN_BYTES_PER_TOKEN = 1.0
MAX_OVERHEAD_TOKENS = 4096.0
#: Output tokens expected of a request with no max_tokens, before any was seen.
DEFAULT_OUTPUT_TOKENS = 256
#: Weight of the newest observation in the per-class output mean (about the last 50).
OUTPUT_LEARNING_RATE = 0.02
#: Typical prompt length the prior's slope is weighed at, bytes.
_PRIOR_SCALE_BYTES = 2048.0


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
class _Fit:
    """Decayed sums of (bytes, tokens) pairs: the least-squares line through them."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - 1.0 / MEMORY
        self.n = self.n * keep + 1.0
        self.x = self.x * keep + x
        self.y = self.y * keep + y
        self.xx = self.xx * keep + x * x
        self.xy = self.xy * keep + x * y

    def line(self) -> tuple[float, float]:
        """(overhead, tokens per byte): least squares, regularised towards the prior
        (ridge on each parameter, as strong as PRIOR_WEIGHT responses)."""
        c0, b0 = PRIOR_OVERHEAD_TOKENS, 1.0 / PRIOR_BYTES_PER_TOKEN
        lc, lb = PRIOR_WEIGHT, PRIOR_WEIGHT * _PRIOR_SCALE_BYTES**2
        # Minimise sum (y - c - b x)^2 + lc (c - c0)^2 + lb (b - b0)^2.
        a11, a12, a22 = self.n + lc, self.x, self.xx + lb
        r1, r2 = self.y + lc * c0, self.xy + lb * b0
        det = a11 * a22 - a12 * a12
        c = (r1 * a22 - a12 * r2) / det
        b = (a11 * r2 - a12 * r1) / det
        b = min(1.0 / MIN_BYTES_PER_TOKEN, max(1.0 / MAX_BYTES_PER_TOKEN, b))
        return min(MAX_OVERHEAD_TOKENS, max(0.0, c)), b


@dataclass(slots=True)
class Estimator:
    """Learns, per model, prompt tokens from bytes and, per class, output tokens."""

    fits: dict[str, _Fit] = field(default_factory=dict)
    output_tokens: dict[str, float] = field(default_factory=dict)

    def prompt_tokens(self, model: str, prompt_bytes: int) -> int:
        fit = self.fits.get(model) or _Fit()
        overhead, per_byte = fit.line()
        return max(1, round(overhead + prompt_bytes * per_byte))

    @staticmethod
    def fewest_tokens(prompt_bytes: int) -> int:
        """The fewest tokens ``prompt_bytes`` of text can be, whatever the tokenizer."""
        return math.ceil(prompt_bytes / MAX_BYTES_PER_TOKEN)

    def expected_output(self, qos_class: str, max_tokens: int | None) -> int:
        if max_tokens is not None:
            return max_tokens
        return round(self.output_tokens.get(qos_class, DEFAULT_OUTPUT_TOKENS))

    def learn(self, model: str, qos_class: str, prompt_bytes: int, usage: Usage) -> None:
        """Takes the usage a response reported into the fit and the output mean."""
        if usage.prompt_tokens > 0:
            self.fits.setdefault(model, _Fit()).add(float(prompt_bytes), usage.prompt_tokens)
        old = self.output_tokens.get(qos_class)
        produced = float(usage.completion_tokens)
        self.output_tokens[qos_class] = (
            produced if old is None else old + OUTPUT_LEARNING_RATE * (produced - old)
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
        prompt, completion = (
            _count(value.get("prompt_tokens")),
            _count(value.get("completion_tokens")),
        )
        if prompt is None or completion is None:
            return None
        return cls(prompt, completion)


def _count(value: Any) -> int | None:
    """A token count as a server sent it: a whole number (not a bool), at least 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return max(0, value)
    return None
