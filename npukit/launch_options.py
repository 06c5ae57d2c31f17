"""npu-run's own options as a command line holds them: read up to the script's name, after which
every word is the script's. Used by npu-run's torchrun relaunch and by the readers that re-run an
npu-run command (the fix finder's trials), so none of them imports npu-run itself.
"""

from __future__ import annotations

# npu-run's options that take no value (every other one takes one): how its arguments are read
# up to the script's name, after which everything is the script's
RUN_FLAGS = frozenset({"--golden", "--emulate", "--transfer-to-npu", "--detect-overflow", "--overflow-underflow",
                       "-m", "--module"})


def option_spans(argv: list[str]) -> tuple[list[list[str]], list[str]]:
    """npu-run's arguments as ([each option with its value], [the script and its arguments])."""
    options, index = [], 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("-") or token == "-":
            break
        width = 1 if token in RUN_FLAGS or "=" in token else 2
        options.append(argv[index:index + width])
        index += width
    return options, argv[index:]


def strip_option(argv: list[str], name: str) -> list[str]:
    """Remove `name VALUE` / `name=VALUE` from the npu-run options (those before the script)."""
    options, script = option_spans(argv)
    kept = [token for option in options if option[0].split("=", 1)[0] != name for token in option]
    return kept + script


def rename_option(argv: list[str], name: str, alias: str) -> list[str]:
    """`name VALUE` / `name=VALUE` among the npu-run options as `alias ...`. torchrun reads every
    option word of its command line, the relaunched npu-run's too, as a possible abbreviation of
    its own: `--monitor` would be taken for its --monitor-interval ("ambiguous option")."""
    options, script = option_spans(argv)
    renamed = [[alias + option[0][len(name):], *option[1:]] if option[0].split("=", 1)[0] == name else option
               for option in options]
    return [token for option in renamed for token in option] + script
