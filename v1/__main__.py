"""The `v1` command (also `python -m v1`): `v1 serve [MODEL] [options]` (the OpenAI-compatible
server, as `vllm serve`), `v1 demo` (the main job). `v1 COMMAND --help` lists its options;
`v1 --version` prints the package's version."""

import importlib
import importlib.metadata
import sys

# command -> (module with main(argv, prog), what it does)
COMMANDS = {
    "serve": ("v1.entrypoints.openai.api_server", "start the OpenAI-compatible server"),
    "demo": ("v1.entrypoints.demo", "batched answers under one shared system prompt"),
}


def main(argv: list[str] | None = None, prog: str = "v1") -> None:
    """The console script's entry point; `argv` defaults to the command line's."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-v"], ["--version"]):  # as `vllm --version`
        print(importlib.metadata.version("v1"))
        sys.exit(0)
    if not argv or argv[0] not in COMMANDS:
        lines = [f"usage: {prog} {{{','.join(COMMANDS)}}} [options]", "", "commands:"]
        lines += [f"  {name:8}{what}" for name, (_, what) in COMMANDS.items()]
        lines.append(f"\n`{prog} COMMAND --help` lists a command's options.")
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    module, _ = COMMANDS[argv[0]]
    importlib.import_module(module).main(argv[1:], f"{prog} {argv[0]}")


if __name__ == "__main__":
    main(prog="python -m v1")
