"""Rendering values into the formats rigbook writes on a rig, so that no value can break out.

Host data and recipes are validated first (rigbook/core/types.py); here each value is escaped for
the format it lands in, or refused when the format has no way to hold it:

- `systemd_word`: one argument of an `ExecStart=` line, read back by systemd unchanged
  (systemd.syntax(7): `%` specifiers and `$` variables doubled, quoted when needed).
- `env_line`: one `KEY="value"` line of an `EnvironmentFile=` (`"`, `\\`, `$` and backtick
  escaped).
- `one_line`: a value in a file that is read line by line (a deb822 apt source, a modprobe
  file, a sysctl.d file): refused when it holds a control character; `unit_text` the same
  for free text in a unit (a comment, Description=), with `%` specifiers doubled.
- `shell`: one word for a POSIX shell (`shlex.quote`), in scripts rigbook generates.

Every template goes through `render(path, **values)` (`render_crlf` for the files Windows' own
tools read), and every file rigbook writes from one through `template` (or `template_commands`
inside a larger operation), which hands the text to rigbook.core.managed: one jinja environment
with these filters, StrictUndefined (a missing value is an error, never an empty string) and no
autoescape (the filters are the escaping).
"""

from __future__ import annotations

import io
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from jinja2 import Environment, StrictUndefined
from pyinfra.api.arguments import all_global_arguments

from rigbook.core.managed import put, text_commands

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Characters systemd reads back unchanged in an unquoted word (no shell: globs are plain).
_SYSTEMD_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./*?\[\]-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def one_line(value: object) -> str:
    """`value` as text for a line-based format; ValueError when it holds a control character."""
    text = str(value)
    if _CONTROL.search(text):
        raise ValueError(f"a newline or control character cannot be written here: {text!r}")
    return text


def systemd_word(arg: str) -> str:
    """One argument as systemd's ExecStart= reads it back unchanged (% and $ are specifiers)."""
    arg = one_line(arg).replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_SAFE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_line(key: str, value: str) -> str:
    """`KEY="value"` for an EnvironmentFile=: quoted, with `"`, `\\`, `$` and backtick escaped."""
    if not _ENV_KEY.fullmatch(key):
        raise ValueError(f"not an environment variable name: {key!r}")
    escaped = re.sub(r'(["\\\\$`])', r"\\\1", one_line(value))
    return f'{key}="{escaped}"'


def unit_text(value: object) -> str:
    """Free text in a systemd unit (a comment, Description=): one line, `%` doubled."""
    return one_line(value).replace("%", "%%")


def shell(value: object) -> str:
    return shlex.quote(one_line(value))


@cache
def _environment(newline: str = "\n") -> Environment:
    env = Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                      undefined=StrictUndefined, autoescape=False, newline_sequence=newline)
    env.filters.update(systemd=systemd_word, line=one_line, unit=unit_text, q=shell,
                       qjoin=lambda values: " ".join(shell(v) for v in values))
    env.globals["env_line"] = env_line
    return env


def render(path: Path | str, **values) -> str:
    """The template at `path` with `values` (each escaped by its filter in the template)."""
    return _environment().from_string(Path(path).read_text()).render(**values)


def render_crlf(path: Path | str, **values) -> str:
    """`render` with Windows line ends (CRLF), for the files Windows' own tools read."""
    return _environment("\r\n").from_string(Path(path).read_text()).render(**values)


def template_commands(src: Path | str, dest: str, mode: str = "644", **values) -> Iterator:
    """The commands that write a rendered rigbook template to `dest` when its content or mode
    differs, inside a larger operation (rigbook.core.managed: one read for all of a rig's
    files)."""
    yield from text_commands(render(src, **values), dest, mode)


#: pyinfra's own arguments of an operation call (name=, _sudo=, _if=...): not template values.
_OP_ARGS = frozenset(key for key, _ in all_global_arguments())


def template(src: Path | str, dest: str, mode: str = "644", **values):
    """Write a file rendered from a rigbook template when its content or mode differs: the
    rendered text goes through rigbook.core.managed's `put`, the one way rigbook writes a file
    (its path named while the deploy is planned, its write keeping the run's file states)."""
    op_args = {key: values.pop(key) for key in list(values) if key in _OP_ARGS}
    return put(io.StringIO(render(src, **values)), dest, mode, **op_args)
