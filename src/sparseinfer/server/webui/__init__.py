"""The chat page served at ``/`` (one static HTML/JS file, no build step)."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def index_html() -> str:
    """The page's HTML, read once from the package data."""
    return resources.files(__name__).joinpath("index.html").read_text(encoding="utf-8")
