"""Messages in the words of the interface in use: a command-line flag as the Python API's keyword
(`--kv-cache-ratio 0.5` -> `kv_cache_ratio=0.5`), registered with `convert.errors` at import."""

from __future__ import annotations

import re
from functools import cache

from convert.errors import speak_python
from convert.options.conversion import ConvertOptions
from convert.options.fields import cli_fields, field_default, long_flag
from convert.options.training import EvalOptions, HealOptions

#: Flags that are not options fields: the commands' own paths (cli.py), by their API keyword.
_PATH_FLAGS = {
    "-o": "output",
    "--output": "output",
    "--report-dir": "report_dir",
    "--eval-text": "eval_texts",
    "--original": "original",
    "--training-dir": "training_dir",
}


@cache
def _keywords() -> dict[str, tuple[str, object, tuple]]:
    """Each command-line flag -> (its API keyword, the value a boolean flag sets or None, its choices)."""
    table: dict[str, tuple[str, object, tuple]] = {flag: (name, None, ()) for flag, name in _PATH_FLAGS.items()}
    entry: tuple[str, object, tuple]
    for cls in (ConvertOptions, HealOptions, EvalOptions):
        for f in cli_fields(cls):
            meta, default = f.metadata, field_default(f)
            if meta["off_flag"]:
                flag, entry = meta["off_flag"], (f.name, not default, ())
            else:
                flag = long_flag(f)
                entry = (f.name, True if isinstance(default, bool) else None, meta["choices"] or ())
            table[flag] = entry
            if meta["short"]:
                table[meta["short"]] = entry
    return table


_FLAG = re.compile(
    r"(?<![\w-])(-[a-zA-Z]|--[a-z][a-z0-9-]*)(?![\w-])(?: ('[^']*'|-?\d[\d.e+-]*|[A-Z][A-Z_]*\b|[a-z][\w-]*))?"
)


def python_terms(message: str) -> str:
    """A message's command-line flags as the Python API's keywords: `--kv-cache-ratio 0.5` ->
    `kv_cache_ratio=0.5`, `--method svd` -> `method='svd'`, `--force` -> `force=True`, `-o` -> `output`.
    Words that are not flags of convert's commands are left as they are."""

    def keyword(match: re.Match) -> str:
        known = _keywords().get(match.group(1))
        if known is None:
            return match.group(0)
        name, flag_value, choices = known
        value = match.group(2)
        if flag_value is not None:
            return f"{name}={flag_value}" + (f" {value}" if value else "")
        if value is None:
            return name
        if value[0].islower():  # a word: the option's value only if it is one of its choices
            return f"{name}={value!r}" if value in choices else f"{name} {value}"
        return f"{name}={value}"

    return _FLAG.sub(keyword, message)


speak_python(python_terms)
