class FlexDraftError(ValueError):
    """A user-facing problem (bad input, bad config, missing file). The CLI prints its message on one line."""


class FieldError(FlexDraftError):
    """A request field the engine cannot take; `field` names it (as a server's 400 does)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ContextTooLong(FlexDraftError):
    """A request whose prompt plus new tokens (plus the engine's verify slots) does not fit a cache row."""
