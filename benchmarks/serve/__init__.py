"""`wise serve` under load (`serve_load.py`), and the scripts that run it on an H200."""
