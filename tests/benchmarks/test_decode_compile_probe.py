"""benchmarks/engine/decode_compile_probe.py on CPU: the scanned decode step compiles and steps on a
tiny model (the unrolled variant is the engine's `model.decode_step`, which the engine tests run);
an unknown variant is refused."""

from __future__ import annotations

import pytest

from benchmarks.engine import decode_compile_probe as probe


def test_the_loop_scan_variant_compiles_and_steps():
    (result,) = probe.main(["--preset", "test-tiny", "--dtype", "float32", "--shapes", "32x1", "--variants", "loopscan"])
    assert "error" not in result and result["compile_s"] > 0 and result["step_ms_median"] > 0
    assert result["checksum"] > 0


def test_an_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        probe.main(["--preset", "test-tiny", "--variants", "loopscan,fused"])
