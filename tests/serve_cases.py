"""`wise serve` as a subprocess on localhost, for the server's tests (CPU, fp32, reference kernel),
on either backend, and the offline engine of the same settings to compare it with."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["torch", "jax"]


def offline_engine(backend: str, model, **engine_args):
    """The engine `wise serve --backend BACKEND --device cpu --attention-backend reference` builds (fp32,
    eager), in this process."""
    if backend == "torch":
        import wise_torch
        return wise_torch.LLM(model, attention_backend="reference", cuda_graphs=False, device="cpu", **engine_args)
    import wise_jax
    return wise_jax.LLM(model, attention_backend="reference", **engine_args)


class Server:
    """`python -m wise_serve --backend BACKEND ...` on a free port, its log in a file."""

    def __init__(self, tmp: Path, *args: str, cpu: bool = True, backend: str = "torch"):
        self.log_path = tmp / "server.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # The servers of a test session share one persistent XLA compilation cache (pytest's base
        # temporary directory): a jax server compiles a decode step another compiled only once.
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp.parent / "jax-compilation-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        self.log = open(self.log_path, "w")
        device = ["--device", "cpu", "--attention-backend", "reference"] if cpu else ["--device", "cuda"]
        self.proc = subprocess.Popen([sys.executable, "-m", "wise_serve", "--backend", backend, "--port", "0",
                                      *device, "--seed", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = self.log_path.read_text()
            if "listening on http://" in text:
                self.url = text.split("listening on ")[1].split()[0]
                self.host, port = self.url[len("http://"):].rsplit(":", 1)
                self.port = int(port)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{text}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()}")

    def request(self, method: str, path: str, body=None, timeout: float = 120):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, resp.getheader("Content-Type"), data

    def post(self, body, path="/v1/completions"):
        status, _, data = self.request("POST", path, body)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        status, ctype, data = self.request("GET", "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """/metrics once no request runs or waits and every page is free (or the last one)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["wise_requests_running"] == m["wise_requests_waiting"] == 0
            if idle and m["wise_kv_pages_free"] == m["wise_kv_pages_total"] or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
