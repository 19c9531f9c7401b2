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

Images, audio, video and files (a message's non-text content parts) are no text: a
server's processor turns each into tokens by its own rule, and a part's bytes (a URL,
or base64) say little about how many. Each costs a number of tokens learned per model
from the usage of responses to requests that carried parts, starting from
``PRIOR_MEDIA_PART_TOKENS``, more than the common vision encoders make of an image, so
that no image is admitted as nearly free (a probe's 800 KB image passed as 8 tokens,
past the budget, ``max_in_flight_tokens`` and the long-prefill gate, into a
50,000-token prefill).

Expected output comes from ``max_completion_tokens`` / ``max_tokens``, or from the
mean output learned per class, times the answers asked for (``n``, ``best_of``).
Usage a server reports past the request limit, or beyond what the request could
produce, is settled at the limit but never learned from.
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
#: How many responses' worth of evidence the prior counts as, before any response.
#: It ages as the responses do (MEMORY), down to PRIOR_FLOOR: held at its full weight,
#: it kept a fit of 2-byte tokens 0.2 % short, and prompts just past the long-prefill
#: threshold passed it on their estimate (docs/adr/0013).
PRIOR_WEIGHT = 8.0
#: The prior's weight once it has aged: enough to keep the fit defined when every
#: prompt has one length, too little to pull it.
PRIOR_FLOOR = 0.01
#: Responses the fit remembers, about: each new one weighs 1, older ones decay.
MEMORY = 256
#: While the fit holds less evidence than this many responses (about 120 counts, as
#: older ones decay), the proxy asks the upstream to count prompts
#: (qosd.doors.proxy.tokenize). Fewer leave the prior's pull: after 32 counts of the
#: Azure conversation trace's prompts, 2 bytes a token, a 4,085-token prompt was
#: taken for 3,735; after 64 for 3,928; after 96 for 4,078.
CALIBRATION_EVIDENCE = 96.0
#: The most bytes any tokenizer packs into one token of text; a prompt longer than
#: the request limit even at this ratio is too large beyond doubt.
MAX_BYTES_PER_TOKEN = 32.0
#: Bounds of the learned parameters: a token is at least one byte of text (byte
#: fallback), at most MAX_BYTES_PER_TOKEN; a template adds under 4,096 tokens.
MIN_BYTES_PER_TOKEN = 1.0
MAX_OVERHEAD_TOKENS = 4096.0
#: Tokens of one media part before any response to one was seen. Vision encoders
#: make 576 (LLaVA-1.5) to 1,601 (Llama 3.2 Vision) tokens of an image, and Qwen2-VL
#: about 1,300 of a 1024x1024 one; audio encoders about 1,500 of 30 s.
PRIOR_MEDIA_PART_TOKENS = 1_600.0
#: The most tokens a media part is taken to cost (Qwen2-VL's default cap on an image).
MAX_MEDIA_PART_TOKENS = 16_384.0
#: The fewest: the cost is learned from every tenant's responses, and tiny images (or
#: text that tokenizes densely beside them) would otherwise teach it that a part is
#: nearly free, for everyone's large images after.
MIN_MEDIA_PART_TOKENS = 256.0
#: Weight of the newest response in the per-model media part cost (about the last 20).
MEDIA_LEARNING_RATE = 0.05
#: Content part types that are text: the rest (image_url, input_audio, video_url,
#: file, and types this proxy does not know) count as media.
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})
#: Output tokens expected of a request with no max_tokens, before any was seen.
DEFAULT_OUTPUT_TOKENS = 256
#: Weight of the newest observation in the per-class output mean (about the last 50).
OUTPUT_LEARNING_RATE = 0.02
#: Typical prompt length the prior's slope is weighed at, bytes.
_PRIOR_SCALE_BYTES = 2048.0


#: Request fields the server turns into prompt tokens beside the messages: the chat
#: template renders tools and functions into the prompt, and a schema to answer in
#: is prompt too (OpenAI counts it). Each counts as its JSON's bytes.
PROMPT_FIELDS = ("tools", "functions", "response_format")
#: Message fields beside ``content`` that are prompt text: earlier calls' arguments.
MESSAGE_FIELDS = ("tool_calls", "function_call")


@dataclass(frozen=True, slots=True)
class PromptSize:
    """What a request's prompt is made of: UTF-8 bytes of text, and media parts."""

    text_bytes: int
    media_parts: int = 0


def prompt_size(body: dict[str, Any]) -> PromptSize:
    """The prompt a request sends the model: the text of its messages' contents and
    the calls they carry, and of its prompt; the tools, functions and answer schema it
    declares (a 32K-token ``tools`` array is 32K tokens of prompt, whatever the
    messages say); and its media parts. Both ``messages`` and ``prompt`` count,
    whatever the route: a body that carries both was charged for its messages alone,
    so a long prompt beside an empty ``messages`` list passed as a few tokens to an
    upstream that reads the prompt."""
    parts: list[str] = []
    media = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict):
                        continue
                    kind = part.get("type", "text")
                    if isinstance(kind, str) and kind in TEXT_PART_TYPES:
                        parts.append(str(part.get("text") or part.get("refusal") or ""))
                    else:
                        media += 1
            elif content is not None:
                parts.append(_json(content))
            parts.extend(_json(message[name]) for name in MESSAGE_FIELDS if message.get(name))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        parts.append("\n".join(str(item) for item in prompt))
    elif isinstance(prompt, str):
        parts.append(prompt)
    parts.extend(_json(body[name]) for name in PROMPT_FIELDS if body.get(name))
    return PromptSize(len("\n".join(parts).encode("utf-8", "surrogatepass")), media)


def _json(value: Any) -> str:
    """A structured part of the prompt as the template writes it: JSON, non-ASCII kept
    (so its bytes are the text's bytes, not escapes)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(slots=True)
class _Fit:
    """Decayed sums of (bytes, tokens) pairs: the least-squares line through them."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    prior: float = PRIOR_WEIGHT

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - 1.0 / MEMORY
        self.prior = max(PRIOR_FLOOR, self.prior * keep)
        self.n = self.n * keep + 1.0
        self.x = self.x * keep + x
        self.y = self.y * keep + y
        self.xx = self.xx * keep + x * x
        self.xy = self.xy * keep + x * y

    def line(self) -> tuple[float, float]:
        """(overhead, tokens per byte): least squares, regularised towards the prior
        (ridge on each parameter, as strong as the prior's aged weight in responses)."""
        c0, b0 = PRIOR_OVERHEAD_TOKENS, 1.0 / PRIOR_BYTES_PER_TOKEN
        lc, lb = self.prior, self.prior * _PRIOR_SCALE_BYTES**2
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
    media_part_tokens: dict[str, float] = field(default_factory=dict)  # by model

    def prompt_tokens(self, model: str, prompt: PromptSize) -> int:
        return max(1, round(self._text_tokens(model, prompt.text_bytes)
                            + prompt.media_parts * self._media_part(model)))  # fmt: skip

    def _text_tokens(self, model: str, text_bytes: int) -> float:
        overhead, per_byte = (self.fits.get(model) or _Fit()).line()
        return overhead + text_bytes * per_byte

    def calibrating(self, model: str) -> bool:
        """Whether ``model``'s fit holds too little evidence to go on alone."""
        fit = self.fits.get(model)
        return fit is None or fit.n < CALIBRATION_EVIDENCE

    def learn_prompt(self, model: str, prompt: PromptSize, tokens: int) -> bool:
        """Takes a count of a prompt's tokens (a response's usage, or the upstream's
        count of it) into the fit, if it is a prompt of text alone and the count can
        be true: more than a byte each plus the most a template adds cannot. Whether
        it was taken."""
        most = prompt.text_bytes / MIN_BYTES_PER_TOKEN + MAX_OVERHEAD_TOKENS
        if prompt.media_parts or not 0 < tokens <= most:
            return False
        self.fits.setdefault(model, _Fit()).add(float(prompt.text_bytes), tokens)
        return True

    def _media_part(self, model: str) -> float:
        return self.media_part_tokens.get(model, PRIOR_MEDIA_PART_TOKENS)

    @staticmethod
    def fewest_tokens(prompt_bytes: int) -> int:
        """The fewest tokens ``prompt_bytes`` of text can be, whatever the tokenizer."""
        return math.ceil(prompt_bytes / MAX_BYTES_PER_TOKEN)

    def expected_output(self, qos_class: str, max_tokens: int | None, choices: int = 1) -> int:
        """Output tokens of the whole answer: ``choices`` answers (``n``, ``best_of``)
        of up to ``max_tokens`` each, else of the class's learned mean each."""
        if max_tokens is not None:
            return max_tokens * choices
        return round(self.output_tokens.get(qos_class, DEFAULT_OUTPUT_TOKENS)) * choices

    def learn(
        self,
        model: str,
        qos_class: str,
        prompt: PromptSize,
        usage: Usage,
        choices: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        """Takes the usage a response reported into the fit (a prompt of text alone),
        the media part cost (one with parts: what its text leaves over, per part) and
        the output mean, unless it cannot be true: a count past the request limit
        (clamped by ``Usage.parse``), more prompt tokens than a byte each plus the most
        a template adds and the most its parts can cost, or more output than the
        request allowed. One such answer would otherwise skew the estimates of the
        next thousand requests."""
        if not usage.credible:
            return
        text_bytes, parts = prompt.text_bytes, prompt.media_parts
        most = text_bytes / MIN_BYTES_PER_TOKEN + MAX_OVERHEAD_TOKENS
        if parts == 0:
            self.learn_prompt(model, prompt, usage.prompt_tokens)
        elif 0 < usage.prompt_tokens <= most + parts * MAX_MEDIA_PART_TOKENS:
            left = usage.prompt_tokens - self._text_tokens(model, text_bytes)
            per_part = min(MAX_MEDIA_PART_TOKENS, max(MIN_MEDIA_PART_TOKENS, left / parts))
            old_part = self._media_part(model)
            self.media_part_tokens[model] = old_part + MEDIA_LEARNING_RATE * (per_part - old_part)
        if max_tokens is not None and usage.completion_tokens > max_tokens * choices:
            return
        old = self.output_tokens.get(qos_class)
        produced = usage.completion_tokens / choices  # per answer, as expected_output asks
        self.output_tokens[qos_class] = (
            produced if old is None else old + OUTPUT_LEARNING_RATE * (produced - old)
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as an OpenAI-compatible server reports them (``usage``), each
    within the request limit."""

    prompt_tokens: int
    completion_tokens: int
    #: False when a count was past the limit (and clamped to it): settled at the
    #: limit, never learned from.
    credible: bool = True

    @classmethod
    def parse(cls, value: Any, limit: int) -> Usage | None:
        """The usage a server reported, each count clamped to [0, ``limit``]
        (``limits.max_request_tokens``); None when it is missing or not counts."""
        if not isinstance(value, dict):
            return None
        prompt = token_count(value.get("prompt_tokens"))
        completion = token_count(value.get("completion_tokens"))
        if prompt is None or completion is None:
            return None
        credible = prompt <= limit and completion <= limit
        return cls(min(prompt, limit), min(completion, limit), credible)


def token_count(value: Any) -> int | None:
    """A token count as a server sent it: a whole number (not a bool) of at least 0,
    else None (no usage: the estimate stands; a negative count, clamped to 0, made a
    request free). Of any size: the caller clamps it before any arithmetic (a
    400-digit count does not fit a float)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
