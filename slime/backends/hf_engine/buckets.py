"""How the paged engine groups a step's decoding rows into attention buckets (no torch here: the rollout
simulator replays the same rule).

Rows sorted by context (in KV blocks), longest first; a bucket pads its rows to its longest, and a new bucket starts
where a row needs at most BUCKET_SHRINK of the longest and padding would waste at least `min_saving` key positions
(a bucket costs ~10 small ops per layer, worth ~1-4k key positions of attention).
"""

from __future__ import annotations

# decode steps replayed from CUDA graphs (decode_graphs.py) are padded instead: rows to the next power of two, key
# blocks per row too, in one bucket (few shapes: a colocated engine captures them again after every release)
GRAPH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

BUCKET_SHRINK = 0.7
BUCKET_MIN_SAVING = 2048
# On a GPU a bucket's ~10 ops per layer cost ~0.5 ms of launches for a small model, while a key position not gathered
# saves ~0.1 us of memory traffic: a bucket pays only past ~16k positions (--bucket-min-saving overrides either).
BUCKET_MIN_SAVING_GPU = 16384


def decode_bucket_ranges(blocks_desc: list[int], block_size: int, min_saving: int = BUCKET_MIN_SAVING) -> list[tuple[int, int]]:
    """[start, end) index ranges of the buckets over `blocks_desc` (each row's blocks, longest first)."""
    out: list[tuple[int, int]] = []
    n, i = len(blocks_desc), 0
    while i < n:
        m, j = blocks_desc[i], i + 1
        while j < n and not (blocks_desc[j] <= m * BUCKET_SHRINK
                             and (n - j) * (m - blocks_desc[j]) * block_size >= min_saving):
            j += 1
        out.append((i, j))
        i = j
    return out


def decode_shape(positions: list[int], block_size: int, min_saving: int = BUCKET_MIN_SAVING) -> tuple[int, int]:
    """(key positions gathered, buckets) of a decode step whose rows feed their tokens at `positions`."""
    blocks = sorted((p // block_size + 1 for p in positions), reverse=True)
    ranges = decode_bucket_ranges(blocks, block_size, min_saving)
    return sum((j - i) * blocks[i] for i, j in ranges) * block_size, len(ranges)


def graph_rows(rows: int, max_rows: int) -> int | None:
    """The padded row count of a graph decode step of `rows` rows (None beyond `max_rows`: the step runs eagerly)."""
    if rows > max_rows:
        return None
    return next((b for b in GRAPH_ROW_BUCKETS if rows <= b <= max_rows), max_rows)


def graph_blocks(blocks: int) -> int:
    """Key blocks per row of a graph decode step: the longest row's, padded to the next power of two."""
    return 1 << max(0, blocks - 1).bit_length()
