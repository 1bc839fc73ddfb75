"""Step buckets shared by both engines: a decode step runs at a batch bucket (its rows) and a
context bucket (the page-table width, pages per row, that its attention, block selection and
WISE supports are sized by)."""

from __future__ import annotations


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step runs at: 1, 2, 4, 8, then multiples of 16, up to max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


def batch_bucket(buckets: list[int], rows: int) -> int:
    """The smallest of `buckets` (ascending, from `decode_buckets`) holding `rows` rows; ValueError past the largest."""
    for bucket in buckets:
        if bucket >= rows:
            return bucket
    raise ValueError(f"{rows} rows are more than the largest batch bucket ({buckets[-1]})")


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
