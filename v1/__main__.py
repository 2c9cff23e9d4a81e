"""`python -m v1 COMMAND`: demo (the main job), serve (OpenAI-compatible server)."""

import sys

COMMANDS = {
    "demo": "v1.entrypoints.demo",
    "serve": "v1.entrypoints.openai.api_server",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m v1 {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        sys.exit(2)
    import importlib

    importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
