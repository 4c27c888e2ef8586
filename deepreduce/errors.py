"""The one exception type every decoder raises for malformed input."""


class DecodeError(ValueError):
    """A payload or stream is malformed: truncated, inconsistent or corrupt.

    Subclasses :class:`ValueError`, so code that already catches ``ValueError``
    keeps working. The message says what was wrong.
    """
