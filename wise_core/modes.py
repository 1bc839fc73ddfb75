"""Per-row attention modes of the decode kernels (shared by both frameworks).

Every decode-attention implementation takes `modes: int32[batch]` with these values:
DENSE attends every causal key; DISCOVER attends densely, computes block mass and writes the
row's support = select_blocks(mass, eta); DISCOVER_UNION does the same but ORs the selection
into the support already held; SPARSE attends only the blocks of the row's support.
"""

DENSE = 0
DISCOVER = 1
DISCOVER_UNION = 2
SPARSE = 3

NAMES = {DENSE: "dense", DISCOVER: "discover", DISCOVER_UNION: "discover-union", SPARSE: "sparse"}
