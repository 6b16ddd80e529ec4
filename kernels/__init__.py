"""GPU side of Ring²: the capture kernels and the rings that launch them.

* ``words``: the control block's word layout (imports nothing);
* ``capture``: the Triton capture kernels (run on the CPU under ``TRITON_INTERPRET=1``, as CI does);
* ``traced``: captures as traced torch ops inside compiled code;
* ``side``: the compile pass that chains captures onto a side stream;
* ``site_launch``: one site's capture launches (geometry, eager fast paths);
* ``kernel_ring``: the ring whose captures run those kernels (``InterpretRing``: in host memory),
  with ``control_block`` (each step's control words to the device), ``host_staging`` (the drain's
  copies to host memory) and ``traced_sites`` (which sites compiled code captures as traced ops);
* ``cudart``: cuda-python and libcuda calls (needs the ``cuda`` extra);
* ``cuda_ring``: the ring on a CUDA device (``CudaRing``) and its reader in a drain process.

Nothing here is imported on the CPU path.
"""
