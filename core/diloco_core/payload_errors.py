"""The errors of the payload codec: every way bytes fail to be a payload, or arrays fail to make
one, is a ``CodecError`` whose ``code`` names the reason for the API."""

from __future__ import annotations


class CodecError(ValueError):
    """A payload that cannot be encoded or decoded; ``code`` names the reason for the API."""

    code = "codec_error"


class TruncatedPayload(CodecError):
    code = "truncated"


class CorruptPayload(CodecError):
    code = "corrupt"


class OversizedPayload(CodecError):
    code = "oversized"


class ShapeMismatch(CodecError):
    code = "wrong_shape"


class UnsupportedFormat(CodecError):
    code = "unsupported"
