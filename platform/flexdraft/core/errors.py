class FlexDraftError(ValueError):
    """A user-facing problem (bad input, bad config, missing file). The CLI prints its message on one line."""


class ContextTooLong(FlexDraftError):
    """A request whose prompt plus new tokens (plus the engine's verify slots) does not fit a cache row."""
