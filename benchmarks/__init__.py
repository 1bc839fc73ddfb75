"""The project's measurements, grouped by question: `kernels`, `engine`, `serve`, `quality`,
`train`, `profile`; one module per benchmark, run from the repository root as `python -m
benchmarks.GROUP.NAME`. `report` holds what they all write."""
