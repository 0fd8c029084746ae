"""FlexDraft: lossless speculative decoding whose speed-up holds across batch sizes."""
__version__ = "0.1.0"
