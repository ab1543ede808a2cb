"""What the tool-call and reasoning parsers share: parsers found by name (the
`--tool-call-parser` / `--reasoning-parser` values, the plugin seam), and holding back a
chunk's tail that may still become a tag."""

from __future__ import annotations


class ParserRegistry:
    def __init__(self, what: str):
        self.what = what  # "tool-call parser", "reasoning parser": for the error
        self.classes: dict[str, type] = {}

    def register(self, name: str):
        def wrap(cls):
            self.classes[name] = cls
            cls.name = name
            return cls

        return wrap

    def get(self, name: str) -> type:
        try:
            return self.classes[name]
        except KeyError:
            raise KeyError(f"no {self.what} {name!r}; known: {', '.join(sorted(self.classes))}") from None

    def names(self) -> list[str]:
        return sorted(self.classes)


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
