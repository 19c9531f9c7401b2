"""Who may call what: the rules of ``auth`` applied to each call on a shared listener.

Two groups of RPCs (``qosd/doors/grpc_api.py`` names each method's group):

- **control** (PinRate, UnpinRate): they change the fleet's shared state, so one call
  can throttle every replica. With no ``auth.control`` rule they are refused on the
  shared listeners and served only on ``server.admin_listen`` (a unix socket or
  loopback), where reaching the socket is the authorization.
- **qos** (Acquire, Release, Report, ShouldRateLimit, GetStatus): open unless
  ``auth.qos`` sets a rule.

A caller proves itself with a bearer token (``authorization: Bearer <token>``,
compared in constant time) or with an mTLS client certificate whose identity is
listed. A caller that shows neither gets UNAUTHENTICATED; one whose token or identity
is wrong gets PERMISSION_DENIED. Each refusal is counted
(``qosd_auth_refusals_total``) and logged, at most once a second per method and code
so that a flood of bad calls cannot flood the log.
"""

from __future__ import annotations

import enum
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from qosd.config import AuthConfig, CallerRule, FileSignature, file_signature

log = logging.getLogger(__name__)

BEARER_PREFIX = "bearer "


class Group(enum.Enum):
    CONTROL = "control"
    QOS = "qos"


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str


class TokenFile:
    """A token kept in a file (a mounted Secret), re-read when the file changes, so
    that a rotated token takes effect from the next call without a restart. Checked
    on the event loop only: one ``stat`` per judged call."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._signature: FileSignature | None = None
        self._token = b""
        self._refresh()

    def _refresh(self) -> None:
        try:
            signature = file_signature(self._path)
            if signature == self._signature:
                return
            with open(self._path, "rb") as handle:
                token = handle.read().strip()
        except OSError as exc:
            log.warning("token file %s unreadable, keeping the last token: %s", self._path, exc)
            return
        if token:  # an empty file mid-rotation keeps the last token
            self._signature, self._token = signature, token

    def token(self) -> str:
        """The token now (re-read if the file changed); empty while none was read."""
        self._refresh()
        return self._token.decode("utf-8", "replace")

    def matches(self, given: bytes) -> bool:
        self._refresh()
        return bool(self._token) and hmac.compare_digest(given, self._token)


def peer_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The client certificate's subject alternative names (URI, DNS, ...), else its
    common name; empty without mTLS."""
    properties = context.auth_context()
    names = properties.get("x509_subject_alternative_name") or properties.get(
        "x509_common_name", []
    )
    return [name.decode(errors="replace") for name in names]


def bearer_token(context: grpc.aio.ServicerContext) -> bytes | None:
    """The caller's bearer token; None without one, and empty (a wrong credential)
    for one that is not a bearer token or for two ``authorization`` entries, of which
    no door picks one."""
    given = [value for key, value in context.invocation_metadata() or ()
             if key == "authorization"]  # fmt: skip
    if not given:
        return None
    if len(given) > 1:
        return b""
    value = given[0]
    return bearer_of(value.decode(errors="replace") if isinstance(value, bytes) else value)


def bearer_of(header: str) -> bytes:
    """The token of an ``authorization`` header's value; empty when it is not a
    bearer token (a wrong credential, not a missing one)."""
    if header[: len(BEARER_PREFIX)].lower() == BEARER_PREFIX:
        # surrogateescape: an HTTP header's bytes that are not UTF-8 reach here as lone
        # surrogates (aiohttp); they are a wrong token, not an error.
        return header[len(BEARER_PREFIX) :].strip().encode("utf-8", "surrogateescape")
    return b""


class CallerCheck:
    """One group's rule, ready to judge a call."""

    def __init__(self, rule: CallerRule, group: Group) -> None:
        self.group = group
        self._token = TokenFile(rule.token_file) if rule.token_file else None
        self._identities = frozenset(rule.identities)

    def judge(self, context: grpc.aio.ServicerContext) -> Refusal | None:
        return self.judge_credentials(bearer_token(context), peer_identities(context))

    def judge_credentials(self, token: bytes | None, identities: list[str]) -> Refusal | None:
        """``token``: the bearer token shown (None: no authorization header; empty:
        one that is not a bearer token); ``identities``: the client certificate's."""
        if token is not None and self._token is not None and self._token.matches(token):
            return None
        if self._identities.intersection(identities):
            return None
        if token is None and not identities:
            how = " or ".join(
                part
                for part, used in (
                    ("an 'authorization: Bearer <token>' header", self._token is not None),
                    ("an mTLS client certificate with an allowed identity", self._identities),
                )
                if used
            )
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, f"{self.group.value} calls need {how}")
        shown = "the bearer token is not accepted" if token is not None else ""
        if identities:
            shown = (shown + "; " if shown else "") + (
                f"client identity {', '.join(identities)} is not in auth.{self.group.value}"
                ".identities"
            )
        message = f"{self.group.value} call refused: {shown}"
        return Refusal(grpc.StatusCode.PERMISSION_DENIED, message)


class Authorizer:
    """Judges every call on the shared listeners (the admin listener has none: it
    serves every call)."""

    def __init__(
        self,
        config: AuthConfig,
        *,
        on_refusal: Callable[[str, grpc.StatusCode], None] | None = None,
    ) -> None:
        self._checks = {
            Group.CONTROL: CallerCheck(config.control, Group.CONTROL)
            if config.control.configured
            else None,
            Group.QOS: CallerCheck(config.qos, Group.QOS) if config.qos.configured else None,
        }
        self._on_refusal = on_refusal
        self._last_logged: dict[tuple[str, grpc.StatusCode], float] = {}

    def guards(self, group: Group) -> bool:
        """Whether calls of ``group`` are judged at all (no rule for qos: open)."""
        return group is Group.CONTROL or self._checks[group] is not None

    def judge(self, method: str, group: Group, context: grpc.aio.ServicerContext) -> Refusal | None:
        check = self._checks[group]
        refusal: Refusal | None
        if check is None:
            if group is Group.QOS:
                return None
            refusal = Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "control calls are served on server.admin_listen only (set auth.control "
                "to allow them here)",
            )
        else:
            refusal = check.judge(context)
        if refusal is not None:
            self._refused(method, refusal, context)
        return refusal

    def _refused(self, method: str, refusal: Refusal, context: grpc.aio.ServicerContext) -> None:
        if self._on_refusal is not None:
            self._on_refusal(method, refusal.code)
        key = (method, refusal.code)
        now = time.monotonic()
        if now - self._last_logged.get(key, -1e9) >= 1.0:
            self._last_logged[key] = now
            log.warning("refused %s from %s: %s %s", method, context.peer(), refusal.code.name,
                        refusal.message)  # fmt: skip
