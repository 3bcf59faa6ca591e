"""The checksum of sent and cached bytes (mlxdist/ship/checksum.py): XXH3's
64-bit hash, the same however the bytes are cut, and changed by the damage it is for."""

import numpy as np
import pytest

import xxhash

from mlxdist.ship.checksum import Checksum, checksum

BLOCK = 4096


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 1 << 20])
def test_pieces_of_any_length_give_the_checksum_of_the_whole(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    whole = checksum(data)
    for _ in range(8):
        cuts = [0, *sorted(rng.integers(0, n + 1, 5).tolist()), n]
        running = Checksum()
        for a, b in zip(cuts, cuts[1:]):
            running.update(memoryview(data)[a:b])
        assert running.value() == whole, cuts
    assert whole == xxhash.xxh3_64_intdigest(data)  # the standard hash, not one of our own


def test_damage_changes_it():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 64 * BLOCK + 3, dtype=np.uint8).tobytes()
    whole = checksum(data)
    for at in rng.integers(0, len(data), 20).tolist():  # one flipped bit
        flipped = bytearray(data)
        flipped[at] ^= 1 << (at % 8)
        assert checksum(flipped) != whole
    hole = bytearray(data)
    hole[5 * BLOCK:6 * BLOCK] = bytes(BLOCK)  # a block never written (a sparse file's hole)
    assert checksum(hole) != whole
    swapped = data[BLOCK:2 * BLOCK] + data[:BLOCK] + data[2 * BLOCK:]  # two blocks written at each other's place
    assert checksum(swapped) != whole
    assert checksum(data + b"\0") != whole and checksum(data[:-1]) != whole  # a zero byte more, one byte less
    assert checksum(b"") != checksum(b"\0")


def test_an_unaligned_view_reads_as_its_bytes():
    data = np.random.default_rng(1).integers(0, 256, 3 * BLOCK, dtype=np.uint8)
    assert checksum(memoryview(data)[3:]) == checksum(data[3:].tobytes())



def test_two_words_swapped_in_a_block_change_it():
    """Two 8-byte words of one 4 KiB block written at each other's place (a sum of words, however weighted by
    block, misses this)."""
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, 4 * BLOCK, dtype=np.uint8).tobytes()
    whole = checksum(data)
    for first, second in [(0, 1), (3, 500), (BLOCK // 8 + 7, BLOCK // 8 + 9), (511, 510)]:
        words = bytearray(data)
        a, b = first * 8, second * 8
        words[a:a + 8], words[b:b + 8] = data[b:b + 8], data[a:a + 8]
        assert bytes(words) != data and checksum(words) != whole, (first, second)
