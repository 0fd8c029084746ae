"""`flexdraft generate`: prompts through the engine (any mode, a policy file, sampling), text or JSON out."""
from __future__ import annotations

import json
import sys

from flexdraft.cli.flags import add_engine_flags, add_runtime_flags, engine_config, runtime
from flexdraft.core.errors import FlexDraftError
from flexdraft.speculative.drafts import Mode


def cmd_generate(args) -> None:
    from flexdraft.core.data import chat_ids, read_prompts_file, text_ids
    from flexdraft.engine.ar import check_prompts
    from flexdraft.engine.runner import load_engine
    from flexdraft.speculative.sampling import SamplingParams

    if (args.prompt is None) == (args.prompts_file is None):
        raise FlexDraftError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
    if args.chat and args.prompts_file:  # a {"prompt": ...} line is raw text: --chat would be silently ignored
        raise FlexDraftError('--chat wraps --prompt; a prompts file takes {"messages": [...]} lines for the chat '
                             'template')
    if args.max_batch < 1:
        raise FlexDraftError(f"--batch-size must be >= 1, got {args.max_batch}")
    sampling_flag = args.temperature is not None or args.top_p is not None or args.top_k is not None
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=(args.temperature if args.temperature is not None else (1.0 if sampling_flag else 0.0)),
        top_k=args.top_k or 0,
        top_p=args.top_p if args.top_p is not None else 1.0,
        seed=args.seed,
    )
    if args.policy and args.mode:
        raise FlexDraftError("--policy sets the mode per live batch size: drop --mode")
    cfg = engine_config(args)
    lm, engine, note, _ = load_engine(args.model, runtime(args), args.drafter, cfg,
                                      mode_given=args.mode is not None, store_spec=args.store, policy_spec=args.policy)
    tok = lm.tokenizer
    if args.prompt is not None:
        prompts = [chat_ids(tok, [{"role": "user", "content": args.prompt}]) if args.chat
                   else text_ids(tok, args.prompt)]
    else:
        prompts = read_prompts_file(args.prompts_file, tok)
    check_prompts(prompts, lm.model.args.max_position_embeddings, lm.model.args.vocab_size)  # all, up front
    for i, p in enumerate(prompts):  # the engine's own check, naming the prompt too
        try:
            engine.check_request(p, params)
        except FlexDraftError as e:
            raise FlexDraftError(f"prompt {i}: {e} (--max-len)") from None
    print(note, file=sys.stderr)
    gens = engine.generate(prompts, params)
    total_tokens = sum(len(g.token_ids) for g in gens)
    total_time = sum(g.seconds for g in gens)
    for i, g in enumerate(gens):
        text = tok.decode(g.token_ids, skip_special_tokens=True)
        if args.json:
            row = {"index": i, "token_ids": g.token_ids, "text": text, "seconds": round(g.seconds, 6),
                   "finish_reason": g.finish_reason, "prompt_tokens": g.prompt_len, "mode": cfg.mode}
            if cfg.mode != Mode.AR:
                row.update(accepted_lengths=g.stats.accepted_lengths, tau=round(g.stats.tau, 4))
            print(json.dumps(row), flush=True)
        else:
            print(text, flush=True)
            if len(prompts) > 1:
                print("-" * 40, flush=True)
    taus = [g.stats.tau for g in gens]
    print(f"[{len(prompts)} prompts, {total_tokens} tokens in {total_time:.2f}s: "
          f"{total_tokens / max(total_time, 1e-9):.1f} tokens/s, mode {cfg.mode}, "
          f"tau {sum(taus) / len(taus):.2f}]", file=sys.stderr)


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate with the target model")
    add_runtime_flags(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    g.add_argument("--prompts-file", help="JSONL: {prompt} | {messages} | {prompt_token_ids} per line")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--drafter", help="drafter folder, models:/NAME/VERSION or models:/NAME@ALIAS (MLflow registry), or 'init' (untrained); default: the default pipeline's")
    g.add_argument("--policy", help="a policy file from `flexdraft sweep` (mode, B', pruning per live batch size, "
                                    "and S; it overrides those flags), or models:/NAME/VERSION for the policy a "
                                    "sweep attached to that drafter; refused for another model or drafter")
    g.add_argument("--store", help="n-gram store for lookup steps: a store file, a distill folder, or 'none' "
                                   "(default: the default pipeline's distilled data, when it exists)")
    add_engine_flags(g)
    g.add_argument("--json", action="store_true", help="one JSON line per prompt, in input order")
    g.set_defaults(func=cmd_generate)
