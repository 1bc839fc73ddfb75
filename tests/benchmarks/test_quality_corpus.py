"""The stdlib corpus: deterministic, disjoint held-out split; byte-tokenizer ids; context sampling."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.quality import stdlib_corpus as corpus
from wise_core.tokenizer import byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_split_is_disjoint_complete_and_about_ten_percent():
    paths = corpus.list_files()
    train, held = corpus.split_files(paths)
    assert set(train).isdisjoint(held)
    assert sorted(train + held) == paths
    assert all("site-packages" not in p.split("/") for p in paths)
    synthetic = [f"pkg{i // 50}/module_{i}.py" for i in range(5000)]
    share = len(corpus.split_files(synthetic)[1]) / len(synthetic)
    assert 0.08 < share < 0.12, share


def test_split_does_not_depend_on_the_process_hash_seed():
    paths = [f"dir{i}/file{i}.py" for i in range(300)]
    code = ("from benchmarks.quality import stdlib_corpus as c; "
            "print(','.join(c.split_files([f'dir{i}/file{i}.py' for i in range(300)])[1]))")
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                                text=True, check=True)
        outputs.add(result.stdout.strip())
    assert outputs == {",".join(corpus.split_files(paths)[1])}


def test_token_stream_matches_the_byte_tokenizer(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    texts = {"a.py": "print('héllo')\n", "pkg/b.py": "x = 1  # → arrow\n"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "site-packages" / "third_party.py").write_text("ignored = True\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    paths = corpus.list_files(tmp_path)
    assert paths == ["a.py", "pkg/b.py"]
    tok = byte_tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    expected = []
    for name in paths:
        expected += [eot] + tok.encode(texts[name]).ids
    assert np.array_equal(corpus.token_stream(paths, tmp_path), np.array(expected))
    assert np.array_equal(corpus.token_stream(paths, tmp_path, tokenizer=tok), np.array(expected))
    assert np.array_equal(corpus.token_stream(paths, tmp_path, separator=None),
                          [t for t in expected if t != eot])


def test_sample_contexts_are_seeded_and_contiguous():
    stream = np.arange(5000, dtype=np.uint16) % 258
    pairs = corpus.sample_contexts(stream, 5, 100, 200, 16, seed=3)
    assert pairs == corpus.sample_contexts(stream, 5, 100, 200, 16, seed=3)
    for context, continuation in pairs:
        assert 100 <= len(context) <= 200 and len(continuation) == 16
        window = context + continuation
        assert all((a - b) % 258 == 1 for a, b in zip(window[1:], window[:-1]))  # contiguous
    with pytest.raises(ValueError, match="shorter than a context"):
        corpus.sample_contexts(stream, 1, 100, 4990, 16)
