"""Step buckets shared by both engines: a decode step runs at a context bucket, the page-table
width (pages per row) its attention, block selection and WISE supports are sized by."""

from __future__ import annotations


def context_buckets(max_pages: int) -> list[int]:
    """Page-table widths a decode step runs at: the powers of two below max_pages, then max_pages."""
    if not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages < 1:
        raise ValueError(f"max_pages must be a positive integer, got {max_pages!r}")
    return [1 << i for i in range((max_pages - 1).bit_length())] + [max_pages]


def context_bucket(widths: list[int], pages: int) -> int:
    """The narrowest of `widths` (ascending) holding `pages` pages; ValueError past the widest."""
    for width in widths:
        if width >= pages:
            return width
    raise ValueError(f"a row of {pages} pages is wider than the widest context bucket ({widths[-1]})")
