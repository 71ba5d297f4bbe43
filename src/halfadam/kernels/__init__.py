"""The hand-written kernels, one module per execution, each with its source beside its loader:

* :mod:`halfadam.kernels.cpp`: the C++ CPU kernel (``adam_cpu.cpp``), built on first use with
  ``torch.utils.cpp_extension`` into a cache keyed by everything that changes the library;
* :mod:`halfadam.kernels.triton`: the Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

Both are thin layers over :mod:`halfadam.functional` (the math) and :mod:`halfadam.encodings` (the
specification of every state encoding), term for term, and compute the same bits as the reference
execution; :mod:`halfadam.executions` chooses between them and the eager/compiled paths.
"""
