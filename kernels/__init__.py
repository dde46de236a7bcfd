"""x"""

from .dsa import dsa_attention, dsa_triton
from .dsa_reference import (
    DSAGeometry,
    dsa_attention_reference,
    dsa_dense_oracle,
    dsa_geometry,
    invert_windows,
    window_tiles,
)

__all__ = [
    "DSAGeometry",
    "dsa_attention",
    "dsa_attention_reference",
    "dsa_dense_oracle",
    "dsa_geometry",
    "dsa_triton",
    "invert_windows",
    "window_tiles",
]
