"""Compiling the grammars of requests a server cannot trust, where a native crash or a slow compile cannot reach
the replica: `GrammarCompiler.compile` first compiles each grammar in a child process (`python -m
flexdraft.serving.grammar_compiler`), within a time budget, and only a grammar the child compiled is compiled again
in the server, off the engine thread, into the `CompiledGrammar` the engine copies per choice.

llguidance is native code: a JSON schema that is a chain of ~3,000 `$ref`s overflows its stack (SIGSEGV), which no
`try` catches, and a schema of 5,000 optional properties takes ~2.6 s to compile. The child dies or is killed in
their place; the request gets a FlexDraftError naming what happened, and the next grammar starts a new child.

Protocol on the child's stdin / stdout: length-prefixed pickles. First (tokenizer, vocab_size), answered "ready";
then one `Grammar` at a time, answered None (it compiles) or the error's text."""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

from flexdraft.core.errors import FlexDraftError
from flexdraft.serving.async_engine import EngineUnavailable
from flexdraft.speculative.grammar import CompiledGrammar, Grammar, Grammars

START_TIMEOUT_S = 120.0  # a child imports torch and builds the tokenizer's llguidance form (~5 s on 2 busy cores)


def _write(stream, value) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        block = os.read(fd, n - len(out))
        if not block:
            raise EOFError
        out += block
    return bytes(out)


def _read(fd: int, deadline: float | None = None):
    (size,) = struct.unpack("<Q", _read_exactly(fd, 8, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


class GrammarCompiler:
    """compile(grammar) -> CompiledGrammar for `grammars`' tokenizer, or FlexDraftError: the grammar is invalid, made
    the compiler crash, or took longer than `timeout_s` to compile; EngineUnavailable once closed (its engine was
    replaced). Thread-safe (one compile at a time)."""

    def __init__(self, grammars: Grammars, timeout_s: float):
        self.grammars, self.timeout_s = grammars, timeout_s
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.crashes = 0  # children that died on a grammar
        self.timeouts = 0  # children killed past the budget

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the engine this request was sent to was replaced by a reconfigure; retry")
            error = self._check(grammar)
        if error is not None:
            raise FlexDraftError(error)
        return self.grammars.compile(grammar)  # (it compiled in the child: it compiles here)

    def start(self) -> None:
        """Start the child now (a server's first grammar then waits for no start)."""
        with self._lock:
            if not self._closed:
                self._ready()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()

    def _ready(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, close_fds=True)
        try:
            _write(self._child.stdin, (self.grammars.tokenizer, self.grammars.V))
            if _read(self._child.stdout.fileno(), time.monotonic() + START_TIMEOUT_S) != "ready":
                raise EOFError
        except (OSError, EOFError, TimeoutError, pickle.PickleError) as e:
            self._stop()
            raise FlexDraftError(f"the grammar compiler did not start ({type(e).__name__})") from None
        return self._child

    def _check(self, grammar: Grammar) -> str | None:
        """The child's verdict on the grammar: None if it compiles, else what is wrong (the child is replaced if it
        crashed or ran past the budget)."""
        child = self._ready()
        try:
            _write(child.stdin, grammar)
            return _read(child.stdout.fileno(), time.monotonic() + self.timeout_s)
        except TimeoutError:
            self.timeouts += 1
            self._stop()
            return (f"the {grammar.kind} grammar takes longer than {self.timeout_s:g} s to compile "
                    "(grammar_timeout_s): simplify it")
        except (OSError, EOFError, pickle.PickleError):
            code = self._stop()
            self.crashes += 1
            how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
            return f"the {grammar.kind} grammar crashed the grammar compiler ({how}): it is too deep or too large"

    def _stop(self) -> int | None:
        """End the child -> its exit code (negative: the signal that ended it)."""
        child, self._child = self._child, None
        if child is None:
            return None
        if child.poll() is None:
            child.kill()
        code = child.wait()
        for stream in (child.stdin, child.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return code


def _serve() -> None:
    """The child: compile each grammar it is sent, answer None or the error."""
    stdin, stdout = sys.stdin.buffer.fileno(), sys.stdout.buffer
    tokenizer, vocab_size = _read(stdin)
    grammars = Grammars(tokenizer, vocab_size)
    grammars.compile(Grammar("regex", "a"))  # (builds the tokenizer's llguidance form before the first budget)
    _write(stdout, "ready")
    while True:
        try:
            grammar = _read(stdin)
        except EOFError:
            return
        try:
            grammars.compile(grammar)
            _write(stdout, None)
        except FlexDraftError as e:
            _write(stdout, str(e))


if __name__ == "__main__":
    _serve()
