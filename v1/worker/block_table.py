"""Per-row block ids of the persistent batch, and slot mapping from them (numpy)."""

import numpy as np


class BlockTable:
    """`table[row, i]` is the physical block holding tokens [i*B, (i+1)*B) of that row."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        self.table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: rows[i] is the token's row, positions[i] its position."""
        block_ids = self.table[rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size
