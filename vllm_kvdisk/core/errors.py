"""What a reader of a ``.kv`` file raises: the two errors every caller turns into a miss.

Apart from ``format`` so that the file's structures and the page codec (``codec``), which
``format`` names, share them without importing each other. Pure: no imports.
"""

from __future__ import annotations


class FormatError(ValueError):
    """The file is corrupt, truncated, foreign or hostile."""


class UnsupportedFile(FormatError):
    """A well-formed file of a version or feature this build does not read."""
