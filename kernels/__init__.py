"""GPU side of Ring²: the capture kernels (Triton, ``capture``) and the CUDA ring (``cuda_ring``).

Nothing here is imported on the CPU path. ``capture`` needs Triton (and runs on the CPU under
``TRITON_INTERPRET=1``, which is how CI tests it); ``cuda_ring`` needs cuda-python (the ``cuda``
extra) and a CUDA device.
"""
