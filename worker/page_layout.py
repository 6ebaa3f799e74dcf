"""The bytes of one block of one rank (a host page, a storage page's payload), torch-free so the
manager sizes pools with the very function the workers lay them out with.

    offset            size                         what
    0                 kv_bytes                     K and V of every layer: layer 0 K, layer 0 V,
                                                   layer 1 K, ... (the main `num_layers`
                                                   first, then the `num_extra_layers`, e.g.
                                                   the MTP draft layers of speculative decoding)
    kv_bytes          (pad to SCALE_ALIGN)
    scale_offset      scale_bytes                  kv_scales = "per_block_head" only: float32
                                                   scales [layers, 2 (K, V), num_kv_heads],
                                                   in the same layer order
    ...               (pad to SCALE_ALIGN)         page_bytes ends here

Without scales a page is exactly `kv_bytes` (the layout of every earlier kvtier). With them the
scales are a trailer of the page, so every tier that moves pages (D2H, H2D, storage reads and
writes, the MAC over a stored page) moves and checks a block's scales with its K and V, and
nothing on the storage side needs to know they exist. The padding keeps the trailer at a
float32-aligned offset and every page a multiple of 16 bytes, so the copy engine can still
view the KV of a page as 16-byte words (its widest copy unit) with the page as the stride.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_ALIGN = 16
SCALE_ITEMSIZE = 4  # float32
KV_SCALES = ("none", "per_block_head")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class PageLayout:
    """Byte geometry of one page (see the module docstring). All fields are derived from the
    KV shape; nothing here allocates."""

    num_layers: int
    num_extra_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    itemsize: int
    kv_scales: bool

    @property
    def total_layers(self) -> int:
        """Layers whose K and V a page holds: the model's, then the extra ones."""
        return self.num_layers + self.num_extra_layers

    @property
    def k_bytes(self) -> int:
        """One block of one layer's K (V is the same size)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def kv_bytes(self) -> int:
        return 2 * self.total_layers * self.k_bytes

    @property
    def scale_offset(self) -> int:
        return _round_up(self.kv_bytes, SCALE_ALIGN) if self.kv_scales else self.kv_bytes

    @property
    def scale_bytes(self) -> int:
        """The scales of one block: float32 [layers, 2, num_kv_heads]; 0 without scales."""
        if not self.kv_scales:
            return 0
        return self.total_layers * 2 * self.num_kv_heads * SCALE_ITEMSIZE

    @property
    def page_bytes(self) -> int:
        if not self.kv_scales:
            return self.kv_bytes
        return self.scale_offset + _round_up(self.scale_bytes, SCALE_ALIGN)
