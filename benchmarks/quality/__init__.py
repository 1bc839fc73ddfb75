"""Quality of WISE against dense decode (held-out text, question answering) and the corpus and
scoring it uses."""
