"""`tinyvllm` command line: generate | chat | make-dummy (serve and bench plug in as sub-commands)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from tinyvllm.engine.args import add_engine_cli_args, engine_args_from_cli
from tinyvllm.sampling_params import SamplingParams

Command = Callable[[argparse.Namespace], int]


def add_sampling_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None, help="default: the model's generation config, else 1.0")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_cli(ns: argparse.Namespace, defaults):
    changes = {"max_tokens": ns.max_tokens, "n": ns.n, "ignore_eos": ns.ignore_eos}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if getattr(ns, name) is not None:
            changes[name] = getattr(ns, name)
    if ns.sampling_seed is not None:
        changes["seed"] = ns.sampling_seed
    if ns.stop:
        changes["stop"] = ns.stop
    return defaults.replace(**changes)


def _read_prompts(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """(name for messages, prompt) of the command-line prompts, then of the file's non-blank lines.

    The file is read as UTF-8 with ``surrogateescape``, as Python reads command-line arguments: a line
    with bytes that are not UTF-8 becomes a prompt that fails alone (with a message naming the byte)."""
    prompts = [(f"prompt {i + 1}", p) for i, p in enumerate(ns.prompts)]
    if ns.prompts_file:
        try:
            with open(ns.prompts_file, encoding="utf-8", errors="surrogateescape") as f:
                lines = list(f)
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file: {e}") from None
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                prompts.append((f"{ns.prompts_file} line {lineno}", line.rstrip("\n")))
    return prompts


def _print_failure(message: str, error: str, prompt: str, as_json: bool) -> None:
    """`message` (naming the prompt) on stderr; with --json also the prompt's JSON line with `error`."""
    print(f"tinyvllm generate: error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"prompt": prompt, "error": error, "outputs": []}))


def _print_output(out, as_json: bool) -> None:
    if as_json:
        outputs = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in out.outputs]
        print(json.dumps({"prompt": out.prompt, "error": out.error, "outputs": outputs}))
        return
    for o in out.outputs:
        print(f"{out.prompt or ''}{o.text}")
        print("-" * 40)


def cmd_generate(ns: argparse.Namespace) -> int:
    """Complete every prompt; a prompt that fails (malformed, too long) is reported on stderr and the
    others still run. Returns 0 when every prompt succeeded, 1 when some failed, 2 for no prompts."""
    from tinyvllm.llm import LLM

    prompts = _read_prompts(ns)
    if not prompts:
        print("tinyvllm generate: give at least one PROMPT or --prompts-file", file=sys.stderr)
        return 2
    sampling_params_from_cli(ns, SamplingParams())  # bad sampling flags fail before the model loads
    llm = LLM(**vars(engine_args_from_cli(ns)))
    params = sampling_params_from_cli(ns, llm.get_default_sampling_params())
    # Check each prompt on its own, so that one bad prompt does not stop the others.
    results: list = []
    for name, prompt in prompts:
        try:
            results.append(llm.llm_engine.tokenize_prompt(prompt, name))
        except (ValueError, TypeError) as e:
            results.append(e)
    valid = [r for r in results if not isinstance(r, Exception)]
    outputs = iter(llm.generate(valid, params, use_tqdm=len(valid) > 1) if valid else [])
    failed = 0
    for (name, prompt), result in zip(prompts, results):
        if isinstance(result, Exception):
            _print_failure(str(result), str(result), prompt, ns.json)  # the message names the prompt
            failed += 1
            continue
        out = next(outputs)
        if out.error:
            _print_failure(f"{name}: {out.error}", out.error, prompt, ns.json)
            failed += 1
        else:
            _print_output(out, ns.json)
    if failed:
        print(f"tinyvllm generate: {failed} of {len(prompts)} prompts failed", file=sys.stderr)
    return 1 if failed else 0


def cmd_chat(ns: argparse.Namespace) -> int:
    """Chat turn by turn. A turn that fails is reported on stderr: interactively the turn is dropped
    and the chat goes on; with --message the command stops and returns 1."""
    from tinyvllm.llm import LLM

    sampling_params_from_cli(ns, SamplingParams())  # bad sampling flags fail before the model loads
    llm = LLM(**vars(engine_args_from_cli(ns)))
    params = sampling_params_from_cli(ns, llm.get_default_sampling_params())
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    turns = list(ns.message) if ns.message else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
        else:
            try:
                user = input("> ")
            except EOFError:
                return 0
            except UnicodeDecodeError as e:
                print(
                    f"tinyvllm chat: error: the input is not valid UTF-8 ({e.reason}); type it again", file=sys.stderr
                )
                continue
        messages.append({"role": "user", "content": user})
        try:
            out = llm.chat(messages, params, use_tqdm=False)[0]
        except (ValueError, TypeError) as e:
            messages.pop()
            print(f"tinyvllm chat: error: {e}", file=sys.stderr)
            if turns is not None:
                return 1
            continue
        if out.error:
            messages.pop()
            print(f"tinyvllm chat: error: {out.error}", file=sys.stderr)
            if turns is not None:
                return 1
            continue
        reply = out.outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_make_dummy(ns: argparse.Namespace) -> int:
    from tinyvllm.models.checkpoint import write_dummy_checkpoint

    path = write_dummy_checkpoint(ns.out_dir, ns.preset, seed=ns.seed, dtype=ns.dtype)
    print(path)
    return 0


def build_parser(extra: Sequence[Callable[[argparse._SubParsersAction], None]] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description="A small, fast LLM inference engine.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--prompts-file", default=None, help="one prompt per line")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_cli_args(gen)
    add_sampling_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat through the model's chat template")
    chat.add_argument("--system", default=None)
    chat.add_argument("--message", action="append", default=None, help="user turn(s); none: interactive")
    add_engine_cli_args(chat)
    add_sampling_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    dummy = sub.add_parser("make-dummy", help="write a random-weight Hugging Face checkpoint")
    dummy.add_argument("preset")
    dummy.add_argument("out_dir")
    dummy.add_argument("--seed", type=int, default=0)
    dummy.add_argument("--dtype", default=None)
    dummy.set_defaults(func=cmd_make_dummy)

    for register in extra:
        register(sub)
    return parser


def extra_subcommands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """The registration functions (for `build_parser`) of the sub-commands that live in their own
    modules, serve and bench; each module imports its heavy dependencies lazily."""
    from tinyvllm.entrypoints import bench_cli, serve_cli

    return [serve_cli.register, bench_cli.register]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(extra_subcommands())
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, TypeError) as e:
        print(f"tinyvllm {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
