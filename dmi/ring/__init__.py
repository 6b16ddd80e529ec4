"""Ring²: a payload ring (where captured rows are written) plus a meta ring of fixed-size records.

* ``records``: the meta record format, the ring's alignment, a drain process's progress words;
* ``bytering``: the payload ring's byte bookkeeping (head, tail, contiguous blocks);
* ``layout``: where a step's captures go (slots, the step's control record, reusable layouts);
* ``budget``: the D2H bandwidth cap (token bucket), the drop log and the ring's counters;
* ``protocol``: the host side every backend shares (reservation, backpressure, drops, drain);
* ``cpu``: the reference backend in host memory (``dmi.kernels.cuda_ring`` holds the CUDA one);
* ``share``: a ring drained in another process (``policy.drain: process``);
* ``factory``: the backend for a device (``make_ring``) and the drain process's reader.
"""
