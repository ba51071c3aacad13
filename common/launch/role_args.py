"""`pdserve launch`'s flags for its children: which role takes each extra flag, and the helpers
that read or drop a flag in an argument list (pure: no processes)."""

from __future__ import annotations

import argparse

from common.flags import add_bootstrap_args, add_colocated_args, add_decode_args, add_prefill_args

ROLE_PARSERS = {
    "bootstrap": add_bootstrap_args,
    "prefill": add_prefill_args,
    "decode": add_decode_args,
}
# Launch gives each child these itself (a node's id and registries, the API's address).
LAUNCH_OWNED = {"--host", "--port", "--model-path", "--node-id", "--bootstrap-url"}


def role_flags_help() -> str:
    """Every flag launch passes on, with the roles that take it and its help."""
    parsers = {role: role_parser(role) for role in ROLE_PARSERS}
    lines = ["flags passed on to the roles that take them (see pdserve <role> --help):"]
    seen: set[str] = set()
    for parser in parsers.values():
        for action in parser._actions:
            flags = [f for f in action.option_strings if f.startswith("--")]
            if not flags or flags[0] in seen or flags[0] in LAUNCH_OWNED:
                continue
            seen.add(flags[0])
            roles = ",".join(r for r, p in parsers.items() if flags[0] in p._option_string_actions)
            text = (action.help or "").replace("%%", "%")
            lines.append(f"  {flags[0]:44} [{roles}] {text}".rstrip())
    return "\n".join(lines)


def role_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    ROLE_PARSERS[role](parser)
    return parser


def colocated_args(prefill: list[str], decode: list[str]) -> list[str]:
    """A colocated process's flags: the prefill nodes' and then the decode nodes' others,
    less those it has no use for (--disaggregation-transfer-backend: it hands over in memory)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_colocated_args(parser)
    both = union(prefill, decode)
    for flag in {a.split("=", 1)[0] for a in both if a.startswith("--")}:
        if flag not in parser._option_string_actions:
            both = without(both, flag)
    return both


def split_extra_args(extra: list[str]) -> dict[str, list[str]]:
    """Give each `--flag [value]` to every role whose parser accepts it; unknown -> error."""
    parsers = {role: role_parser(role) for role in ROLE_PARSERS}
    out: dict[str, list[str]] = {role: [] for role in ROLE_PARSERS}
    i = 0
    while i < len(extra):
        flag = extra[i].split("=", 1)[0]
        takers = [r for r, p in parsers.items() if flag in p._option_string_actions]
        if not takers or flag in LAUNCH_OWNED:
            raise SystemExit(f"pdserve launch: error: unknown or reserved flag {extra[i]}")
        action = parsers[takers[0]]._option_string_actions[flag]
        n = 1 if "=" in extra[i] or action.nargs == 0 else 2
        for role in takers:
            out[role] += extra[i : i + n]
        i += n
    return out


def union(first: list[str], second: list[str]) -> list[str]:
    """``first`` and then the flags of ``second`` that ``first`` does not give."""
    given = {a.split("=", 1)[0] for a in first if a.startswith("--")}
    out, i = list(first), 0
    while i < len(second):
        flag = second[i].split("=", 1)[0]
        n = 1 if "=" in second[i] or i + 1 >= len(second) or second[i + 1].startswith("--") else 2
        if flag not in given:
            out += second[i : i + n]
        i += n
    return out


def without(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` and its value (``--flag v`` or ``--flag=v``)."""
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        if not args[i].startswith(flag + "="):
            out.append(args[i])
        i += 1
    return out


def value(args: list[str], flag: str, default: str | None) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default
