"""The checksum of bytes sent to a rank and kept in its share: fast enough
to stay off the transfer's critical path (zlib's CRC-32 runs at about
2 GB/s a core and was most of a transfer's cost; this runs at memory speed
in numpy).

A Fletcher-style sum over little-endian 64-bit words (the last one padded
with zero bytes): ``A`` the sum of the words, ``B`` the sum of each word
weighted by its 4 KiB block's position (1, 2, ...), both mod 2**64, mixed
with the length into one 64-bit value. Any change to one word changes
``A``; blocks moved, dropped or duplicated change ``B``; a shorter or
longer stream changes the length. It detects damage (a flipped bit, a hole
where data should be, a chunk written at the wrong place), not tampering.
Fed in pieces of any length, it gives what it gives the whole.
"""

import numpy as np

BLOCK_WORDS = 512  # 4 KiB blocks
_MASK = (1 << 64) - 1
_MIX_B = 0x9E3779B97F4A7C15  # odd constants: the golden ratio's and splitmix64's
_MIX_LEN = 0xBF58476D1CE4E5B9


class Checksum:
    """Streaming: ``update`` with each piece in order, then ``value()``."""

    def __init__(self):
        self.a = 0
        self.b = 0
        self.words = 0  # words summed so far
        self.length = 0  # bytes fed so far
        self.tail = b""  # fed bytes not yet a whole word

    def update(self, data) -> "Checksum":
        data = memoryview(data).cast("B")
        self.length += len(data)
        if self.tail:
            take = min(8 - len(self.tail), len(data))
            self.tail += bytes(data[:take])
            data = data[take:]
            if len(self.tail) < 8:
                return self
            self._words(np.frombuffer(self.tail, dtype="<u8"))
            self.tail = b""
        whole = len(data) - len(data) % 8
        if whole:
            self._words(np.frombuffer(data[:whole], dtype="<u8"))
        self.tail = bytes(data[whole:])
        return self

    def value(self) -> int:
        """The checksum of everything fed (the tail padded with zeros), as an unsigned 64-bit int."""
        a, b, words = self.a, self.b, self.words
        if self.tail:
            word = int(np.frombuffer(self.tail.ljust(8, b"\0"), dtype="<u8")[0])
            a, b = (a + word) & _MASK, (b + word * (words // BLOCK_WORDS + 1)) & _MASK
        return (a + b * _MIX_B + self.length * _MIX_LEN) & _MASK

    def _words(self, w: np.ndarray) -> None:
        """Add words ``w`` [n] (uint64), the first at word ``self.words`` of the stream."""
        at = 0
        first = self.words % BLOCK_WORDS
        if first:  # finish the block begun earlier
            at = min(BLOCK_WORDS - first, len(w))
            self._block(int(w[:at].sum()), self.words // BLOCK_WORDS)
        full = (len(w) - at) // BLOCK_WORDS
        if full:
            sums = w[at:at + full * BLOCK_WORDS].reshape(full, BLOCK_WORDS).sum(axis=1)  # [full] uint64, wrapping
            block0 = (self.words + at) // BLOCK_WORDS
            weights = np.arange(block0 + 1, block0 + 1 + full, dtype=np.uint64)
            self.a = (self.a + int(sums.sum())) & _MASK
            self.b = (self.b + int((sums * weights).sum())) & _MASK
            at += full * BLOCK_WORDS
        if at < len(w):  # begin the next block
            self._block(int(w[at:].sum()), (self.words + at) // BLOCK_WORDS)
        self.words += len(w)

    def _block(self, total: int, block: int) -> None:
        self.a = (self.a + total) & _MASK
        self.b = (self.b + total * (block + 1)) & _MASK


def checksum(data) -> int:
    """The checksum of ``data`` (any bytes-like) in one call."""
    return Checksum().update(data).value()
