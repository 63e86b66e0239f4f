"""Every way the stage link can fail, as one `ProtocolError` tree named for what was wrong.

`remote` says where the error was decided: False when this process found the fault (in
bytes it received, in a peer's hello or description, or in its own misuse of the API);
True when the peer found it and told us with an ABORT frame, whose error name and reason
are rebuilt here by `error_from_abort`. Every message names the values involved, so the
log line alone says what to fix.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every stage-link failure; a link that raised one stays failed."""

    def __init__(self, message: str, *, remote: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.remote = remote

    @property
    def name(self) -> str:
        """The class name, which is what an ABORT frame carries on the wire."""
        return type(self).__name__


# Framing (engine.link.frame) ------------------------------------------------------------


class BadMagic(ProtocolError):
    """A frame header does not start with the link's magic."""


class UnsupportedVersion(ProtocolError):
    """A frame header carries a framing version this build does not speak."""


class UnknownKind(ProtocolError):
    """A frame header carries a kind byte outside `FrameKind`."""


class UnknownFlags(ProtocolError):
    """A frame header sets flag bits this version does not define."""


class NonZeroReserved(ProtocolError):
    """A reserved byte (frame header or stream entry) is not zero."""


class PayloadTooLarge(ProtocolError):
    """A frame declares a payload longer than the receiver's bound."""


class UnexpectedRowCount(ProtocolError):
    """A frame other than ROWS carries a nonzero row count."""


class ConnectionFailed(ProtocolError):
    """The link already failed; the first error is in `cause`."""

    def __init__(self, cause: ProtocolError) -> None:
        super().__init__(f"link already failed: {cause.name}: {cause.message}", remote=cause.remote)
        self.cause = cause


class FieldOutOfRange(ProtocolError):
    """An encoder was handed a value that does not fit its wire field (local misuse)."""


# Payload shape (every decoder) -----------------------------------------------------------


class TruncatedPayload(ProtocolError):
    """A payload is shorter than its layout (or its own counts) require."""


class TrailingBytes(ProtocolError):
    """A payload is longer than its layout (or its own counts) allow."""


class BadText(ProtocolError):
    """A text field is not valid UTF-8 (or ASCII where required), or is too long."""


# Hello and proof (engine.link.hello) ----------------------------------------------------


class FingerprintMismatch(ProtocolError):
    """The peer's checkpoint-and-layout fingerprint differs from ours."""


class WorldMismatch(ProtocolError):
    """The peer (or a description) reports another world size."""


class RankMismatch(ProtocolError):
    """A rank is not the one expected (wrong neighbour, outside the world, duplicate)."""


class BadProof(ProtocolError):
    """The peer's shared-key proof does not verify (another key, or a reflected hello)."""


class BadKeyFile(ProtocolError):
    """The shared link key file is missing, unreadable or too short."""


class UnexpectedFrame(ProtocolError):
    """A frame of a kind that is not allowed at this point of the conversation."""


class NotAuthenticated(ProtocolError):
    """A plan, rows or other frame was sent before the handshake finished (local misuse)."""


# v0 messages (engine.link.messages) -----------------------------------------------------


class BadPrefix(ProtocolError):
    """A describe/ready/plan payload's TFSP prefix is wrong (magic, version, message, reserved)."""


class UnknownBackend(ProtocolError):
    """A description names a backend byte outside `Backend`."""


class UnknownDtype(ProtocolError):
    """A description names a dtype byte outside `Dtype`."""


class BadFlagValue(ProtocolError):
    """A one-byte boolean field is neither 0 nor 1."""


class TooManyStreams(ProtocolError):
    """A plan declares more stream entries than the bound, before anything is allocated."""


class TooManyCuts(ProtocolError):
    """A plan declares more chunk cuts than the bound, before anything is allocated."""


class UnknownOp(ProtocolError):
    """A stream entry's op byte is outside `Op`."""


class BadEntry(ProtocolError):
    """A stream entry breaks its op's rule (open at 0, no rows on close, 0 < resume <= first)."""


class BadStreamOrder(ProtocolError):
    """Stream ids in a plan are not strictly ascending (out of order or duplicated)."""


class BadChunkCuts(ProtocolError):
    """Chunk cuts are not strictly ascending or fall outside the round's rows."""


class RowsSizeMismatch(ProtocolError):
    """A ROWS payload's length is not rows x planes x hidden x itemsize (+ tap sums)."""


class BadAddress(ProtocolError):
    """A neighbour address is empty, a wildcard or has port 0."""


# Boot checks (engine.link.layout) -------------------------------------------------------


class EmptyLayerRange(ProtocolError):
    """A stage's half-open layer range holds no layer (first >= end)."""


class LayoutGap(ProtocolError):
    """Some layers are held by no rank (between ranks, before rank 0 or after the last)."""


class LayoutOverlap(ProtocolError):
    """Two neighbouring ranks both hold some layers."""


class LayoutOverrun(ProtocolError):
    """A range reaches past the model's last layer (or before layer 0)."""


class VersionMismatch(ProtocolError):
    """A stage runs another engine release than rank 0's placement."""


class FormatMismatch(ProtocolError):
    """Neighbouring stages disagree on the boundary format (hidden, row dtype, planes, taps)."""


class ShapeMismatch(ProtocolError):
    """A stage declares other execution shapes (chunk, rows a round, parallel, context)."""


class CapacityTooSmall(ProtocolError):
    """A stage cannot hold the context's KV rows or --parallel recurrent states."""


class GenerationMismatch(ProtocolError):
    """A stage's slot generation differs from the one the plan expects (raised by the engine)."""


# Transport (engine.link.transport) ------------------------------------------------------


class WildcardListen(ProtocolError):
    """A listen address is a wildcard; the stage link binds one named address only."""


class Deadline(ProtocolError):
    """A send, receive, connect or handshake ran past its deadline."""


class PeerClosed(ProtocolError):
    """The peer closed the connection (or reset it)."""


class TruncatedFrame(PeerClosed):
    """The peer closed the connection in the middle of a frame."""


class LinkClosed(ProtocolError):
    """This side already closed the link (local misuse)."""


class PeerAborted(ProtocolError):
    """The peer sent ABORT with an error name this build does not know."""


def _all_subclasses(cls: type[ProtocolError]) -> dict[str, type[ProtocolError]]:
    found: dict[str, type[ProtocolError]] = {}
    for sub in cls.__subclasses__():
        found[sub.__name__] = sub
        found.update(_all_subclasses(sub))
    return found


def error_class(name: str) -> type[ProtocolError] | None:
    """The `ProtocolError` subclass called `name` (as an ABORT frame names it), if any."""
    if name == ProtocolError.__name__:
        return ProtocolError
    return _all_subclasses(ProtocolError).get(name)


def error_from_abort(name: str, reason: str) -> ProtocolError:
    """Rebuild the error a peer reported in its ABORT frame, marked remote.

    `ConnectionFailed` needs a cause, so it (like any unknown name) comes back as
    `PeerAborted` with the name kept in the message.
    """
    cls = error_class(name)
    if cls is None or cls is ConnectionFailed:
        return PeerAborted(f"peer aborted with {name}: {reason}", remote=True)
    return cls(f"peer reports: {reason}", remote=True)
