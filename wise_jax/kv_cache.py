"""Paged KV cache as a pytree, with page allocation that runs under jit.

Storage `k, v: [planes, num_pages + 1, page_size, kv_heads, head_dim]`, plane = loop * layers +
layer. One page table serves every plane: page p of row b is storage index `page_table[b, p]`
in each plane. Free pages live on a stack (`free_pages[:num_free]`, top at `num_free - 1`).
The last storage page (`scratch_page`) belongs to no request: page-table entries of empty rows
and past a row's pages point at it, and writes of rows that must not write (empty rows, a
reservation that did not fit) go there, so no padding ever reads or writes a request's page.

Allocation (`reserve`) and release are pure functions. Outside jit a request the pool cannot hold
raises PoolExhaustedError. Inside jit nothing can raise: `try_reserve` grants all of a
reservation or none of it and returns whether it fitted; `overflowed` is set when one did not.

An fp8 cache (`create(..., kv_cache_dtype="fp8")`, issue 50) holds k, v as uint8 float8 e4m3fn
codes and `k_scale`, `v_scale` float32 [planes, num_pages + 1, page_size, kv_heads], one scale
per (token, KV head), by `wise_core.kv_quant`'s rule (`wise_jax.kv_quant`); an unquantized cache
has scales None (no pytree leaves). Every write of K/V values quantizes them (`store`:
`write_token`, `insert`, prefill's writes); a write of entries read from the cache (`read_token`,
`read_pages`) stores them as they are, so copying K/V (early exit's later planes, preemption's
offload and restore) never quantizes twice. Every attention reads the dequantized values
(`plane_keys`; the decode reference dequantizes the pages it gathers, `wise_jax.attention`), in
the model's dtype; `stored_values` is what the cache gives back for K/V once written. Entries,
what `load` returns and `store` takes: K or V itself for an unquantized cache, its (codes,
scales) pair for an fp8 one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wise_core import kv_quant as quant_spec
from wise_core.model_config import ModelConfig
from wise_jax import checks
from wise_jax import kv_quant


class PoolExhaustedError(RuntimeError):
    """The page pool cannot hold a request."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "page_table", "seq_lens", "free_pages", "num_free", "overflowed",
                                "k_scale", "v_scale"],
                   meta_fields=[])
@dataclasses.dataclass
class PagedKVCache:
    """k, v: [planes, num_pages + 1, page_size, kv_heads, head_dim] (the last page is scratch),
    the model's dtype, or uint8 e4m3fn codes in an fp8 cache; page_table int32[batch, max_pages];
    seq_lens int32[batch]; free_pages int32[num_pages] (a stack of num_free int32[] entries);
    overflowed bool[] (a reservation inside jit did not fit); k_scale, v_scale: an fp8 cache's
    float32 [planes, num_pages + 1, page_size, kv_heads], else None."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    seq_lens: jax.Array
    free_pages: jax.Array
    num_free: jax.Array
    overflowed: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        """Whether the K/V are fp8 codes with scales (kv_cache_dtype "fp8")."""
        return self.k_scale is not None

    @property
    def kv_cache_dtype(self) -> str:
        """"fp8" for a quantized cache, "auto" (the model's dtype) otherwise."""
        return "fp8" if self.quantized else "auto"

    @property
    def num_pages(self) -> int:
        """Pages requests can hold (the scratch page not counted)."""
        return self.k.shape[1] - 1

    @property
    def scratch_page(self) -> int:
        return self.k.shape[1] - 1

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def capacity(self) -> int:
        """Most keys a row can hold."""
        return self.max_pages * self.page_size


def page_bytes(config: ModelConfig, page_size: int, dtype, planes: int | None = None,
               kv_cache_dtype: str = "auto") -> int:
    """Bytes one page takes in every plane, K and V (planes, kv_cache_dtype: as `create`'s): per
    (token, KV head) head_dim values of `dtype`, or for "fp8" head_dim bytes of codes and a
    4-byte scale (`wise_core.kv_quant.entry_bytes`)."""
    planes = config.total_ut_steps * config.num_hidden_layers if planes is None else planes
    return 2 * planes * page_size * config.num_key_value_heads * quant_spec.entry_bytes(
        config.head_dim, jnp.dtype(dtype).itemsize, kv_cache_dtype)


def create(config: ModelConfig, *, batch: int, max_pages: int, num_pages: int, page_size: int,
           dtype=jnp.float32, planes: int | None = None, kv_cache_dtype: str = "auto") -> PagedKVCache:
    """An empty cache: zeroed storage (so unused pages hold finite values), every page free,
    every page-table entry on the scratch page. planes: None for Ouro's loops * layers (a Huginn
    cache passes `wise_core.huginn_reference.num_planes`). dtype: the model's (the K/V it writes
    and its attention reads); kv_cache_dtype: "auto" holds them in dtype, "fp8" as uint8 codes
    (zero: +0.0) with float32 scales (one: what quantize gives a zero vector), so an empty fp8
    page is the quantization of zeros (module docstring). The arguments are checked
    (`checks.cache_settings`)."""
    checks.cache_settings(config, batch=batch, max_pages=max_pages, num_pages=num_pages, page_size=page_size,
                          dtype=dtype, planes=planes, kv_cache_dtype=kv_cache_dtype)
    planes = config.total_ut_steps * config.num_hidden_layers if planes is None else planes
    shape = (planes, num_pages + 1, page_size, config.num_key_value_heads, config.head_dim)
    fp8 = kv_cache_dtype == "fp8"
    storage = jnp.uint8 if fp8 else dtype
    return PagedKVCache(
        k=jnp.zeros(shape, storage), v=jnp.zeros(shape, storage),
        page_table=jnp.full((batch, max_pages), num_pages, jnp.int32),
        seq_lens=jnp.zeros((batch,), jnp.int32),
        free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),  # page 0 on top
        num_free=jnp.asarray(num_pages, jnp.int32),
        overflowed=jnp.asarray(False),
        k_scale=jnp.ones(shape[:-1], jnp.float32) if fp8 else None,
        v_scale=jnp.ones(shape[:-1], jnp.float32) if fp8 else None)


STORAGE = ("k", "v", "k_scale", "v_scale")


def storage_names(cache: PagedKVCache) -> tuple[str, ...]:
    """The fields holding the cache's K/V: ("k", "v"), and the scales of an fp8 cache."""
    return STORAGE if cache.quantized else STORAGE[:2]


def encode(cache: PagedKVCache, k: jax.Array, v: jax.Array) -> tuple:
    """K/V values [..., kv_heads, head_dim] -> the entries the cache stores for them: k, v in its
    dtype, or for an fp8 cache their (codes, scales) pairs (`wise_jax.kv_quant.quantize`)."""
    if not cache.quantized:
        return k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    return kv_quant.quantize(k), kv_quant.quantize(v)


def values(entry, dtype) -> jax.Array:
    """An entry of K or V (an array, or an fp8 cache's (codes, scales) pair) -> its values: the
    array as it is, the pair dequantized to `dtype`."""
    if isinstance(entry, tuple):
        return kv_quant.dequantize(*entry, dtype)
    return entry


def stored_values(cache: PagedKVCache, x: jax.Array) -> jax.Array:
    """What the cache gives back for K or V values x [..., kv_heads, head_dim] once written, in
    x's dtype: x itself, or for an fp8 cache dequantize(quantize(x)) (for an attention that
    reads the keys just computed rather than the pages)."""
    if not cache.quantized:
        return x
    return kv_quant.dequantize(*kv_quant.quantize(x), x.dtype)


def store(cache: PagedKVCache, index: tuple, k, v) -> PagedKVCache:
    """The cache with K/V set at `index` (indices into the storage's leading axes [planes, pages,
    page_size], as `.at[index]` takes them). k, v: values (quantized here for an fp8 cache,
    `encode`) or entries of an fp8 cache ((codes, scales) pairs, `load`'s: stored as they are)."""
    if not (cache.quantized and isinstance(k, tuple)):
        k, v = encode(cache, k, v)
    if not cache.quantized:
        return dataclasses.replace(cache, k=cache.k.at[index].set(k), v=cache.v.at[index].set(v))
    (k_codes, k_scale), (v_codes, v_scale) = k, v
    return dataclasses.replace(cache, k=cache.k.at[index].set(k_codes), v=cache.v.at[index].set(v_codes),
                               k_scale=cache.k_scale.at[index].set(k_scale),
                               v_scale=cache.v_scale.at[index].set(v_scale))


def load(cache: PagedKVCache, index: tuple) -> tuple:
    """The K/V entries at `index` (as `store`'s): (k, v), or for an fp8 cache ((k codes, k
    scales), (v codes, v scales))."""
    if not cache.quantized:
        return cache.k[index], cache.v[index]
    return (cache.k[index], cache.k_scale[index]), (cache.v[index], cache.v_scale[index])


def read_pages(cache: PagedKVCache, pages: jax.Array) -> tuple:
    """The storage of `pages` int32[n] in every plane, a tuple in `storage_names` order: k, v
    [planes, n, page_size, kv_heads, head_dim] (and an fp8 cache's scales [planes, n, page_size,
    kv_heads]), bitwise what the cache holds (preemption's offload)."""
    return tuple(getattr(cache, name)[:, pages] for name in storage_names(cache))


def write_pages(cache: PagedKVCache, pages: jax.Array, stored: tuple) -> PagedKVCache:
    """`read_pages`' tuple written back into storage `pages` int32[n] as it is (a restore)."""
    names = storage_names(cache)
    if len(stored) != len(names):
        raise ValueError(f"the pages hold {len(stored)} arrays; this {cache.kv_cache_dtype} cache stores {names}")
    return dataclasses.replace(cache, **{name: getattr(cache, name).at[:, pages].set(x)
                                         for name, x in zip(names, stored)})


def plane_keys(cache: PagedKVCache, plane: jax.Array, tables: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The K/V values of `plane` over each row's pages, tables int32[rows, width] -> k, v [rows,
    width * page_size, kv_heads, head_dim] (an fp8 cache's dequantized to `dtype`; an unquantized
    cache's as stored)."""
    k, v = load(cache, (plane, tables))
    k, v = values(k, dtype), values(v, dtype)
    rows, width = tables.shape
    shape = (rows, width * cache.page_size) + k.shape[3:]
    return k.reshape(shape), v.reshape(shape)


def _concrete(x) -> np.ndarray | None:
    """x as numpy when it is a concrete value, None under tracing."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def pages_for(lengths: jax.Array, page_size: int) -> jax.Array:
    """Pages needed to hold `lengths` keys."""
    return (lengths + page_size - 1) // page_size


def try_reserve(cache: PagedKVCache, lengths: jax.Array, width: int | None = None) -> tuple[PagedKVCache, jax.Array]:
    """Grow rows to `lengths: int32[batch]` keys (never shrinks): pages are taken from the free
    stack for the page-boundary crossings, and seq_lens becomes max(seq_lens, lengths). All or
    nothing: returns (cache, fits bool[]); when it does not fit nothing changes but `overflowed`.
    width: a row may hold at most this many pages (a decode step's context bucket; None: max_pages)."""
    lengths = jnp.maximum(jnp.asarray(lengths, jnp.int32), cache.seq_lens)
    old = pages_for(cache.seq_lens, cache.page_size)
    new = pages_for(lengths, cache.page_size)
    page = jnp.arange(cache.max_pages, dtype=jnp.int32)
    need = (page >= old[:, None]) & (page < new[:, None])            # [batch, max_pages]
    total = need.sum(dtype=jnp.int32)
    fits = (total <= cache.num_free) & jnp.all(new <= (cache.max_pages if width is None else width))
    rank = jnp.cumsum(need.reshape(-1), dtype=jnp.int32).reshape(need.shape) - 1
    taken = cache.free_pages[jnp.clip(cache.num_free - 1 - rank, 0, cache.num_pages - 1)]
    grant = need & fits
    cache = dataclasses.replace(
        cache,
        page_table=jnp.where(grant, taken, cache.page_table),
        seq_lens=jnp.where(fits, lengths, cache.seq_lens),
        num_free=jnp.where(fits, cache.num_free - total, cache.num_free),
        overflowed=cache.overflowed | ~fits)
    return cache, fits


def grow_rows(cache: PagedKVCache, rows: jax.Array, width: int | None = None, allocate: bool = True
              ) -> tuple[PagedKVCache, jax.Array]:
    """Grow each row in `rows: bool[batch]` by one key -> (cache, the rows grown: bool[batch]).
    allocate: a row crossing a page boundary takes its page from the free stack (`try_reserve`:
    all or nothing, no row grows when they do not fit); False: the page table already holds it
    (a host allocator's), every row in `rows` grows."""
    lengths = jnp.where(rows, cache.seq_lens + 1, cache.seq_lens)
    if not allocate:
        return dataclasses.replace(cache, seq_lens=lengths), rows
    cache, fits = try_reserve(cache, lengths, width)
    return cache, rows & fits


def reserve(cache: PagedKVCache, lengths: jax.Array) -> PagedKVCache:
    """`try_reserve`, raising PoolExhaustedError when the values are concrete and do not fit."""
    lengths = jnp.maximum(jnp.asarray(lengths, jnp.int32), cache.seq_lens)
    known = [_concrete(x) for x in (lengths, cache.seq_lens, cache.num_free)]
    if all(x is not None for x in known):
        lengths_np, seq_lens, num_free = known
        too_long = np.flatnonzero(lengths_np > cache.capacity)
        if too_long.size:
            raise PoolExhaustedError(
                f"rows {too_long.tolist()} need {lengths_np[too_long].tolist()} keys, more than the "
                f"{cache.capacity} a row can hold ({cache.max_pages} pages of {cache.page_size})")
        total = int((pages_for(lengths_np, cache.page_size) - pages_for(seq_lens, cache.page_size)).sum())
        if total > num_free:
            raise PoolExhaustedError(f"the request needs {total} pages but only {int(num_free)} "
                                     f"of {cache.num_pages} are free")
    return try_reserve(cache, lengths)[0]


def release(cache: PagedKVCache, rows: jax.Array) -> PagedKVCache:
    """Return the pages of `rows: bool[batch]` to the free stack and empty those rows (their
    page-table entries back on the scratch page)."""
    rows = jnp.asarray(rows, bool)
    page = jnp.arange(cache.max_pages, dtype=jnp.int32)
    held = rows[:, None] & (page < pages_for(cache.seq_lens, cache.page_size)[:, None])
    flat = held.reshape(-1)
    rank = jnp.cumsum(flat, dtype=jnp.int32) - 1
    slot = jnp.where(flat, cache.num_free + rank, cache.num_pages)  # out of range: dropped
    return dataclasses.replace(
        cache,
        free_pages=cache.free_pages.at[slot].set(cache.page_table.reshape(-1), mode="drop"),
        num_free=cache.num_free + flat.sum(dtype=jnp.int32),
        seq_lens=jnp.where(rows, 0, cache.seq_lens),
        page_table=jnp.where(rows[:, None], cache.scratch_page, cache.page_table))


def plane_pages(cache: PagedKVCache, plane: jax.Array, width: int | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One plane as decode_attention reads it, without slicing the storage: every plane's pages
    viewed as one pool [planes * (num_pages + 1), page_size, kv_heads, head_dim] (a free reshape),
    and the first `width` columns of the page table (None: all), shifted to the plane:
    (k_pages, v_pages, page_table int32[batch, width])."""
    flat = (-1,) + cache.k.shape[2:]
    return (cache.k.reshape(flat), cache.v.reshape(flat),
            cache.page_table[:, :width] + plane * cache.k.shape[1])


def plane_scales(cache: PagedKVCache) -> tuple[jax.Array | None, jax.Array | None]:
    """An fp8 cache's scales as `plane_pages` views the codes: k_scale, v_scale float32 [planes *
    (num_pages + 1), page_size, kv_heads] (decode attention's k_scale, v_scale, read through
    plane_pages' shifted page table); (None, None) for an unquantized cache."""
    if not cache.quantized:
        return None, None
    flat = (-1,) + cache.k_scale.shape[2:]
    return cache.k_scale.reshape(flat), cache.v_scale.reshape(flat)


def token_slot(cache: PagedKVCache, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page, offset) int32[batch] of every row's newest position (seq_lens - 1): its page for
    rows in `rows: bool[batch]`, the scratch page for the others."""
    position = jnp.maximum(cache.seq_lens - 1, 0)
    page = jnp.take_along_axis(cache.page_table, (position // cache.page_size)[:, None], axis=1)[:, 0]
    return jnp.where(rows, page, cache.scratch_page), position % cache.page_size


def write_token(cache: PagedKVCache, plane: jax.Array, k, v, rows: jax.Array) -> PagedKVCache:
    """Store the newest key/value (position seq_lens - 1) of every row in `rows: bool[batch]` in
    `plane`; other rows write to the scratch page. k, v: [batch, kv_heads, head_dim] values
    (quantized for an fp8 cache), or entries (`read_token`'s, `encode`'s: stored as they are)."""
    page, offset = token_slot(cache, rows)
    return store(cache, (plane, page, offset), k, v)


def read_token(cache: PagedKVCache, plane: jax.Array, rows: jax.Array) -> tuple:
    """The key/value entries `write_token` stored for every row in `plane`: k, v [batch, kv_heads,
    head_dim] (the scratch page's for rows not in `rows`); for an fp8 cache each a (codes uint8
    [batch, kv_heads, head_dim], scales float32 [batch, kv_heads]) pair (`load`)."""
    page, offset = token_slot(cache, rows)
    return load(cache, (plane, page, offset))


def insert(cache: PagedKVCache, k: jax.Array, v: jax.Array, length: jax.Array, slot: jax.Array) -> PagedKVCache:
    """Store one request's K/V of every plane in the empty row `slot`, reserving its pages.

    k, v: [planes, n * page_size, kv_heads, head_dim], valid up to `length` (int32[], with
    pages_for(length) == n); the pages are written whole (quantized for an fp8 cache). When the
    pages do not fit the pool, nothing is written and `overflowed` is set. The K/V are checked
    against the cache (`checks.request_kv`: planes, heads, head_dim, dtype, whole pages)."""
    checks.request_kv(cache, k, v, length)
    planes, span, kv_heads, dim = k.shape
    n = span // cache.page_size
    cache, fits = try_reserve(cache, cache.seq_lens.at[slot].set(length))
    pages = jax.lax.dynamic_index_in_dim(cache.page_table, slot, 0, keepdims=False)[:n]
    pages = jnp.where(fits, pages, cache.scratch_page)
    shape = (planes, n, cache.page_size, kv_heads, dim)
    return store(cache, (slice(None), pages), k.reshape(shape), v.reshape(shape))
