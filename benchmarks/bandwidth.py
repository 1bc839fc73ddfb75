"""The card's measured memory bandwidth: a device-to-device copy, read + write bytes over time.

    python3 -m benchmarks.bandwidth [--gib 1] [--json OUT]

Rooflines divide a step's bytes by this figure, measured in the same run as the arms they judge
(CUDA events around 20 copies of a --gib GiB buffer after 3 warm-up copies; best of 5 rounds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def copy_bandwidth(gib: float = 1.0, rounds: int = 5, copies: int = 20) -> dict:
    """{"tbps": read+write bytes per second / 1e12, "device": the card's name, "gib": gib}."""
    import torch
    n = int(gib * 2 ** 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / copies)
    return dict(tbps=round(2 * n / best / 1e12, 3), device=torch.cuda.get_device_name(), gib=gib)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = copy_bandwidth(args.gib)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
