class FlexDraftError(ValueError):
    """A user-facing problem (bad input, bad config, missing file). The CLI prints its message on one line."""
