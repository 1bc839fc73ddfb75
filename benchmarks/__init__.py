"""The project's measurements (speed, quality, training), one module per benchmark, run from the
repository root as `python -m benchmarks.NAME`; `report` holds what they all write."""
