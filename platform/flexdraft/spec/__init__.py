"""Speculative decoding's parts that need no engine: the adaptive policy's models, verification, token trees."""
