"""A request's growing token ids as text: incremental detokenization and stop strings (used by
both engines for SamplingParams.stop, `wise serve` and `wise generate --stream`).

Decoding token by token must not emit half a character (a byte-level tokenizer splits UTF-8
characters across tokens) nor text that a later token changes. `TextStream` decodes a short
window of recent tokens against the window without its newest tokens and emits the difference
only when it does not end in U+FFFD (the replacement of an incomplete character); at the end
the whole output is decoded once more, so the completed text is exactly
`tokenizer.decode(token_ids)`, the text `LLM.generate` gives. Stop strings end the text before
their first occurrence; while streaming, the last `max(len(stop)) - 1` characters are held back
until they cannot begin a stop string. With min_tokens, no stop string is looked for before that
many tokens; include_stop keeps the stop string in the text (it ends after it).

The engine alone cuts a request's text at its stop strings (`LLMEngine.add_request` gives each
request with stop strings a `TextStream`). A caller streaming the request's text as it comes
(`wise serve`, `wise generate --stream`) follows the engine's outputs with
`TextStream(tokenizer, stop, cut=False)`: it holds back as much text as the stop strings could
take, looks for none of them, and at the end takes the engine's text (`finish(text)`).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """tokenizer: has decode(ids) -> str (or None: no text, token ids only); stop: stop strings
    (min_tokens, include_stop: the module docstring); cut: look for the stop strings and cut the
    text at the first (the engine's stream); False: only hold back the text they could begin (a
    stream that follows an engine's request, whose text the engine cuts: `finish(text)`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, min_tokens: int = 0, include_stop: bool = False,
                 cut: bool = True):
        self.tokenizer, self.stop, self.cut = tokenizer, stop, cut
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""            # decoded so far, cut at a stop string
        self.sent = 0             # characters of text already handed out
        self.stopped = False      # a stop string was found
        self.stop_reason: str | None = None   # the stop string found (the earliest in the text)
        self.num_tokens = 0       # tokens consumed (up to the one completing a stop string)

    def add(self, ids: list[int]) -> None:
        """Consume newly generated token ids (ignored once a stop string was found)."""
        for token in ids:
            if self.stopped:
                return
            self.ids.append(token)
            self.num_tokens += 1
            if self.tokenizer is None:
                continue
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
            window = self.tokenizer.decode(self.ids[self.prefix_offset:])
            if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
                self._extend(window[len(prefix):])
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def finish(self, text: str | None = None) -> None:
        """The output is complete: decode it whole (the text is then exactly decode(ids), cut at a
        stop). text: the engine's final text of the request (its `RequestOutput.text`, cut at its
        stop string), which a stream of cut=False takes; the text handed out must begin it."""
        if self.tokenizer is None or self.stopped:
            return
        if text is not None:
            if self.cut:
                raise ValueError("finish(text) takes the engine's text: a stream that cuts its own takes none")
            if not text.startswith(self.text[:self.sent]):
                raise RuntimeError(f"the engine's text {text!r:.80} does not begin with the text already handed out "
                                   f"{self.text[:self.sent]!r:.80}")
            self.text = text
            return
        full = self.tokenizer.decode(self.ids)
        if not full.startswith(self.text):
            raise RuntimeError(f"incremental detokenization diverged from the full decode: {self.text!r:.80} "
                               f"is not a prefix of {full!r:.80}")
        self._extend(full[len(self.text):])

    def _extend(self, delta: str) -> None:
        if not delta:
            return
        start = max(len(self.text) - self.hold, 0)
        self.text += delta
        if not self.cut or self.num_tokens < self.min_tokens:
            return
        found = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if found:
            at, self.stop_reason = min(found, key=lambda f: f[0])
            self.text = self.text[:at + len(self.stop_reason) if self.include_stop else at]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not handed out yet that is safe to hand out (everything when final or stopped)."""
        end = len(self.text) if final or self.stopped else max(len(self.text) - self.hold, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out
