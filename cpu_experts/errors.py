"""The CPU expert workers' errors and status codes, importable without Numba.

A worker writes one status code per load into its ``ctrl`` row (cpu_experts/rings.py); the
GPU's wait kernel adds two of its own (gpu_worker/experts/ring_kernels.py). The GPU worker
catches these exceptions by type (gpu_worker/server.py) without loading the CPU kernels.
"""

from __future__ import annotations

ERR_OK = 0
ERR_EXPERT_ID = 1       # kernels.py: an expert id outside the layer
ERR_NON_FINITE = 2      # kernels.py: inf/nan in an intermediate activation
ERR_NO_LAYER = 100      # worker.py: the layer is not in the worker's shard
ERR_INTERNAL = 101      # worker.py: an exception in the worker (a bug), traceback on stderr
ERR_TIMEOUT = 201       # the GPU's wait for the workers timed out
ERR_ABORTED = 202       # the GPU's wait gave up: the watchdog saw a worker die

STATUS_REASONS = {ERR_EXPERT_ID: "expert id out of range",
                  ERR_NON_FINITE: "non-finite intermediate activation",
                  ERR_NO_LAYER: "layer missing from the worker's shard",
                  ERR_INTERNAL: "worker bug, traceback on its stderr"}


class NonFiniteActivation(ValueError):
    """An input to the canonical quantizer holds inf or nan (cpu_experts/quant.py)."""


class CpuWorkerDied(RuntimeError):
    """A cpu_experts worker process exited; names the worker."""

    def __init__(self, index: int, pid: int, returncode: int | None, detail: str = "") -> None:
        self.index, self.pid, self.returncode = index, pid, returncode
        super().__init__(f"cpu_experts worker {index} (pid {pid}) died with exit code "
                         f"{returncode}{': ' + detail if detail else ''}")


class CpuExpertError(RuntimeError):
    """A worker rejected a dispatch (bad expert id, unknown layer, non-finite activations...)."""


def status_error(layer: int, code: int, reasons: dict[int, str] | None = None
                 ) -> CpuExpertError:
    """The error for a worker's non-zero ``STATUS`` on ``layer``."""
    reason = {**STATUS_REASONS, **(reasons or {})}.get(code, "error")
    return CpuExpertError(f"layer {layer}: worker status {code} ({reason})")
