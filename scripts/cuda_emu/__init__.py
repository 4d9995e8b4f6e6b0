"""A CPU emulator of the CUDA kernels (CuPy RawModule / RawKernel sources) for development
without a GPU: ``python -m scripts.cuda_emu.run tests/gpu/FILE.py`` runs a GPU test file with a
fake ``cupy`` whose kernels are compiled with g++ (docs/gpu_step.md, "Checking kernels
without a GPU").

* ``cuda_emu.h`` / ``cuda_emu_builtins.h``: the CUDA built-ins, threads as fibers;
* :mod:`scripts.cuda_emu.module`: ``RawModule``, ``RawKernel``, the errors;
* :mod:`scripts.cuda_emu.ptx`: inline PTX as C++;
* :mod:`scripts.cuda_emu.fake_cupy`, ``fake_cuda``, ``elementwise``: the fake CuPy;
* :mod:`scripts.cuda_emu.plugin`: the pytest plugin that installs it; ``run``: the command;
* :mod:`scripts.cuda_emu.audit`: ``with audit() as a:`` records launches, syncs, uploads and
  allocations (scripts/step_audit.py).
"""

from scripts.cuda_emu.audit import Audit, audit

__all__ = ["Audit", "audit"]
