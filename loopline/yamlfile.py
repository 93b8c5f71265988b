"""Reading a user's YAML file, bounded: its size, its alias-expanded values and depth, duplicate keys, numbers
of absurd length, encoding and NUL, each refused in one line naming the file and the line (env specs and run
configs alike: a 50 MB run config took 84 s to refuse, a duplicate key's last value silently won)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from loopline.errors import LooplineError

MAX_YAML_NODES = 10_000  # after alias expansion: a few anchors cannot expand to a billion nodes
MAX_YAML_DEPTH = 40


class _BoundedLoader(yaml.SafeLoader):
    """Stops composing as soon as a document is too big or too deep, instead of after reading it all."""

    def __init__(self, text: str, file: Path, hint: str):
        super().__init__(text)
        self.file, self.hint, self.nodes, self.depth = file, hint, 0, 0

    def compose_node(self, parent, index):
        self.nodes, self.depth = self.nodes + 1, self.depth + 1
        line = self.get_mark().line + 1
        if self.nodes > MAX_YAML_NODES:
            raise LooplineError(f"{self.file}:{line}: more than {MAX_YAML_NODES:,} values; {self.hint}")
        if self.depth > MAX_YAML_DEPTH:
            raise LooplineError(f"{self.file}:{line}: nested deeper than {MAX_YAML_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _check_tree(file: Path, root: yaml.Node, hint: str) -> None:
    """Refuse documents whose alias-expanded size or depth is unreasonable, and duplicate keys.

    Sizes are counted over the node graph with memoisation, so a billion-laughs
    document is measured in microseconds instead of being expanded.
    """
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}

    def walk(node: yaml.Node) -> tuple[int, int]:
        key = id(node)
        if key in sizes:
            return sizes[key], depths[key]
        size, depth = 1, 0
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    if k.value in seen:
                        raise LooplineError(
                            f"{file}:{k.start_mark.line + 1}: duplicate key {k.value!r} (first on line {seen[k.value]})"
                        )
                    seen[k.value] = k.start_mark.line + 1
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
            if node.tag == "tag:yaml.org,2002:int" and len(node.value) > 30:  # (Python refuses > 4300 digits, mid-parse)
                raise LooplineError(f"{file}:{node.start_mark.line + 1}: a number of {len(node.value):,} digits; numbers here fit in 64 bits")
        for child in children:
            child_size, child_depth = walk(child)
            size, depth = size + child_size, max(depth, child_depth + 1)
            if size > MAX_YAML_NODES:
                raise LooplineError(
                    f"{file}:{node.start_mark.line + 1}: the document expands to more than {MAX_YAML_NODES:,} "
                    f"values (aliases count each time they are used); {hint}"
                )
            if depth > MAX_YAML_DEPTH:
                raise LooplineError(f"{file}:{child.start_mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
        sizes[key], depths[key] = size, depth
        return size, depth

    walk(root)


def read_yaml(text: str, file: Path, hint: str) -> tuple[Any, yaml.Node | None]:
    """The YAML document in `text` and its node tree (for line numbers), refused in one line naming `file` and
    the line when it is too big, too deep, has duplicate keys or is not YAML; `hint` says what to do instead
    of a too-big document."""
    loader = _BoundedLoader(text, file, hint)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _check_tree(file, node, hint)
        return loader.construct_document(node), node
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else str(file)
        raise LooplineError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise LooplineError(f"{file}: nested too deeply to read (more than {MAX_YAML_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise LooplineError(f"{file}: {exc}") from None
    finally:
        loader.dispose()



def read_text(file: Path, limit: int, what: str) -> str:
    """A user's file as UTF-8 text, refused (one line) when too big or not text."""
    if not file.is_file():
        raise LooplineError(f"{file}: no such file")
    size = file.stat().st_size
    if size > limit:
        raise LooplineError(f"{file}: {size:,} bytes; {what} may be at most {limit:,} bytes")
    try:  # at most limit + 1 bytes: a file of /proc or a device says it is empty and never ends
        with file.open("rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise LooplineError(f"{file}: cannot be read ({exc.strerror or exc}); {what} must be a regular file") from None
    if len(data) > limit:
        raise LooplineError(f"{file}: more than {limit:,} bytes; {what} may be at most {limit:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LooplineError(f"{file}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if "\x00" in text:
        raise LooplineError(f"{file}:{text[: text.index(chr(0))].count(chr(10)) + 1}: contains a NUL character")
    return text


def line_index(root: yaml.Node) -> dict[tuple, int]:
    """Map each field path in a YAML document to its 1-based line (an aliased node keeps its first path)."""
    index: dict[tuple, int] = {}
    visited: set[int] = set()

    def walk(node: yaml.Node, path: tuple) -> None:
        index.setdefault(path, node.start_mark.line + 1)
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                walk(value, (*path, key.value))
                index[(*path, key.value)] = key.start_mark.line + 1  # the key's line, not its value's
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, i))

    walk(root, ())
    return index
