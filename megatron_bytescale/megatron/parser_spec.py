"""Megatron-LM's argument parser as data, so the launcher can judge a command line with it
before any rank starts, without importing torch (which Megatron's ``arguments`` module does:
seconds of imports, where a refusal should take one).

``spec_of(parser)`` writes down every action of a live parser (option strings, attribute,
action kind, ``nargs``, ``const``, default, value type, choices, argument group) and where
the parser came from: the source files whose text defines its flags (``arguments.py``, and in
core_v0.19 the configuration dataclasses its argument groups are built from), with one
digest over them. ``build_parser(spec)`` makes an argparse parser that reads a command line as
Megatron's would: the same flags, attributes, defaults, counts of values, types and choices.
Values of Megatron's own converter functions (``--window-size 64,0``, layer patterns, enum
names) are kept as their text; Megatron converts them in the ranks.

The package ships the spec of each supported tree (``parser_specs/``, written by
``python -m megatron_bytescale.megatron.parser_spec --write TREE``; tests compare them with
the real parsers). ``load(tree)`` returns the shipped spec whose sources match the tree's
files; for any other tree it extracts the spec from the real parser once, in a subprocess
(saying so on stderr), and caches it by digest.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parent / "parser_specs"
FORMAT = 1
CACHE_ENV = "BYTESCALE_CACHE_DIR"

_KINDS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse.BooleanOptionalAction: "boolean_optional",
}
_TYPES = {None: None, int: "int", float: "float", str: "str", bool: "bool"}


def _plain(value):
    """A JSON value for a default, const or choice: enum members by name, anything else that
    JSON cannot hold by its ``repr`` (marked)."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return {"repr": repr(value)}


def _type_name(action) -> str | None:
    if action.type in _TYPES:
        return _TYPES[action.type]
    if action.choices is not None and all(isinstance(c, enum.Enum) for c in action.choices):
        return "enum"
    return "text"  # one of Megatron's converters: the launcher keeps the text


def _group_titles(parser) -> dict[int, str]:
    return {id(a): g.title for g in parser._action_groups for a in g._group_actions}


def spec_of(parser: argparse.ArgumentParser, sources: dict[str, str] | None = None) -> dict:
    """The spec of a live parser; ``sources``: relative path -> file the flags come from."""
    groups = _group_titles(parser)
    actions = []
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        actions.append(
            {
                "options": list(a.option_strings),
                "dest": a.dest,
                "action": _KINDS.get(type(a), type(a).__name__),
                "nargs": a.nargs,
                "const": _plain(a.const),
                "default": _plain(a.default),
                "type": _type_name(a),
                "choices": None if a.choices is None else [_plain(c) for c in a.choices],
                "required": bool(a.required),
                "group": groups.get(id(a)),
            }
        )
    sources = dict(sorted((sources or {}).items()))
    return {"format": FORMAT, "sources": sorted(sources), "digest": digest(sources), "actions": actions}


def digest(files: dict[str, str]) -> str:
    """sha256 over (relative path, contents) of each source file, in path order."""
    h = hashlib.sha256()
    for rel, path in sorted(files.items()):
        h.update(rel.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------ reading a command line
class OneLineParser(argparse.ArgumentParser):
    """argparse, but a refusal is a ConfigError (one line), not usage text and exit 2."""

    def error(self, message):
        from ..errors import ConfigError

        raise ConfigError(message)


_CONVERT = {None: None, "int": int, "float": float, "str": str, "bool": bool, "enum": str, "text": str}


def _default(value):
    return None if isinstance(value, dict) and "repr" in value else value


def build_parser(spec: dict, prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """An argparse parser that reads a command line as the parser of ``spec`` does."""
    parser = OneLineParser(prog=prog, add_help=False, allow_abbrev=False)
    for a in spec["actions"]:
        kind, kwargs = a["action"], {"dest": a["dest"], "default": _default(a["default"])}
        if a["required"]:
            kwargs["required"] = True
        if kind in ("store", "append"):
            kwargs.update(type=_CONVERT[a["type"]], nargs=a["nargs"], choices=a["choices"])
            if a["nargs"] == "?":
                kwargs["const"] = a["const"]
        elif kind in ("store_const", "append_const"):
            kwargs["const"] = a["const"]
        elif kind == "boolean_optional":
            parser.add_argument(*a["options"], action=argparse.BooleanOptionalAction, **kwargs)
            continue
        parser.add_argument(*a["options"], action=kind, **kwargs)
    return parser


# ------------------------------------------------------------------ which tree
def _package_info(tree: Path) -> Path:
    return tree / "megatron" / "core" / "package_info.py"


def tree_version(tree: Path) -> str:
    """megatron-core's version as the tree's ``package_info.py`` writes it (without importing it)."""
    text = _package_info(tree).read_text()
    parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    pre = re.search(r"^PRE_RELEASE\s*=\s*['\"]([^'\"]*)['\"]", text, re.M)
    return ".".join(m.group(1) if m else "?" for m in parts.values()) + (pre.group(1) if pre else "")


def _resolve_sources(tree: Path, rels) -> dict[str, str] | None:
    """The files of ``rels`` (relative to the folder that holds the ``megatron`` package): in
    the tree first, else where ``sys.path`` would find them (megatron.core from a wheel)."""
    found = {}
    roots = [tree, *(Path(p) for p in sys.path if p)]
    for rel in rels:
        path = next((r / rel for r in roots if (r / rel).is_file()), None)
        if path is None:
            return None
        found[rel] = str(path)
    return found


def shipped_specs() -> list[Path]:
    return sorted(SPEC_DIR.glob("*.json"))


def find_shipped(tree: Path) -> dict | None:
    """The shipped spec whose source files are the tree's, byte for byte."""
    version = tree_version(tree)
    for path in shipped_specs():
        if not path.name.startswith(version + "-"):
            continue
        spec = json.loads(path.read_text())
        files = _resolve_sources(tree, spec["sources"])
        if files is not None and digest(files) == spec["digest"]:
            return spec
    return None


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron_bytescale" / "parser-specs"


def load(tree: str | Path, *, announce=print) -> dict:
    """The parser spec of the Megatron-LM checkout ``tree`` (see the module docstring)."""
    from ..errors import ConfigError

    tree = Path(tree).resolve()
    if not _package_info(tree).is_file():
        raise ConfigError(f"{tree}: no megatron/core/package_info.py; give the path of a Megatron-LM checkout")
    spec = find_shipped(tree)
    if spec is not None:
        return spec
    version = tree_version(tree)
    for path in sorted(cache_dir().glob(f"{version}-*.json")):
        cached = json.loads(path.read_text())
        files = _resolve_sources(tree, cached.get("sources", ()))
        if cached.get("format") == FORMAT and files is not None and digest(files) == cached["digest"]:
            return cached
    announce(
        f"bytescale: Megatron-LM {version} at {tree} is not one of the trees this package ships the argument "
        f"parser of; reading its parser once (a few seconds), cached in {cache_dir()}",
        file=sys.stderr,
        flush=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.megatron.parser_spec", "--print", str(tree)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"could not read Megatron-LM's argument parser from {tree}: {last}")
    spec = json.loads(proc.stdout)
    target = cache_dir() / f"{version}-{spec['digest'][:16]}.json"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(target)
    except OSError:
        pass  # a read-only home: the spec is still used for this launch
    return spec


# ------------------------------------------------------------------ extraction (imports Megatron)
def _relative(path: str) -> str | None:
    """``megatron/...`` part of a source file's path (the folder holding the package dropped)."""
    parts = Path(path).resolve().parts
    if "megatron" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("megatron")  # the outermost 'megatron' package folder
    while i > 0 and parts[i - 1] == "megatron":
        i -= 1
    return str(Path(*parts[i:]))


_ENVIRONMENT_DEFAULTS = ("WORLD_SIZE", "LOCAL_RANK", "RANK")


def megatron_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """Megatron's own parser (``add_megatron_arguments``, what pretrain_gpt.py parses) and the
    source files its flags come from. Imports Megatron's training package."""
    # (the package's __init__ has run: triton stand-ins are in place where triton is missing)
    classes: list[type] = []
    try:
        from megatron.training import argument_utils

        factory = argument_utils.ArgumentGroupFactory
        original_init = factory.__init__

        def init(self, src_cfg_type, *args, **kwargs):
            classes.append(src_cfg_type)
            return original_init(self, src_cfg_type, *args, **kwargs)

        factory.__init__ = init
    except ImportError:  # core_v0.16: every flag is written in arguments.py
        factory = original_init = None
    from megatron.training import arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    # two defaults come from the environment (--inprocess-active-world-size from WORLD_SIZE,
    # --local-rank from LOCAL_RANK): the spec holds the values of a plain shell, wherever it is read
    saved = {name: os.environ.pop(name) for name in _ENVIRONMENT_DEFAULTS if name in os.environ}
    try:
        arguments.add_megatron_arguments(parser)
    finally:
        os.environ.update(saved)
        if factory is not None:
            factory.__init__ = original_init
    files = [inspect.getsourcefile(arguments)]
    if factory is not None:
        files.append(inspect.getsourcefile(argument_utils))
    for cls in classes:
        files += [inspect.getsourcefile(c) for c in cls.__mro__ if c.__module__.startswith("megatron.")]
    for a in parser._actions:
        if a.type not in _TYPES and a.type is not None:
            files.append(inspect.getsourcefile(a.type))
        if a.choices is not None:
            files += [inspect.getsourcefile(type(c)) for c in a.choices if isinstance(c, enum.Enum)]
    sources = {}
    for f in files:
        rel = _relative(f) if f else None
        if rel is not None:
            sources[rel] = f
    return parser, sources


def main(argv: list[str] | None = None) -> int:
    """``--print TREE``: the spec of the parser importable here, as JSON on stdout (the caller
    puts TREE first on PYTHONPATH); ``--write TREE``: the same into ``parser_specs/``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("--print", "--write"):
        print("usage: python -m megatron_bytescale.megatron.parser_spec --print|--write TREE", file=sys.stderr)
        return 2
    spec = spec_of(*megatron_parser())
    if argv[0] == "--print":
        print(json.dumps(spec))
        return 0
    target = SPEC_DIR / f"{tree_version(Path(argv[1]))}-{spec['digest'][:16]}.json"
    target.write_text(json.dumps(spec, indent=0, sort_keys=True) + "\n")
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
