"""The GPU worker's side of the routed experts that do not all live on its backend.

    model (gpu_worker/model/model.py) -> RoutedExperts (gpu_worker/routed_experts.py)
        -> ExpertPlacement (placement.py)
            -> HostPath (host_path.py): NumPy copies, CpuExpertPool.dispatch[_quantized]
            -> LaunchedPath (launched_path.py) -> PinnedRing (pinned_ring.py, CUDA in
               ring_kernels.py): GPU kernels ring the CPU workers through the shared ring

``split.py`` decides which experts go to the CPU workers before any weight is read;
``counters.py`` keeps the per-step counters the runner reports.
"""
