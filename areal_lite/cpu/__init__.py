"""Speed measures for CPUs, in one room: thread pinning and the split of cores between generation
and training (``threads.py``), the trainer's fp32 products through oneDNN (``linear.py``), glibc's
malloc kept from returning memory (``malloc.py``), the garbage collector kept off start-up objects
(``gc_freeze.py``), the dtype a CPU computes fastest (``precision.py``), and the embedded engine's
C++ kernels built at run time (``build.py``; ``decode_attention.py``, ``fused_ops.py``)."""
