"""Where the time goes: a decode step's kernels by category, a Pallas call's kernels, trace reading."""
