"""The bounded YAML loader and the one-line error of every config: what a config, a sweep spec or
a ``--set`` value may be (size, depth, aliases, duplicate keys), user values quoted in messages
within bounds, and the reading of a file that may be anything (a FIFO, a directory, huge)."""

from __future__ import annotations

import os
import re
import reprlib
import stat
from typing import Any

import yaml

class ConfigError(ValueError):
    """A chip config (file, key or override) is invalid. The message is one line."""


# ---------------------------------------------------------------------------------------------
# Bounded YAML and bounded error values
# ---------------------------------------------------------------------------------------------

#: Limits of what one YAML document (a config, a sweep spec, a --set value) may be. A chip config
#: is ~100 values four levels deep; these leave room for big sweep specs while keeping a
#: malicious or mistaken file (alias bombs, 10,000-deep lists, a 1 GB file) to a one-line error
#: in milliseconds instead of gigabytes and minutes.
MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 100_000  # nodes after expanding every alias
ERROR_VALUE_CHARS = 80  # how much of a user's value an error message quotes

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 6, 6
_REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _REPR.maxarray = 6
_REPR.maxstring = _REPR.maxother = ERROR_VALUE_CHARS
_REPR.maxlong = 40


def format_value(value: Any, limit: int = ERROR_VALUE_CHARS) -> str:
    """``repr(value)`` for an error message, bounded in time, memory and length whatever the
    value is (a nested alias bomb, a 50 MB string, a 5,000-digit integer) and on one line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails must not turn an error into a traceback
        text = f"<{type(value).__name__}>"
    return clip_text(text, limit, quoted=False)


def clip_text(text: Any, limit: int = ERROR_VALUE_CHARS, *, quoted: bool = False) -> str:
    """A user's text for an error message: printable text as is, anything else escaped (so a
    newline cannot break the one-line rule), cut to ``limit`` characters with the length of the
    whole. ``quoted`` gives it Python quotes, like ``repr``."""
    s = text if isinstance(text, str) else str(text)
    head = s[:limit]
    if quoted:
        shown = repr(head)
    elif head.isprintable():
        shown = head
    else:
        shown = repr(head)[1:-1]  # escaped, without the quotes
    return shown if len(s) <= limit else f"{shown}... ({len(s):,} characters)"


class _BoundedYamlError(yaml.MarkedYAMLError):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with limits: depth and alias expansion are counted while the document
    is composed (before any value is built), a mapping's duplicate keys are refused naming both
    lines, and values the constructors choke on (a 13th month, a 5,000-digit integer) become YAML
    errors at their line instead of stray ValueErrors."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._sizes:
                raise _BoundedYamlError(None, None, f"alias *{clip_text(event.anchor, 40)} refers to a value that "
                                        f"contains it (a recursive structure)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _BoundedYamlError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                        self.peek_event().start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if id(node) not in self._sizes:
            if isinstance(node, yaml.MappingNode):
                kids = [x for kv in node.value for x in kv]
            elif isinstance(node, yaml.SequenceNode):
                kids = node.value
            else:
                kids = []
            values = 1 + sum(self._sizes[id(k)][0] for k in kids)
            depth = 1 + max((self._sizes[id(k)][1] for k in kids), default=0)
            if values > MAX_YAML_VALUES:
                raise _BoundedYamlError(None, None, f"anchors and aliases expand to more than {MAX_YAML_VALUES:,} "
                                        f"values; write the values out or use fewer aliases", node.start_mark)
            if depth > MAX_YAML_DEPTH:
                raise _BoundedYamlError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels once aliases "
                                        f"are expanded", node.start_mark)
            self._sizes[id(node)] = (values, depth)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    prev = first.setdefault(key, key_node)
                except TypeError:
                    continue  # unhashable: the base class reports it
                if prev is not key_node:
                    raise _BoundedYamlError(None, None, f"duplicate key {format_value(key, 40)} (first at line "
                                            f"{prev.start_mark.line + 1}); a key may appear once",
                                            key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as e:
            raise _BoundedYamlError(None, None, f"cannot read the value: {clip_text(e, 120)}", node.start_mark) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """' line N: problem' for a YAML error (line of the problem, 1-based)."""
    if isinstance(e, yaml.reader.ReaderError):
        if isinstance(e.character, int):
            return f" character {e.position + 1}: #x{e.character:04x} is not allowed in YAML"
        return f" {clip_text(e.reason)}"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = f" line {mark.line + 1}:" if mark is not None else ""
    return f"{line} {clip_text(getattr(e, 'problem', None) or getattr(e, 'context', None) or 'invalid YAML', 200)}"


_DENSE_BRACKETS = re.compile(r"(?:[\[{][ \t]*){%d}" % (MAX_YAML_DEPTH + 1))


def load_yaml(text: str, where: str) -> Any:
    """Parse one YAML document with PyYAML's safe loader, within the limits above. Errors are
    a one-line :class:`ConfigError` ``"<where>: line N: <problem>"``."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: {len(text):,} characters of YAML; at most {MAX_YAML_BYTES:,} are read")
    dense = _DENSE_BRACKETS.search(text)
    if dense:  # PyYAML's scanner takes ~1 s to reach the depth limit through a wall of brackets
        raise ConfigError(f"{where}: line {text.count(chr(10), 0, dense.start()) + 1}: nested deeper than "
                          f"{MAX_YAML_DEPTH} levels")
    loader = None
    try:
        loader = _BoundedLoader(text)
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}:{_yaml_problem(e)}") from None
    except RecursionError:  # pragma: no cover - the depth limit comes first
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for a ``st_mode`` (``"a regular file"``): what a path
    names when it is not the regular file a reader (here) or a writer (:mod:`trnsim.config.files`) wants."""
    for test, name in _FILE_KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def read_bounded(path: str | os.PathLike[str], where: str, what: str) -> str:
    """The text of a config-like file, read safely: a missing file, a FIFO or device (never
    opened: it could block forever), a file over the size limit or one that is not UTF-8 is a
    one-line :class:`ConfigError` naming ``what`` and the path (whole, with anything unprintable
    escaped so a newline in a file name cannot break the one-line rule)."""
    name = os.fspath(path)
    shown = clip_text(name, limit=max(1, len(name)))
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise ConfigError(f"{what} '{shown}' not found") from None
    except OSError as e:
        raise ConfigError(f"{what} '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} '{shown}': it is {file_kind(st.st_mode)}, not a regular file")
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_YAML_BYTES // 2**20} MiB; a {what} is at most that")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start + 1})") from None


def load_yaml_file(path: str | os.PathLike[str], where: str, what: str = "YAML file") -> Any:
    """Read and parse a YAML file with :func:`load_yaml`, after :func:`read_bounded`'s checks."""
    return load_yaml(read_bounded(path, where, what), where)


def env_int(name: str, default: int, lo: int, hi: int, what: str) -> int:
    """An integer setting from the environment variable ``name`` (unset or blank: ``default``).
    Anything but a whole number in ``lo..hi`` is a one-line :class:`ConfigError` naming the
    variable, its value and ``what`` it should be."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    # ASCII digits only: int() also takes other scripts' digits and "1_000"
    n = int(text) if len(text) <= 20 and digits.isascii() and digits.isdigit() else None
    if n is None or not lo <= n <= hi:
        raise ConfigError(f"{name}={clip_text(text, 40, quoted=True)}: expected {what}, {lo}..{hi:,}")
    return n
