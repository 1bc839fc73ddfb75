#!/usr/bin/env bash
# Wheels of the `serve` extra (aiohttp and its dependencies, ~3 MB) for the H200's Python 3.12,
# which has no network. Run from the project root on a machine with network; carry .whl-serve/
# (ignored by git) to the H200, where benchmarks/serve/serve_h200.sh installs it into /tmp/wise-serve-pkgs.
set -euo pipefail
root=.whl-serve
rm -rf "$root" && mkdir -p "$root"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$root" "aiohttp>=3.9" 2>&1 | grep -v WARNING || true
ls "$root"/aiohttp-*.whl > /dev/null
du -sh "$root"
