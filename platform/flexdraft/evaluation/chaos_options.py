"""The `options` class of `flexdraft loadtest --chaos`: request options combined as an attacker would (grammars that
crash or stall a compiler, or cannot be satisfied; ids past the vocabulary; penalties that overflow; grammars against
min_tokens and ignore_eos; many choices with many logprobs), each with the answer it must get: a 400 naming the
field, or a 200 whose every choice that ended with "stop" parses (and validates against its schema)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


def ref_chain(n: int) -> dict:
    """A schema that is a chain of n `$ref`s (3,000 overflowed llguidance's stack: SIGSEGV)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": defs | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def wide(n: int) -> dict:
    """An object of n optional properties (5,000: ~2.6 s to compile; llguidance's parser fails after a lone `{`)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SMALL = {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 40}},
         "required": ["answer"], "additionalProperties": False}


def schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "attack", "schema": s}}


JSON_OBJECT = {"type": "json_object"}


@dataclass(frozen=True)
class Attack:
    name: str
    options: dict  # merged into a valid request
    refused: str | None  # the field a 400 must name; None: a 200 whose choices parse
    or_valid: bool = False  # a 400 naming `refused`, or a 200 whose choices parse (the model may finish first)
    choices: int = 0  # n past the server's batch rows (1: one past them, 0: as `options` say)


ATTACKS = [
    Attack("ref chain 3000", {"response_format": schema(ref_chain(3000))}, "response_format"),
    Attack("ref cycle", {"response_format": schema(CYCLE)}, "response_format"),
    Attack("5000 optional properties", {"response_format": schema(wide(5000))}, "response_format", or_valid=True),
    Attack("stop id past the vocabulary", {"stop_token_ids": [49152], "min_tokens": 4}, "stop_token_ids"),
    Attack("stop id 2^31-1", {"stop_token_ids": [2 ** 31 - 1], "temperature": 1.0}, "stop_token_ids"),
    Attack("logit_bias past the vocabulary", {"logit_bias": {"49152": 5}}, "logit_bias"),
    Attack("repetition_penalty 1e-45", {"repetition_penalty": 1e-45, "temperature": 1.0}, "repetition_penalty"),
    Attack("repetition_penalty 5e-324", {"repetition_penalty": 5e-324}, "repetition_penalty"),
    Attack("more choices than rows", {}, "n", choices=1),
    Attack("json_object + min_tokens", {"response_format": JSON_OBJECT, "min_tokens": 60, "max_tokens": 64}, None),
    Attack("json_object + ignore_eos, n 2 sampled streamed",
           {"response_format": JSON_OBJECT, "ignore_eos": True, "n": 2, "temperature": 1.0, "stream": True,
            "max_tokens": 64}, None),
    Attack("schema + min_tokens + ignore_eos, n 4",
           {"response_format": schema(SMALL), "min_tokens": 30, "ignore_eos": True, "n": 4, "temperature": 0.8,
            "max_tokens": 48}, None),
    Attack("a choice per row, top logprobs 20, streamed",
           {"logprobs": True, "top_logprobs": 20, "stream": True, "max_tokens": 24, "temperature": 1.0}, None,
           choices=-1),
]


def attack_body(rng: random.Random, prompt: str, rows: int) -> tuple[str, dict, Attack]:
    """-> (route, body, the attack) of one request of the class, against a server whose batch has `rows` rows."""
    attack = rng.choice(ATTACKS)
    options = dict(attack.options)
    if attack.choices:
        options["n"] = rows + 1 if attack.choices > 0 else rows
    chat = "top_logprobs" in options or rng.random() < 0.5
    body = {"max_tokens": 32, "temperature": 0, **options}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, attack
    body.pop("logprobs", None)
    return "/v1/completions", {**body, "prompt": prompt}, attack


def choices(raw: bytes, stream: bool) -> dict[int, tuple[str, str | None]]:
    """A 200's (text, finish_reason) per choice index (the SSE deltas joined when streamed); ValueError if an error
    event came."""
    if not stream:
        return {c["index"]: (c.get("text", (c.get("message") or {}).get("content") or ""), c["finish_reason"])
                for c in json.loads(raw)["choices"]}
    out: dict[int, tuple[str, str | None]] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise ValueError(event["error"]["message"])
        for c in event["choices"]:
            text, _ = out.get(c["index"], ("", None))
            out[c["index"]] = (text + c.get("text", (c.get("delta") or {}).get("content") or ""), c["finish_reason"])
    return out


def judge(attack: Attack, body: dict, status: int, raw: bytes, too_big: bool = False) -> str | None:
    """What is wrong with the answer to `body`, None if it is the one the attack must get (too_big: the body is past
    the server's limit, so a 413)."""
    import jsonschema

    if too_big:
        return None if status == 413 else f"HTTP {status} to a body past the limit"
    stream = bool(body.get("stream"))
    if status == 400 and attack.refused is not None:
        param = json.loads(raw)["error"].get("param")
        return None if param == attack.refused else f"400 naming {param!r}, not {attack.refused!r}"
    if status != 200 or (attack.refused is not None and not attack.or_valid):
        return f"HTTP {status}"
    try:
        got = choices(raw, stream)
    except ValueError as e:
        return f"an error event: {e}"
    if len(got) != body.get("n", 1):
        return f"{len(got)} choices"
    form = body.get("response_format")
    for i, (text, finish) in got.items():
        if form is None or finish == "length":  # (max_tokens cut it: not a finished value)
            continue
        try:
            value = json.loads(text)
        except ValueError:
            return f"choice {i} does not parse: {text[:80]!r}"
        if form["type"] == "json_object" and not isinstance(value, dict):
            return f"choice {i} is not an object: {text[:80]!r}"
        if form["type"] == "json_schema":
            try:
                jsonschema.validate(value, form["json_schema"]["schema"])
            except jsonschema.ValidationError as e:
                return f"choice {i} does not validate: {e.message[:80]}"
    return None
