"""The CPU memory behind a KVCache's tensors, shared between rows by virtual memory (vAttention's idea, instead of a
paged attention kernel): a sequence that starts from a kept prefix maps its row's pages for the prefix onto the kept
row's, so 32 conversations on one system prompt hold that prompt's K/V once, and attention still reads every row in
place as one tensor. Linux only (memfd, mmap with MAP_FIXED); shared.models.kv_cache owns the rows."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import weakref

import torch

from shared.errors import DoesNotFit

log = logging.getLogger("stagemesh.kv")


class SharedPages:
    """The CPU memory behind a KVCache's tensors, and the kept prefixes' pages that other rows map.

    Every tensor [rows, kv_heads, max_seq_len, head_dim] is a private anonymous mapping: its pages are committed as
    they are written, unwritten ones read as the one zero page, and a freed row's are given back (MADV_DONTNEED). A
    kept prefix's row is *published*: mapped onto its own range of one memfd (MAP_SHARED), so that other rows can map
    the same pages. A row's run of one head, [max_seq_len, head_dim], spans `run_bytes`; where that is a whole number
    of pages and a page a whole number of positions, `lend` maps the whole pages at the start of a row's runs onto
    the pages that hold another row's K/V there (MAP_PRIVATE | MAP_FIXED: reads see the owner's pages; a stray write
    would copy a page instead of changing the owner's). Published rows are kept prefixes, whose K/V never changes:
    before their pages are freed, every row that maps them gets a copy of its own (give_back).

    Invariants: `borrowed[row]` = [(end_page, owner), ...] ascending from page 0 -- pages [previous end, end) of each
    of the row's runs are the owner's own pages (published, and not borrowed by the owner); a row's other pages are
    its own: memfd pages if it is in `published`, anonymous otherwise. `lent[owner]` = the rows that map its pages.
    (Not the memfd everywhere: a shared mapping commits a page when it is read, and batched decode reads past what
    a row wrote -- the masked positions of a shorter sequence.)"""

    MAP_FIXED = 0x10  # <sys/mman.h> on Linux (the mmap module does not export it)
    # <asm-generic/mman.h> (x86-64, arm64; Python's mmap exports it from 3.12): no swap is reserved for the mapping. A
    # cache's address space is every row at the whole context -- 97 rows of a 3B model at 74,752 positions are 30 GB a
    # tensor -- and only the pages written are memory (the budget bounds those, live_bytes), but the kernel's default
    # heuristic overcommit refuses one reserved mapping larger than RAM + swap (ENOMEM at start)
    MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, budget: MapBudget):
        page = mmap.PAGESIZE
        self.sizes = [-(-math.prod(shape) * dtype.itemsize // page) * page for shape in shapes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(shapes))]
        self.fd = os.memfd_create("stagemesh-kv", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)  # its pages go when the last mapping of them does
        os.ftruncate(self.fd, max(page, sum(self.sizes)))
        try:
            self.maps = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | self.MAP_NORESERVE)
                         for size in self.sizes]
        except OSError as e:  # strict overcommit (vm.overcommit_memory=2) counts every mapped byte
            raise DoesNotFit(f"the K/V cache's address space ({len(shapes)} tensors of {shapes[0]}: "
                             f"{sum(self.sizes) / 2**30:.1f} GiB, of which only the positions written take memory) "
                             f"could not be mapped: {e.strerror} (vm.overcommit_memory={_overcommit()}); lower "
                             "--max-seq-len, --kv-slots or --prefix-slots") from e
        for buf in self.maps:
            if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages even where transparent huge pages are "always": a
                buf.madvise(mmap.MADV_NOHUGEPAGE)  # 2 MiB page would commit a slot's neighbours' rows with its own
        self.tensors = [torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
                        for buf, shape in zip(self.maps, shapes)]
        self.addresses = [t.data_ptr() for t in self.tensors]
        rows, heads, positions, head_dim = shapes[0]
        self.heads = heads
        self.run_bytes = positions * head_dim * dtype.itemsize  # one row's run of one head
        self.row_bytes = heads * self.run_bytes  # one row of one tensor
        position = head_dim * dtype.itemsize
        self.page_positions = page // position if page % position == 0 else 0
        self.shareable = self.page_positions > 0 and self.run_bytes % page == 0 and sys.platform == "linux"
        self.borrowed: dict[int, list[tuple[int, int]]] = {}
        self.lent: dict[int, set[int]] = {}
        self.published: set[int] = set()
        # each mapped piece of a run is a mapping (a VMA) of its own: stay inside the process's share of the kernel's
        # vm.max_map_count (MapBudget, shared by every cache of the process) and this cache's own map_budget
        self.budget, self.map_budget = budget, budget.limit
        self._used = [0]  # maps_used, in a cell the finalizer below reads: the process gets a cache's share back
        weakref.finalize(self, _give_back_maps, budget, self._used)  # when the cache (and its mappings) goes

    @property
    def maps_used(self) -> int:
        """The mappings this cache's borrowing rows add."""
        return self._used[0]

    def _room(self, n: int) -> bool:
        return self.maps_used + n <= self.map_budget and self.budget.room(n)

    def _count_maps(self, n: int) -> None:
        """n mappings more (or fewer, n < 0), in this cache's count and the process's."""
        self._used[0] += n
        self.budget.used += n

    # ---- mappings ---------------------------------------------------------------------------------------------------

    def _run(self, tensor: int, row: int, head: int) -> tuple[int, int]:
        """(address, memfd offset) of a row's run of one head in tensor `tensor`."""
        at = row * self.row_bytes + head * self.run_bytes
        return self.addresses[tensor] + at, self.offsets[tensor] + at

    def _map(self, address: int, length: int, offset: int | None, private: bool = True) -> None:
        """Map [address, address + length) onto the memfd at `offset` (None: fresh anonymous memory)."""
        if length <= 0:
            return
        if offset is None:
            flags, fd, offset = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | self.MAP_NORESERVE, -1, 0
        else:
            flags, fd = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED), self.fd  # no MAP_POPULATE: it would
            # populate a private writable mapping by write faults, copying every page
        got = _libc_mmap()(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | self.MAP_FIXED, fd, offset)
        if got != address:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of K/V pages failed: {os.strerror(err)}")

    def _map_own(self, row: int, first_page: int = 0, end_page: int | None = None) -> None:
        """Pages [first_page, end_page) of each of the row's runs (None: to the run's end) become its own: its memfd
        range if published, else fresh anonymous memory."""
        own = row in self.published
        end = self.run_bytes if end_page is None else end_page * mmap.PAGESIZE
        for t in range(len(self.tensors)):
            if first_page == 0 and end == self.run_bytes:  # the row's runs are contiguous: one mapping for them all
                address, offset = self._run(t, row, 0)
                self._map(address, self.row_bytes, offset if own else None, private=False)
                continue
            for h in range(self.heads):
                address, offset = self._run(t, row, h)
                skip = first_page * mmap.PAGESIZE
                self._map(address + skip, end - skip, offset + skip if own else None, private=False)

    def _mappings(self, segments: list[tuple[int, int]]) -> int:
        """The mappings (VMAs) a row borrowing `segments` takes beyond one per tensor: each run's borrowed pieces and
        its own rest."""
        return len(self.tensors) * self.heads * (len(segments) + 1) if segments else 0

    # ---- what rows share --------------------------------------------------------------------------------------------

    def shared_positions(self, row: int) -> int:
        """Positions [0, n) of the row whose K/V is another row's pages."""
        segments = self.borrowed.get(row)
        return segments[-1][0] * self.page_positions if segments else 0

    def publish(self, row: int) -> bool:
        """Put the row's own pages on its memfd range (their contents are lost: the caller writes them after), so that
        other rows can map them. False when there is no room for the mappings (the row stays anonymous)."""
        if not self.shareable:
            return False
        first = self.shared_positions(row) // self.page_positions
        if first and not self._room(len(self.tensors) * self.heads):
            return False
        self.published.add(row)
        try:
            self._map_own(row, first)
        except OSError as e:
            log.warning("kept prefix's K/V not shared: %s", e)
            self.published.discard(row)
            self._map_own(row, first)
            return False
        return True

    def lend(self, dst: int, src: int, length: int, own: bool = True) -> int:
        """Map the whole pages of positions [0, length) of row dst's runs onto the pages that hold src's K/V there:
        the pages src borrows, and (own) src's own, where src is published. dst holds no borrowed pages. Returns how
        many positions dst now shares (0: nothing to share, or no room for more mappings); the caller copies the
        rest."""
        if not self.shareable:
            return 0
        pages = length // self.page_positions
        if not (own and src in self.published):
            pages = min(pages, self.shared_positions(src) // self.page_positions)
        if pages == 0 or dst in self.borrowed:
            return 0
        segments, start = [], 0
        for end, owner in self.borrowed.get(src, []):  # src's borrowed pages resolve to their owners
            if start < pages:
                segments.append((min(end, pages), owner))
                start = segments[-1][0]
        if start < pages:
            segments.append((pages, src))
        if not self._room(self._mappings(segments)):
            return 0
        self.borrowed[dst] = segments
        self._count_maps(self._mappings(segments))
        for _, owner in segments:
            self.lent.setdefault(owner, set()).add(dst)
        try:
            for t in range(len(self.tensors)):
                for h in range(self.heads):
                    address, start = self._run(t, dst, h)[0], 0
                    for end, owner in segments:
                        self._map(address + start * mmap.PAGESIZE, (end - start) * mmap.PAGESIZE,
                                  self._run(t, owner, h)[1] + start * mmap.PAGESIZE)
                        start = end
        except OSError as e:
            log.warning("K/V pages not shared, copied instead: %s", e)
            self.unborrow(dst)
            return 0
        return pages * self.page_positions

    def unborrow(self, row: int) -> None:
        """The row's borrowed pages become its own again (their contents are lost: give_back copies them)."""
        segments = self.borrowed.get(row)
        if not segments:
            return
        self._count_maps(-self._mappings(segments))
        del self.borrowed[row]
        for _, owner in segments:
            self.lent[owner].discard(row)
            if not self.lent[owner]:
                del self.lent[owner]
        self._map_own(row, 0, segments[-1][0])

    def give_back(self, owner: int) -> None:
        """Before the owner's pages change or are freed: every row that maps them gets its own copy of the K/V it
        read from them (of all its borrowed pages: a row borrows from page 0 or not at all)."""
        for row in sorted(self.lent.get(owner, ())):
            segments = list(self.borrowed[row])
            saved = [t[row, :, :segments[-1][0] * self.page_positions].clone() for t in self.tensors]
            self.unborrow(row)
            for t, data in zip(self.tensors, saved):
                t[row, :, :data.shape[1]].copy_(data)

    def forget(self, row: int) -> None:
        """The row is free: rows that map its pages get copies first, then its pages go back to the OS (the row
        reads as zeros again) and it is anonymous memory again."""
        self.give_back(row)
        self.unborrow(row)
        if row in self.published:
            for buf in self.maps:  # frees its memfd pages (a shared mapping's backing store)
                buf.madvise(mmap.MADV_REMOVE, row * self.row_bytes, self.row_bytes)
            self.published.discard(row)
            self._map_own(row)
            return
        start = -(-row * self.row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the row only
        end = (row + 1) * self.row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            for buf in self.maps:
                buf.madvise(mmap.MADV_DONTNEED, start, end - start)


def _give_back_maps(budget: MapBudget, used: list[int]) -> None:
    """A SharedPages went, and its mappings with it: the process's budget gets its count back."""
    budget.used -= used[0]
    used[0] = 0


def _overcommit() -> str:
    """The kernel's overcommit mode (vm.overcommit_memory), for an error message."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


@functools.cache
def _libc_mmap():
    """libc's mmap(2), which can map at a given address (MAP_FIXED); Python's mmap module cannot."""
    mmap_ = ctypes.CDLL(None, use_errno=True).mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return mmap_


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


def _mappings_in_use() -> int:
    """The mappings (VMAs) this process holds now: one line each in /proc/self/maps."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


class MapBudget:
    """The mappings every SharedPages of this process may add together, against the kernel's vm.max_map_count: what
    the process did not map already when the first was made, less a reserve of a quarter of the limit for all else
    (malloc's large blocks, thread stacks, torch's buffers); never less than a quarter of the limit. One borrowing row
    of a 1-stage SmolLM2 takes 360 (60 tensors x 3 heads x 2 pieces): the kernel's default of 65530 leaves room for
    ~130 such rows, more than its 96 (a quarter of the limit would share ~45 and copy the rest)."""

    def __init__(self, limit: int, in_use: int):
        self.limit = max(limit // 4, limit - in_use - limit // 4)
        self.used = 0

    def room(self, n: int) -> bool:
        return self.used + n <= self.limit


_process_maps: MapBudget | None = None


def process_map_budget() -> MapBudget:
    """This process's MapBudget, sized when the first KV cache maps its tensors."""
    global _process_maps
    if _process_maps is None:
        _process_maps = MapBudget(max_map_count(), _mappings_in_use())
    return _process_maps
