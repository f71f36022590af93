"""The `triollm` command line: `serve`, `generate`, `chat`, `bench`.

`triollm chat` says on stderr what it loads (model, dtype, quantization, threads), when it is
ready (as resolved) and, interactive, how to start over (/clear) and leave (Ctrl-D, exit); the
answers alone go to stdout. `triollm serve` prints the playground's and /docs's URLs once it
listens (server.py).

Engine flags are generated from the `EngineArgs` dataclass (vLLM's names, `--max-model-len`
for `max_model_len`, `--served-model-name` included), so the CLI, `LLM(**kwargs)` and the server
share one schema: a flag vLLM knows and triollm does not is rejected (exit 2) as an unknown
keyword is rejected by `LLM(...)`. The server's own flags are in serve_args.py.

As vLLM's `FlexibleArgumentParser`: a flag may be spelled with underscores (`--max_model_len`),
and `--config FILE.yaml` reads flags from a YAML mapping (`port: 8001`, `max-model-len: 4k`,
`enable-prefix-caching: false`, lists for flags taking several values), keys in dash or
underscore form; the command line wins over the file. A key that is no flag exits 2 naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from triollm.api.serve_args import add_serve_args
from triollm.bench import add_bench_parser
from triollm.engine.config import EngineArgs

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The three primary colors are",
    "def fibonacci(n):",
]

def _log_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level", default=default, choices=["debug", "info", "warning", "error"], help="(default: %(default)s)"
    )


def _sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triollm", description="LLM inference on structured concurrency.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (default model: the bundled SmolLM2)")
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local HF directory, .gguf file, or Hugging Face Hub repo id",
    )
    serve.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML file of flags (flag: value); the command line wins over it",
    )
    add_serve_args(serve)
    _log_flag(serve, "info")
    EngineArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="complete prompts (default: a few example prompts)")
    _log_flag(gen, "warning")
    gen.add_argument("prompts", nargs="*", help="prompts to complete")
    _sampling_flags(gen, 32)
    EngineArgs.add_cli_args(gen)

    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive without one)")
    chat.add_argument("message", nargs="?", default=None, help="answer this message and exit")
    chat.add_argument("--system", default=None, help="an optional system message")
    _log_flag(chat, "warning")
    _sampling_flags(chat, 128)
    EngineArgs.add_cli_args(chat)

    add_bench_parser(sub)
    return parser


def _params(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from triollm.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed
    )


def _llm(args: EngineArgs):  # type: ignore[no-untyped-def]
    from triollm.actors.llm import LLM

    return LLM.from_engine_args(args)


def cmd_generate(ns: argparse.Namespace) -> int:
    with _llm(EngineArgs.from_cli_args(ns)) as llm:
        prompts = ns.prompts or DEFAULT_PROMPTS
        for out in llm.generate(prompts, _params(ns), use_tqdm=False):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


CHAT_HELP = "Type a message and press Enter. /clear starts a new conversation; Ctrl-D (or exit) leaves."


def loading_line(args: EngineArgs) -> str:
    """What `triollm chat` says as the model starts loading (seconds, for the bundled one)."""
    model = args.model or "the bundled SmolLM2-135M-Instruct"
    quant = args.quantization or "auto"
    threads = args.num_threads or "auto"
    return f"triollm: loading {model} (dtype {args.dtype}, quantization {quant}, threads {threads})..."


def ready_line(llm, seconds: float) -> str:  # type: ignore[no-untyped-def]
    """What was loaded, as the engine resolved it: dtype, quantization, threads, context."""
    config = llm.llm_engine.model_config
    dtype = str(config.dtype).removeprefix("torch.")
    threads = llm.args.num_threads
    return (
        f"triollm: ready in {seconds:.1f} s: {config.path.name}, {dtype}, quantization "
        f"{config.quantization or 'none'}, {threads} thread{'' if threads == 1 else 's'}, "
        f"{config.max_model_len} tokens of context"
    )


def cmd_chat(ns: argparse.Namespace) -> int:
    """One message answered, or (no message) an interactive conversation until EOF / "exit".
    What loads, when it is ready and (interactive) how to clear and leave go to stderr, so the
    answer alone is on stdout."""
    interactive = ns.message is None
    args = EngineArgs.from_cli_args(ns)
    print(loading_line(args), file=sys.stderr, flush=True)
    start = time.perf_counter()
    with _llm(args) as llm:
        print(ready_line(llm, time.perf_counter() - start), file=sys.stderr)
        if interactive:
            print(CHAT_HELP, file=sys.stderr, flush=True)
        system = [{"role": "system", "content": ns.system}] if ns.system else []
        conversation = list(system)
        while True:
            if interactive:
                try:
                    message = input("> ")
                except (EOFError, KeyboardInterrupt):
                    print()
                    return 0
                if message.strip() in ("exit", "quit", "/exit", "/quit"):
                    return 0
                if message.strip() == "/clear":
                    conversation = list(system)
                    print("(a new conversation)", file=sys.stderr, flush=True)
                    continue
                if not message.strip():
                    continue
            else:
                message = ns.message
            conversation.append({"role": "user", "content": message})
            reply = llm.chat(conversation, _params(ns), use_tqdm=False)[0].outputs[0].text
            print(reply)
            conversation.append({"role": "assistant", "content": reply})
            if not interactive:
                return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from triollm.api import server
    from triollm.api.serve_args import check_serve_args, serve_options

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    check_serve_args(ns)
    args = EngineArgs.from_cli_args(ns)
    served = args.served_model_name
    names = tuple([served] if isinstance(served, str) else served or [server.default_model_name(args)])
    return server.run_server(args, serve_options(ns, names, args.max_logprobs))


def expand_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """vLLM's spellings: `--flag_name` as `--flag-name`, and a `--config FILE` read in place
    (after the subcommand and its positional model, so later words win)."""
    words = [_dashed(w) for w in argv]
    for i, word in enumerate(words):
        if word == "--config" or word.startswith("--config="):
            path = word.partition("=")[2] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
            rest = words[i + 1 :] if "=" in word else words[i + 2 :]
            if not path:
                parser.error("argument --config: expected one argument")
            head = words[:i]
            at = 2 if len(head) > 1 and not head[1].startswith("-") else 1
            return head[:at] + _config_words(parser, head[0] if head else "", path) + head[at:] + rest
    return words


def _dashed(word: str) -> str:
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return name.replace("_", "-") + eq + value


def _config_words(parser: argparse.ArgumentParser, command: str, path: str) -> list[str]:
    import yaml  # type: ignore[import-untyped]

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"argument --config: cannot read {path}: {exc}")
    if config is None:
        return []
    if not isinstance(config, dict):
        parser.error(f"argument --config: {path} must hold a mapping of flag: value")
    sub = _subparser(parser, command)
    known = sub._option_string_actions if sub is not None else {}
    words: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config" or flag not in known:
            parser.error(f"argument --config: unknown key {key!r} in {path} (no flag {flag})")
        if isinstance(value, bool):
            if value:
                words.append(flag)
            elif f"--no-{flag[2:]}" in known:
                words.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            words += [flag, *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        elif value is not None:
            words += [flag, str(value)]
    return words


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(command)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(expand_argv(parser, sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(ns, "log_level", "warning").upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "chat":
            return cmd_chat(ns)
        return int(ns.func(ns))
    except ValueError as exc:
        print(f"triollm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
