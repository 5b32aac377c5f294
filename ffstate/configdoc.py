"""The configuration reference (docs/configuration.md), generated from ``Config``, ``DaemonConfig`` and
``ffstate serve``'s flags, so that the page cannot drift from the code (a test compares them).

    python -m ffstate.configdoc > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import re

from ffstate.config import Config, DaemonConfig

# The job's knobs a worker passes to the daemon it starts (``daemon/launch.py``), by ``ffstate serve``'s flag.
SERVE_FLAG = {"node_id": "--node-id", "daemon_host": "--host", "base_port": "--port",
              "daemon_memory_limit": "--memory-limit", "daemon_idle_exit": "--idle-exit", "max_lag": "--keep-deltas",
              "scheduler": "--scheduler", "link_share": "--link-share", "link_bandwidth": "--link-bandwidth",
              "metrics_port": "--metrics-port", "bulk_port": "--bulk-port", "hang_action": "--hang-action",
              "hang_multiple": "--hang-multiple",
              "hang_floor": "--hang-floor", "hang_ceiling": "--hang-ceiling", "hang_startup": "--hang-startup",
              "straggler_ratio": "--straggler-ratio", "persist_dir": "--persist-dir",
              "persist_every": "--persist-every", "persist_keep": "--persist-keep", "persist_nice": "--persist-nice",
              "daemon_nice": "--nice", "daemon_cpus": "--cpus",
              "token_file": "--token-file"}
HEAD = """# Configuration

Every knob of a training job is a field of `ffstate.Config`, set by `FFSTATE_<FIELD>` in the environment or
passed as `replicate(..., config=Config(...))`; a daemon the workers start gets the daemon's share of them as
`ffstate serve` flags. A daemon you run yourself takes `ffstate serve`'s flags (the fields of `DaemonConfig`).
Where the two differ it is said why. A value a field refuses stops the job at entry, naming the variable that set
it; an `FFSTATE_` variable no field reads (a misspelt one) is named in a warning. (This page is generated:
`python -m ffstate.configdoc`.)

"""


def _meanings() -> dict[str, str]:
    """Each Config field's meaning, from the class docstring's Attributes section (fields described together
    share one text)."""
    names = {f.name for f in dataclasses.fields(Config)}
    out: dict[str, str] = {}
    current: list[str] = []
    for line in (Config.__doc__ or "").split("Attributes:", 1)[1].splitlines():
        head, sep, text = line.strip().partition(": ")
        fields = [n.strip() for n in head.split(",")]
        if line.startswith(" " * 8) and not line.startswith(" " * 9) and sep and set(fields) <= names:
            current = fields
            for n in current:
                out[n] = text
        elif current and line.strip():
            for n in current:
                out[n] += " " + line.strip()
    return {k: re.sub(r"``([^`]*)``", r"`\1`", v) for k, v in out.items()}


def _serve_help() -> dict[str, str]:
    """``ffstate serve``'s flags and their help texts."""
    from ffstate.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {a.option_strings[0]: " ".join((a.help or "").split()) for a in serve._actions if a.option_strings}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: object) -> str:
    return f"`{value!r}`" if not isinstance(value, str) or value else '`""`'


def _daemon_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _default(f.default)
    return "the host name" if f.name == "node_id" else _default(f.default_factory())


def table() -> str:
    """The whole page: the job's fields, then the daemon's own."""
    meanings, helps = _meanings(), _serve_help()
    rows = ["| field | environment | `ffstate serve` | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        flag = SERVE_FLAG.get(f.name, "")
        rows.append(f"| `{f.name}` | `FFSTATE_{f.name.upper()}` | {f'`{flag}`' if flag else '-'} | "
                    f"{_default(f.default)} | {_cell(meanings.get(f.name, ''))} |")
    own = ["| `ffstate serve` flag | `DaemonConfig` field | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(DaemonConfig):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        if flag is None:
            continue
        own.append(f"| `{flag}` | `{f.name}` | {_daemon_default(f)} | {_cell(helps.get(flag, ''))} |")
    return (HEAD + "## A training job: `ffstate.Config`\n\n" + "\n".join(rows) + "\n\n"
            "## A daemon: `ffstate serve`\n\n"
            "The token comes from `--token-file` or `$FFSTATE_TOKEN`, never from the command line. A daemon the "
            "workers start gets `--exit-when-empty`, its pid file and the job's knobs above; one you run keeps "
            "these defaults, which are the ones the workers look for (the node's address, port 7700) and never "
            "exits on its own.\n\n" + "\n".join(own) + "\n")


if __name__ == "__main__":
    print(table(), end="")
